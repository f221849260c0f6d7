#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh needs on a GPU machine without a Rust toolchain or network:
# the kvbm-bench binary, the kvbm wheel (abi3, any Python 3.9+), and the check scripts, in
# dist/gpu-bundle/ and dist/gpu-bundle.tar.gz (well under 64 MiB).
#
#   ./scripts/build-gpu-bundle.sh            # then copy dist/gpu-bundle.tar.gz to the GPU machine:
#   tar xzf gpu-bundle.tar.gz && ./gpu-bundle/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=dist/gpu-bundle
rm -rf "$OUT" dist/gpu-bundle.tar.gz
mkdir -p "$OUT"

cargo build --release -p kvbm-bench
cp target/release/kvbm-bench "$OUT/"
strip "$OUT/kvbm-bench" 2>/dev/null || true

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "maturin>=1.5,<2"
# The CUDA driver is loaded at run time, so the wheel links nothing GPU-specific.
.venv/bin/maturin build --release --quiet -m kvbm-py/Cargo.toml --out "$OUT" --compatibility linux --strip

cp scripts/gpu-check.sh scripts/gpu_connector_check.py "$OUT/"
tar -C dist -czf dist/gpu-bundle.tar.gz gpu-bundle
size=$(stat -c %s dist/gpu-bundle.tar.gz)
echo "dist/gpu-bundle.tar.gz: $((size / 1024 / 1024)) MiB ($size bytes)"
if [ "$size" -ge $((64 * 1024 * 1024)) ]; then
  echo "the bundle is over 64 MiB" >&2
  exit 1
fi
