#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates .venv, installs kvd with
# its test and bench extras, checks the code with ruff (lint and format) and
# mypy (the rules in pyproject.toml), runs pytest in KVD_TEST_WORKERS processes (2: one
# a core here; each takes whole modules). Extra arguments go to pytest; the
# suite runs whatever they say, and any of them failing fails the command.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
kvd_ensure_venv test,bench
style=0
"$KVD_VENV/bin/ruff" check kvd kvctl kernels tests scripts || style=$?
"$KVD_VENV/bin/ruff" format --check kvd kvctl kernels tests scripts || style=$?
"$KVD_VENV/bin/mypy" || style=$?  # kvd, kvctl, the kernels and the scripts, as [tool.mypy] says
status=0
"$KVD_VENV/bin/python" -m pytest -n "${KVD_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
# pytest exits 5 when it collected nothing (e.g. a -k that matches no test).
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    status=0
fi
if [ "$status" -eq 0 ] && [ "$style" -ne 0 ]; then
    echo "ruff or mypy found problems (above): ruff check --fix, ruff format, mypy" >&2
    status=1
fi
exit "$status"
