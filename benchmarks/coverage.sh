#!/usr/bin/env bash
# Line coverage of parlab/ under the README's test command, ranks and subprocesses included.
#
#   bash benchmarks/coverage.sh              # from the repository root, with .venv set up: the README's command
#   bash benchmarks/coverage.sh tests/x.py   # or only the paths given
#
# coverage.py (>= 7.10) follows every process the suite starts: `patch = fork` gives ranks forked by parlab.run a
# data file of their own, `patch = _exit` saves it when a rank ends with os._exit, and `patch = subprocess` starts
# coverage in torchrun's workers, `parlab grade`'s runs and every notebook kernel nbval starts. Prints the report's
# total line; the figure goes in benchmarks/README.md beside the suite's time.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pip install -q "coverage>=7.10"
# the README's test command's options and paths (its xdist workers are subprocesses: `patch = subprocess` covers them)
PYTEST_ARGS=(-n 3 --dist loadfile --no-loadscope-reorder --nbval-lax --nbval-current-env --nbval-cell-timeout=300)
paths=("$@"); [ $# -gt 0 ] || paths=(tests)
data="$(pwd)/.coverage-data"
rm -rf "$data" && mkdir -p "$data"
cat > "$data/rc" <<RC
[run]
source = $(pwd)/parlab
parallel = true
patch = subprocess, _exit, fork
data_file = $data/.coverage
[report]
precision = 1
RC
.venv/bin/python -m coverage run --rcfile="$data/rc" -m pytest -q -p no:cacheprovider "${PYTEST_ARGS[@]}" \
    "${paths[@]}" || echo "pytest exit $?"
.venv/bin/python -m coverage combine -q --rcfile="$data/rc" "$data"
.venv/bin/python -m coverage report --rcfile="$data/rc" > "$data/report.txt"
tail -1 "$data/report.txt"
