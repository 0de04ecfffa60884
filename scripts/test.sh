#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates .venv, installs kvd with
# its test and bench extras, runs pytest in KVD_TEST_WORKERS processes (2: one
# a core here; each takes whole modules). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
kvd_ensure_venv test,bench
status=0
"$KVD_VENV/bin/python" -m pytest -n "${KVD_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
# pytest exits 5 when it collected nothing (e.g. a -k that matches no test).
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    status=0
fi
exit "$status"
