#!/usr/bin/env bash
# kvbm's GPU checks, all in one go, with a timeout each, ending with a compact table.
# Meant for a GPU machine with the NVIDIA driver, CUDA and Python 3 with PyTorch, but no Rust
# toolchain and no network: run it from the bundle scripts/build-gpu-bundle.sh makes
# (kvbm-bench, the kvbm wheel, this script), or from a repository with a release build.
#
#   ./gpu-check.sh                    # results (logs, results.jsonl) go to $OUT or a temp dir
#   KVBM_GPU_CHECK_EMULATED=1 ./scripts/gpu-check.sh   # a dry run on the emulated device
#   KVBM_GPU_CHECK_SIMULATED=1 ./scripts/gpu-check.sh  # a dry run of the CUDA back end itself,
#       on the simulated driver (kvbm-cuda-sim's libkvbm_cuda_sim.so, found next to kvbm-bench
#       or named by KVBM_SIM_DRIVER, loaded as libcuda.so): strict, streams jittered
#
# Without an NVIDIA GPU it says so and exits 0.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DEVICE=cuda
GIB="${KVBM_GPU_CHECK_GIB:-1}"      # GiB per direction per pass of each copy run
PIN_GIB="${KVBM_GPU_CHECK_PIN_GIB:-16}"
BLOCKS="${KVBM_GPU_CHECK_BLOCKS:-1024}"
SIMULATED="${KVBM_GPU_CHECK_SIMULATED:-0}"
if [ "${KVBM_GPU_CHECK_EMULATED:-0}" = 1 ] && [ "$SIMULATED" = 1 ]; then
  echo "gpu-check: KVBM_GPU_CHECK_EMULATED=1 and KVBM_GPU_CHECK_SIMULATED=1: choose one" >&2
  exit 2
fi
if [ "$SIMULATED" = 1 ]; then
  GIB="${KVBM_GPU_CHECK_GIB:-0.125}"
  PIN_GIB="${KVBM_GPU_CHECK_PIN_GIB:-0.5}"
  BLOCKS="${KVBM_GPU_CHECK_BLOCKS:-64}"
  echo "gpu-check: dry run of the CUDA back end on the simulated driver"
elif [ "${KVBM_GPU_CHECK_EMULATED:-0}" = 1 ]; then
  DEVICE=emulated
  GIB="${KVBM_GPU_CHECK_GIB:-0.125}"
  PIN_GIB="${KVBM_GPU_CHECK_PIN_GIB:-0.5}"
  BLOCKS="${KVBM_GPU_CHECK_BLOCKS:-64}"
  echo "gpu-check: dry run on the emulated device"
else
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to check."
    exit 0
  fi
fi
BENCH="${KVBM_BENCH:-}"
CANDIDATES=("$HERE/kvbm-bench" "$HERE/../target/release/kvbm-bench")
# A debug build is fine for a dry run, never for figures from a GPU.
if [ "$SIMULATED" = 1 ]; then CANDIDATES+=("$HERE/../target/debug/kvbm-bench"); fi
for candidate in "${CANDIDATES[@]}"; do
  if [ -z "$BENCH" ] && [ -x "$candidate" ]; then BENCH="$candidate"; fi
done
if [ -z "$BENCH" ]; then
  echo "gpu-check: kvbm-bench not found (run scripts/build-gpu-bundle.sh, or cargo build --release -p kvbm-bench)" >&2
  exit 2
fi
OUT="${OUT:-$(mktemp -d -t kvbm-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
if [ "$SIMULATED" = 1 ]; then
  # The simulated driver built with this kvbm-bench (same directory), unless named.
  SIM_DRIVER="${KVBM_SIM_DRIVER:-$(dirname "$BENCH")/libkvbm_cuda_sim.so}"
  if [ ! -f "$SIM_DRIVER" ]; then
    echo "gpu-check: simulated driver $SIM_DRIVER not found (cargo build -p kvbm-cuda-sim with the same profile, or set KVBM_SIM_DRIVER)" >&2
    exit 2
  fi
  mkdir -p "$OUT/sim-cuda"
  for name in libcuda.so libcuda.so.1; do
    ln -f "$SIM_DRIVER" "$OUT/sim-cuda/$name" 2>/dev/null || cp -f "$SIM_DRIVER" "$OUT/sim-cuda/$name"
  done
  export LD_LIBRARY_PATH="$OUT/sim-cuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KVBM_SIM_STRICT=1 KVBM_SIM_REPORT="$OUT/sim-violations.txt"
  export KVBM_SIM_JITTER_SEED="${KVBM_SIM_JITTER_SEED:-14}" KVBM_SIM_JITTER_US="${KVBM_SIM_JITTER_US:-200}"
  unset KVBM_SIM_FAIL
  echo "gpu-check: driver $SIM_DRIVER, KVBM_SIM_JITTER_SEED=$KVBM_SIM_JITTER_SEED KVBM_SIM_JITTER_US=$KVBM_SIM_JITTER_US"
fi
: > "$RESULTS"
START=$(date +%s)

# run NAME SECONDS COMMAND...: runs it under a timeout, keeps its log, and records its last
# JSON line (or null) with its exit status.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$OUT/$name.log" | grep -v '^{' | sed 's/^/   /'
  local json
  json=$(grep '^{' "$OUT/$name.log" | tail -n 1)
  printf '{"check":"%s","rc":%d,"result":%s}\n' "$name" "$rc" "${json:-null}" >>"$RESULTS"
}

# 1. The device and the driver; which back end `auto` picks.
if [ "$DEVICE" = cuda ] && [ "$SIMULATED" != 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
fi
run discovery 60 "$BENCH" copy --device auto --gib 0.0625 --iterations 1 --json

# 2. The pinned host pool: time to the first usable chunk and to all of it.
run "pin-${PIN_GIB}gib" 240 "$BENCH" pin --device "$DEVICE" --gib "$PIN_GIB" --json

# 3. Copies through the streams, GPU side placed by kvbm-core, at the Qwen3-0.6B shape (28 layers,
#    8 KV heads of 128, bf16, 16-token blocks: 1.75 MiB): vLLM 0.33's default LBNHC (28 pieces a
#    block), the block-outermost BLNHC kvbm asks vLLM for (1 piece), the head-major LHBNC (224
#    pieces), the older per-layer outer-first (56 pieces) and a contiguous GPU side; then LBNHC and
#    BLNHC with 64-token blocks (7 MiB). D2H, H2D, both at once, and a memcpy of the same bytes;
#    every byte verified.
for layout in lbnhc blnhc lhbnc outer-first contiguous; do
  run "copy-$layout" 120 "$BENCH" copy --device "$DEVICE" --layout "$layout" \
    --gib "$GIB" --iterations 2 --json
done
for layout in lbnhc blnhc; do
  run "copy-$layout-64tok" 120 "$BENCH" copy --device "$DEVICE" --layout "$layout" \
    --block-size 64 --gib "$GIB" --iterations 2 --json
done

# 4. The LBNHC copy with cuMemcpyBatchAsync off, coalescing off, and both off.
for flags in "0 1" "1 0" "0 0"; do
  set -- $flags
  run "copy-lbnhc-batch$1-coalesce$2" 120 env KVBM_COPY_BATCH=$1 KVBM_COPY_COALESCE=$2 \
    "$BENCH" copy --device "$DEVICE" --layout lbnhc --gib "$GIB" --iterations 2 --json
done

# 5. Through the block manager (allocation, piece lists, completion, registration): Qwen3-0.6B
#    blocks (1.75 MiB) in vLLM 0.33's LBNHC and BLNHC, and the older per-layer outer-first.
for layout in lbnhc blnhc outer-first; do
  run "offload-$layout" 180 "$BENCH" offload --device "$DEVICE" --engine manager --layout "$layout" \
    --blocks "$BLOCKS" --host-gb $(( (BLOCKS * 2 + 999) / 1000 + 1 )) --json
done
#    The same through the split engine the vLLM connector runs (the leader's plan as bytes, the
#    worker executing it), LBNHC and BLNHC.
for layout in lbnhc blnhc; do
  run "offload-split-$layout" 180 "$BENCH" offload --device "$DEVICE" --engine split \
    --layout "$layout" --blocks "$BLOCKS" --host-gb $(( (BLOCKS * 2 + 999) / 1000 + 1 )) --json
done

# 6. The connector's worker side with real tensors (torch CUDA), through the pinned pool and the
#    disk tier, if Python, torch and the kvbm wheel are here.
WHEEL=$(ls "$HERE"/kvbm-*.whl 2>/dev/null | head -n 1)
PY="${PYTHON:-python3}"
if [ "$SIMULATED" = 1 ]; then
  # Torch has no CUDA tensors on the simulated driver: kvbm.testing's cuda:0 stand-ins over its
  # device memory take their place, if the kvbm package is importable (scripts/test.sh's .venv).
  SIM_PY="$PY"
  if [ -x "$HERE/../.venv/bin/python" ]; then SIM_PY="$HERE/../.venv/bin/python"; fi
  if "$SIM_PY" -c "import kvbm, numpy" >/dev/null 2>&1; then
    run connector 180 env KVBM_GPU_CHECK_DEVICE=simulated "$SIM_PY" "$HERE/gpu_connector_check.py"
  else
    echo "== connector: skipped (the kvbm package is not importable)"
  fi
elif command -v "$PY" >/dev/null 2>&1; then
  if [ -n "$WHEEL" ] && ! "$PY" -c "import kvbm" >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages "$OUT/venv" >/dev/null 2>&1 \
      && "$OUT/venv/bin/python" -m pip install --quiet --no-deps --no-index "$WHEEL" >"$OUT/pip.log" 2>&1 \
      && PY="$OUT/venv/bin/python"
  fi
  if "$PY" -c "import kvbm" >/dev/null 2>&1; then
    run connector 180 env KVBM_GPU_CHECK_DEVICE="$DEVICE" "$PY" "$HERE/gpu_connector_check.py"
  else
    echo "== connector: skipped (the kvbm package is not installed and no wheel is here)"
  fi
else
  echo "== connector: skipped (no python3)"
fi

echo
echo "gpu-check: $(( $(date +%s) - START )) s; logs and results.jsonl in $OUT"
# The table.
if command -v python3 >/dev/null 2>&1; then
  python3 - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
def f(x, spec=".1f"):
    return format(x, spec) if isinstance(x, (int, float)) else "-"
print(f"{'check':36} {'rc':>3} {'pcs':>4} {'D2H':>7} {'H2D':>7} {'both D2H':>9} {'both H2D':>9} {'memcpy':>7} {'us/blk':>7}  notes")
for row in rows:
    r = row.get("result") or {}
    notes = []
    keys = ("device", "description", "driver_version") if row["check"] == "discovery" else ("device",)
    for key in keys + ("batch_copy", "coalesce", "first_chunk_ready_s",
                "full_ready_s", "pin_status", "verified", "d2h_vs_memcpy", "h2d_vs_memcpy", "error"):
        if key in r and r[key] is not None:
            notes.append(f"{key}={r[key] if not isinstance(r[key], float) else round(r[key], 3)}")
    print(f"{row['check']:36} {row['rc']:>3} {f(r.get('pieces_per_block'), 'd'):>4} "
          f"{f(r.get('d2h_gbps')):>7} {f(r.get('h2d_gbps')):>7} "
          f"{f(r.get('both_d2h_gbps')):>9} {f(r.get('both_h2d_gbps')):>9} {f(r.get('memcpy_gbps')):>7} "
          f"{f(r.get('submit_us_per_block'), '.2f'):>7}  " + " ".join(notes))
failed = [row["check"] for row in rows if row["rc"] != 0]
print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
PY
else
  cat "$RESULTS"
fi
