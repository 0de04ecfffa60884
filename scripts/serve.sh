#!/usr/bin/env bash
# Start the daemon on the embedded default model with the dev configuration.
# Extra arguments go to `kvd serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
kvd_ensure_venv
exec "$KVD_VENV/bin/kvd" serve --config etc/kvd.dev.toml "$@"
