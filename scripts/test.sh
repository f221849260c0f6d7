#!/usr/bin/env bash
# Every check the project has: formatting, lints (warnings are errors), and all tests.
# Needs only the Rust toolchain (cargo, rustfmt, clippy); uses cargo-nextest when installed.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi
