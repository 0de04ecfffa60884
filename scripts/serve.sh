#!/usr/bin/env bash
# Start the daemon on the embedded default model with the dev configuration
# (the venv gets openai too: the README's Python example runs in it).
# Extra arguments go to `kvd serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
kvd_ensure_venv client  # and openai, for the README's Python example
exec "$KVD_VENV/bin/kvd" serve --config etc/kvd.dev.toml "$@"
