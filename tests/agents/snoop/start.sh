#!/usr/bin/env bash
# The snooping agent (see config.yaml): snoop.py does everything; $SNOOP_TARGETS (passed with --agent_env) says
# where the test put its secrets.
exec python "$(dirname "$0")/snoop.py"
