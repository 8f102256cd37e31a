#!/usr/bin/env bash
# Sets up a virtual environment in .venv with the exact CI pins (requirements/ci.txt) and the
# project installed editable. Safe to run again. Used by both README commands and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/ci.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
