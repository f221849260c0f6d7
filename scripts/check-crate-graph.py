#!/usr/bin/env python3
"""The crate graph, checked: which kvbm crate may depend on which (ARCHITECTURE.md, "Crates").

- the leaves (kvbm-events, kvbm-cuda, kvbm-disk) depend on no kvbm crate;
- kvbm-cuda-sim (the simulated CUDA driver, a test tool) depends on no kvbm crate either;
- kvbm-router depends on kvbm-events only;
- kvbm-core depends on the leaves only;
- kvbm-py (the Python bindings) depends on kvbm-core only;
- kvbm-mocker (the simulated vLLM fleet) depends on kvbm-events, kvbm-core and kvbm-router (for
  kvbm_router::tokenize::ModelTokenizer only: one tokenizer for the router and the mocker);
- kvbm-bench may use anything.

Reads `cargo metadata` (every dependency kind: normal, build and dev); prints each violation and
exits 1 if there is any. Run from anywhere in the repository.
"""

import json
import subprocess
import sys

ALLOWED = {
    "kvbm-events": set(),
    "kvbm-cuda": set(),
    "kvbm-cuda-sim": set(),
    "kvbm-disk": set(),
    "kvbm-router": {"kvbm-events"},
    "kvbm-core": {"kvbm-events", "kvbm-cuda", "kvbm-disk"},
    "kvbm-py": {"kvbm-core"},
    "kvbm-mocker": {"kvbm-events", "kvbm-core", "kvbm-router"},
}


def main() -> int:
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--no-deps", "--offline"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    packages = {p["name"]: p for p in meta["packages"]}
    ours = {name for name in packages if name.startswith("kvbm")}
    bad = []
    for name in sorted(ours):
        deps = {d["name"] for d in packages[name]["dependencies"]} & ours
        if name not in ALLOWED:
            if name != "kvbm-bench":
                bad.append(f"{name}: a kvbm crate this check does not know; add its rule")
            continue
        for dep in sorted(deps - ALLOWED[name]):
            allowed = ", ".join(sorted(ALLOWED[name])) or "no kvbm crate"
            bad.append(f"{name} depends on {dep}; it may depend on {allowed}")
    for line in bad:
        print(f"crate graph: {line}", file=sys.stderr)
    if not bad:
        print(f"crate graph: {len(ours)} kvbm crates, every dependency allowed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
