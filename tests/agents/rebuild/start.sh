#!/usr/bin/env bash
# The rebuilding agent (see config.yaml): rebuild.py does everything.
exec python "$(dirname "$0")/rebuild.py"
