#!/usr/bin/env bash
# The test command: set up the environment, lint, run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check mt tests scripts experiments
ruff format --check mt tests scripts experiments
python -m pytest -q "$@"
