#!/usr/bin/env bash
# Every test: lint, the PTX and driver-ABI checks, cargo test, build + install the wheel, stubtest,
# pytest, the SGLang releases. Installs what it needs itself.
# `.ci/run` runs exactly this. Works on a machine with or without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

echo "== install test dependencies"
$PY -m pip install -q "maturin>=1.14,<2" torch numpy psutil pytest hypothesis pytest-benchmark ruff mypy
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# Mooncake Store for the hostkv_rs.l3 tests (tests/l3/test_mooncake.py; they skip, with the reason,
# where this fails): the wheel, and the two Debian libraries its native code loads (no RDMA needed).
if ! $PY -c "import ctypes; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('libnuma.so.1')" 2>/dev/null; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -qq libibverbs1 libnuma1 >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libibverbs1 libnuma1 >/dev/null 2>&1; }; } ||
      echo "   apt-get could not install libibverbs1 libnuma1: the Mooncake tests will skip"
  else
    echo "   no apt-get as root here: libibverbs1 libnuma1 not installed, the Mooncake tests will skip"
  fi
fi
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1
$PY -c "import importlib.metadata as m, sys; sys.exit(m.version('${MOONCAKE%%=*}') != '${MOONCAKE##*=}')" 2>/dev/null ||
  $PY -m pip install -q "$MOONCAKE" || echo "   pip could not install $MOONCAKE: the Mooncake tests will skip"

echo "== lint"
cargo fmt --all -- --check
# With and without the kernel emulator: the release wheel leaves it out, the tests need it.
cargo clippy --all-targets --locked -- -D warnings
cargo clippy --all-targets --locked --features emulator -- -D warnings
# The release wheel's bindings, and the test wheel's (emulator and raw entry points).
PYO3_BUILD_EXTENSION_MODULE=1 cargo clippy --features python --lib --locked -- -D warnings
PYO3_BUILD_EXTENSION_MODULE=1 cargo clippy --features python,emulator,raw-calls --lib --locked -- -D warnings
$PY -m ruff check python tests

echo "== PTX: the committed PTX is what the .cu compiles to, ptxas-clean for sm_80 and sm_90"
# nvcc/ptxas from NVIDIA's PyPI wheels, in a cached venv of their own (the test interpreter's
# torch brings CUDA runtime wheels of its own version).
NVCC_VENV=${HOSTKV_NVCC_VENV:-$HOME/.cache/hostkv_rs/nvcc-13.0.88}
find_nvcc() { ls "$NVCC_VENV"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -1 || true; }
NVCC_BIN=$(find_nvcc)
if [[ -z $NVCC_BIN ]]; then
  { $PY -m venv --clear "$NVCC_VENV" && "$NVCC_VENV/bin/python" -m pip install -q \
      nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
      nvidia-cuda-runtime==13.0.96; } || echo "   could not install nvcc 13.0.88 from PyPI"
  NVCC_BIN=$(find_nvcc)
fi
if [[ -n ${NVCC_BIN:-} && -x $NVCC_BIN ]]; then
  NVCC=$NVCC_BIN bash scripts/gen_ptx.sh --check
  echo "== CUDA driver ABI against NVIDIA's cuda.h / cudaTypedefs.h (no GPU needed)"
  CUDA_INCLUDE=$(cd "$(dirname "$NVCC_BIN")/../include" && pwd) bash scripts/check_cuda_abi.sh
elif [[ -n ${CI:-} ]]; then
  # CI reaches PyPI: a run that cannot install nvcc would pass without its PTX and ABI checks.
  echo "   FAILED: no nvcc from PyPI, so the PTX and the driver ABI cannot be checked" >&2
  exit 1
else
  echo "   skipped: no nvcc (the PTX and the driver ABI are not re-checked in this run)"
fi

echo "== cargo test"
cargo test --locked --features emulator
# The benches are compiled (type-checked) by the clippy --all-targets runs above; building them
# with the bench profile here would add minutes of release LTO for nothing the tests read.

echo "== build and install the wheel"
rm -rf target/wheels target/release-wheel
# The release wheel (what `pip install .` builds): the tests check that it has no entry point
# that takes a raw address (tests/core/test_release_wheel.py).
$PY -m maturin build --release --locked -o target/release-wheel
export HOSTKV_RELEASE_WHEEL
HOSTKV_RELEASE_WHEEL=$(ls "$PWD"/target/release-wheel/hostkv_rs-*.whl)
# The test wheel: the same build with the kernel emulator, which the emulation tests run, and the
# raw entry points the driver and kernel tests call; `--features` replaces pyproject's list, so
# `python` is named again.
$PY -m maturin build --release --locked --features python,emulator,raw-calls -o target/wheels
$PY -m pip install -q --force-reinstall --no-deps target/wheels/hostkv_rs-*.whl

echo "== typed interface"
# The core's stub (python/hostkv_rs/_core.pyi) against the installed module, from tests/ so the
# wheel is what is imported.
(cd tests && $PY -m mypy.stubtest --mypy-config-file ../pyproject.toml hostkv_rs._core)

echo "== pytest"
# Run from tests/ so `import hostkv_rs` is the installed wheel, not the source tree. The emulation
# tests fail instead of skipping if the wheel lacks the emulator.
cd tests && HOSTKV_REQUIRE_EMULATION=1 $PY -m pytest -q -p no:cacheprovider

echo "== SGLang releases"
# SGLang's own construction path, controllers and classes against ours, per release, each in a
# cached venv of its own (scripts/sglang_venv.sh) over the torch that release pins, with this
# interpreter's hostkv_rs and test packages (scripts/test_sglang.sh, scripts/torch_venv.sh).
if [[ -n ${HOSTKV_SKIP_SGLANG:-} ]]; then
  echo "   skipped (HOSTKV_SKIP_SGLANG is set)"
  exit 0
fi
cd .. && PYTHON=$PY bash scripts/test_sglang.sh
