#!/usr/bin/env bash
# One command for a GPU machine with no network access: install a wheel built elsewhere, show the
# driver/device, run the GPU tests, a compute-sanitizer pass over a small subset, and the
# benchmark; print a summary table. Logs go to $OUT (or ./gpu-logs).
#
#   scripts/gpu_check.sh [path/to/hostkv_rs-*.whl]
#
# Without an argument the newest target/wheels/hostkv_rs-*.whl is used; with SKIP_INSTALL=1 the
# already-installed package is tested. Build the wheel on a machine with the Rust toolchain:
#   maturin build --release -o target/wheels
# Every step runs even when an earlier one fails; the exit code is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
LOG=${OUT:-$ROOT/gpu-logs}
mkdir -p "$LOG"
declare -a NAMES=() RESULTS=() DETAILS=()

record() {  # name rc detail
    NAMES+=("$1")
    if [[ $2 -eq 0 ]]; then RESULTS+=("PASS"); else RESULTS+=("FAIL($2)"); fi
    DETAILS+=("$3")
}

step() {  # name logfile command...
    local name=$1 log=$2
    shift 2
    echo "== $name  (log: $log)"
    "$@" >"$log" 2>&1
    local rc=$?
    tail -n 15 "$log"
    return $rc
}

# 1. install
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    WHEEL=${1:-$(ls -t target/wheels/hostkv_rs-*.whl 2>/dev/null | head -1)}
    if [[ -z "$WHEEL" || ! -f "$WHEEL" ]]; then
        echo "gpu_check.sh: no wheel given and none in target/wheels" >&2
        exit 2
    fi
    step install "$LOG/install.log" $PY -m pip install --no-index --no-deps --force-reinstall "$WHEEL"
    record install $? "$(basename "$WHEEL")"
fi

# 2. machine and runtime
{
    echo "# nvidia-smi"; nvidia-smi 2>&1 || echo "(nvidia-smi not available)"
    echo "# ldd --version"; ldd --version 2>&1 | head -1
    echo "# python / torch"; $PY -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} >"$LOG/machine.log" 2>&1
cat "$LOG/machine.log"
INFO=$(cd /tmp && $PY -c "import hostkv_rs; print(hostkv_rs.runtime_info())" 2>&1)
rc=$?
echo "== runtime_info: $INFO" | tee "$LOG/runtime_info.log"
[[ $rc -eq 0 && "$INFO" == *"CUDA available"* ]]
record runtime_info $? "$INFO"
# The no-device path of the probe: the driver is present but hides every GPU.
NODEV=$(cd /tmp && CUDA_VISIBLE_DEVICES="" $PY -c "from hostkv_rs import _core; print(_core.cuda_available(), '|', _core.runtime_info())" 2>&1)
echo "== CUDA_VISIBLE_DEVICES='': $NODEV" | tee -a "$LOG/runtime_info.log"
[[ "$NODEV" == False* ]]
record probe_no_device $? "${NODEV:0:100}"

# 3. GPU tests (from tests/ so the installed wheel is imported, not the source tree)
summary() { grep -E "[0-9]+ (passed|failed|skipped|errors?)" "$1" | tail -1; }
(cd tests && step gpu-tests "$LOG/pytest_gpu.log" $PY -m pytest -q -p no:cacheprovider gpu -rs \
    --junitxml="$LOG/pytest_gpu.xml")
rc=$?
GPU_SUMMARY=$(summary "$LOG/pytest_gpu.log")
# On a GPU machine nothing may be skipped: a skip here means CUDA was not usable.
if [[ $rc -eq 0 && ( "$GPU_SUMMARY" != *passed* || "$GPU_SUMMARY" == *skipped* ) ]]; then rc=3; fi
record gpu-tests $rc "$GPU_SUMMARY"

# 4. CPU suite too (emulated kernels, pools), as a sanity check of the wheel
(cd tests && step cpu-tests "$LOG/pytest_cpu.log" $PY -m pytest -q -p no:cacheprovider . \
    --ignore=gpu -x)
rc=$?
record cpu-tests $rc "$(summary "$LOG/pytest_cpu.log")"

# 5. compute-sanitizer memcheck on the smoke subset
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [[ -n "$SAN" ]]; then
    (cd tests && step sanitizer "$LOG/sanitizer.log" "$SAN" --tool memcheck --leak-check no \
        --error-exitcode 99 --target-processes all \
        $PY -m pytest -q -p no:cacheprovider gpu -k smoke)
    rc=$?
    record sanitizer $rc "$(grep -E 'ERROR SUMMARY' "$LOG/sanitizer.log" | tail -1) $(summary "$LOG/sanitizer.log")"
else
    record sanitizer 0 "skipped: compute-sanitizer not found"
fi

# 6. benchmark (the CLI is part of the package; skip if this build lacks it)
if (cd /tmp && $PY -c "import hostkv_rs.cli" >/dev/null 2>&1); then
    (cd /tmp && step bench "$LOG/bench.log" $PY -m hostkv_rs bench --device cuda --no-progress)
    rc=$?
    (cd /tmp && $PY -m hostkv_rs bench --device cuda --quick --json >"$LOG/bench.json" 2>"$LOG/bench_json.err")
    record bench $rc "table in bench.log, JSON in bench.json"
else
    record bench 0 "skipped: hostkv-rs bench not in this build"
fi

# 7. summary
echo
echo "== summary (logs in $LOG)"
printf '%-16s %-9s %s\n' STEP RESULT DETAIL | tee "$LOG/summary.txt"
fail=0
for i in "${!NAMES[@]}"; do
    printf '%-16s %-9s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${DETAILS[$i]}" | tee -a "$LOG/summary.txt"
    [[ "${RESULTS[$i]}" == PASS ]] || fail=1
done
exit $fail
