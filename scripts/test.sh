#!/usr/bin/env bash
# Every test: lint, cargo test, build + install the wheel, pytest. Installs what it needs itself.
# `.ci/run` runs exactly this. Works on a machine with or without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

echo "== install test dependencies"
$PY -m pip install -q "maturin>=1.14,<2" torch numpy psutil pytest hypothesis pytest-benchmark ruff
rustup component add rustfmt clippy >/dev/null 2>&1 || true

echo "== lint"
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
PYO3_BUILD_EXTENSION_MODULE=1 cargo clippy --features python --lib --locked -- -D warnings
$PY -m ruff check python tests

echo "== cargo test"
cargo test --locked
cargo bench --locked --no-run

echo "== build and install the wheel"
rm -rf target/wheels
$PY -m maturin build --release --locked -o target/wheels
$PY -m pip install -q --force-reinstall --no-deps target/wheels/hostkv_rs-*.whl

echo "== pytest"
# Run from tests/ so `import hostkv_rs` is the installed wheel, not the source tree.
cd tests && $PY -m pytest -q -p no:cacheprovider
