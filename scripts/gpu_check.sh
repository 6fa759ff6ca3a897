#!/usr/bin/env bash
# One command for a GPU machine with no network access: install a wheel built elsewhere, show the
# driver/device, run the GPU tests, a compute-sanitizer pass over our own kernels in ten tests,
# the throughput table (% of a 1 GiB pinned copy) and, where SGLang's wheels were carried in
# .whl/, the same transfers beside SGLang's TMA kernel; print a summary table. Logs go to $OUT
# (or ./gpu-logs), at most 8 files. The CPU suite is CI's job; GPU_CHECK_CPU=1 adds it here.
#
#   scripts/gpu_check.sh [path/to/hostkv_rs-*.whl]
#   PYTHON=venv/bin/python scripts/gpu_check.sh --preflight
#       here, before a GPU run: the wheel, its glibc floor, the file count, and a dry run of the
#       whole script (no GPU: its GPU steps fail fast) under the same budget
#
# Build the wheel where the Rust toolchain is, with the kernel emulator the CPU suite runs
# (`maturin build --release --features python,emulator,raw-calls -o target/wheels`, as scripts/test.sh), copy
# it with this repository's tests/ and scripts/. Without an argument the newest
# target/wheels/hostkv_rs-*.whl is used; SKIP_INSTALL=1 tests the hostkv_rs already importable.
# The wheel is installed into a private folder (pip --target, no network, no dependencies), so
# the machine's Python environment is left as it was; torch, numpy and pytest must be there.
#
# It cannot hang: every step runs under `timeout`, within a total budget (GPU_CHECK_BUDGET
# seconds, default 300: a second full run fits in a 15-minute lease with the machine's start)
# shared by all steps in order of importance; a step that no longer fits is reported as SKIP. Every step runs even when an earlier one failed; the exit status is 1 if
# any step failed, 2 if there is no wheel to install.
set -uo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-300}

if [[ "${1:-}" == --preflight ]]; then
    # What would make a GPU run fail before it starts, checked where it costs no device time.
    fail=0
    WHEEL=$(ls -t target/wheels/hostkv_rs-*.whl 2>/dev/null | head -1)
    if [[ -z "$WHEEL" ]]; then
        echo "preflight: no wheel in target/wheels (maturin build --release --locked --features python,emulator,raw-calls -o target/wheels)"
        exit 2
    fi
    echo "preflight: wheel $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
    # The GPU machine's image runs Python 3.12 on glibc 2.39 (docs/cuda.md §5).
    # The newest glibc symbol version the extension links against (a local maturin build is
    # tagged linux_x86_64, which names no floor).
    so=$(mktemp)
    unzip -p "$WHEEL" 'hostkv_rs/_core.abi3.so' >"$so" 2>/dev/null
    floor=$(readelf -V --wide "$so" 2>/dev/null | grep -oE 'GLIBC_2\.[0-9]+' | sort -t. -k2 -n | tail -1 | cut -d. -f2)
    rm -f "$so"
    if [[ -z "$floor" ]]; then
        echo "preflight: FAIL cannot read the extension's glibc symbol versions"; fail=1
    elif ((floor > 39)); then
        echo "preflight: FAIL the extension needs glibc 2.$floor, the GPU machine has 2.39"; fail=1
    else
        echo "preflight: glibc floor 2.$floor (the GPU machine has 2.39)"
    fi
    # Not `unzip | grep -q`: under pipefail grep's early exit fails the pipeline (SIGPIPE).
    listing=$(unzip -l "$WHEEL" 2>&1 || true)
    [[ $listing == *_core.abi3.so* ]] || { echo "preflight: FAIL no _core.abi3.so in the wheel"; fail=1; }
    dry=$(mktemp -d)
    t0=$SECONDS
    OUT=$dry GPU_CHECK_BUDGET=$BUDGET bash "$SELF" "$ROOT/$WHEEL" >"$dry.log" 2>&1
    took=$((SECONDS - t0))
    files=$(find "$dry" -type f | wc -l)
    echo "preflight: dry run (no GPU here) took ${took}s of a ${BUDGET}s budget and wrote $files file(s)"
    ((files <= 8)) || { echo "preflight: FAIL more than 8 output files: $(ls "$dry")"; fail=1; }
    [[ -s "$dry/summary.txt" ]] || { echo "preflight: FAIL the dry run wrote no summary (see $dry.log)"; fail=1; }
    ((took <= BUDGET + 30)) || { echo "preflight: FAIL the dry run overran its budget"; fail=1; }
    echo "preflight: $([[ $fail == 0 ]] && echo OK || echo FAILED); summary of the dry run:"
    cat "$dry/summary.txt" 2>/dev/null
    exit $fail
fi
LOG=${OUT:-$ROOT/gpu-logs}
mkdir -p "$LOG"
START=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
declare -a NAMES=() RESULTS=() DETAILS=()

record() {  # name result detail
    NAMES+=("$1")
    RESULTS+=("$2")
    DETAILS+=("$3")
}

verdict() {  # rc -> PASS / TIMEOUT / FAIL(rc)
    case $1 in
        0) echo PASS ;;
        124 | 137) echo "FAIL(timeout)" ;;
        *) echo "FAIL($1)" ;;
    esac
}

# Seconds a step may take: its own cap, cut to what is left of the budget (0: skip it).
allow() {
    local left=$((BUDGET - (SECONDS - START) - 5))
    if ((left < 20)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}

# A probe's timeout: its own cap, cut to what is left of the budget, never under 5 s (a timeout
# of 0 would mean none at all).
cap() {
    local a
    a=$(allow "$1")
    ((a < 5)) && a=5
    echo "$a"
}

run_step() {  # seconds logfile command... ; output appended to logfile, last lines shown
    local secs=$1 log=$2
    shift 2
    if ((secs <= 0)); then
        echo "(skipped: time budget spent)" >>"$log"
        return 125
    fi
    echo "\$ $*" >>"$log"
    timeout -k 15 "$secs" "$@" >>"$log" 2>&1
    local rc=$?
    ((rc == 124 || rc == 137)) && echo "(killed after ${secs}s)" >>"$log"
    return $rc
}

summary_line() { grep -aE "[0-9]+ (passed|failed|skipped|errors?)" "$1" | tail -1; }

ENVLOG=$LOG/env.log
: >"$ENVLOG"

# 1. install (into a private folder: nothing else on the machine changes)
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    WHEEL=${1:-$(ls -t target/wheels/hostkv_rs-*.whl 2>/dev/null | head -1)}
    if [[ -z "$WHEEL" || ! -f "$WHEEL" ]]; then
        echo "gpu_check.sh: no wheel given and none in target/wheels" >&2
        exit 2
    fi
    SITE=$(mktemp -d /tmp/hostkv-site.XXXXXX)
    echo "== install $(basename "$WHEEL") into $SITE"
    run_step "$(allow 120)" "$ENVLOG" $PY -m pip install --no-index --no-deps --no-compile \
        --disable-pip-version-check --target "$SITE" "$WHEEL"
    rc=$?
    record install "$(verdict $rc)" "$(basename "$WHEEL")"
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

# 2. machine and runtime (from /tmp, so the source tree's python/ is never imported)
{
    echo "# nvidia-smi"
    timeout -k 5 "$(cap 20)" nvidia-smi 2>&1 || echo "(nvidia-smi not available)"
    echo "# nvidia-smi -q"
    timeout -k 5 "$(cap 20)" nvidia-smi -q 2>&1
    echo "# dmesg: NVRM / Xid"
    (timeout -k 5 5 dmesg 2>&1 || echo "(dmesg not readable)") | grep -E 'NVRM|Xid|not readable' | tail -20
    echo "# ldd --version"
    ldd --version 2>&1 | head -1
} >>"$ENVLOG" 2>&1
(cd /tmp && timeout -k 5 "$(cap 60)" $PY -c "
import sys, torch, hostkv_rs
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available())
print('hostkv_rs from', hostkv_rs.__file__)" >>"$ENVLOG" 2>&1)
INFO=$(cd /tmp && timeout -k 5 "$(cap 60)" $PY -c "import hostkv_rs; print(hostkv_rs.runtime_info())" 2>&1)
rc=$?
echo "# runtime_info: $INFO" >>"$ENVLOG"
[[ $rc -eq 0 && "$INFO" == *"CUDA available"* ]]
record runtime_info "$(verdict $?)" "${INFO:0:160}"
# The no-device path of the probe: the driver is there but hides every GPU.
NODEV=$(cd /tmp && CUDA_VISIBLE_DEVICES="" timeout -k 5 "$(cap 60)" $PY -c \
    "from hostkv_rs import _core; print(_core.cuda_available(), '|', _core.runtime_info())" 2>&1)
echo "# CUDA_VISIBLE_DEVICES='': $NODEV" >>"$ENVLOG"
[[ "$NODEV" == False* ]]
record probe_no_device "$(verdict $?)" "${NODEV:0:160}"
cat "$ENVLOG"

# The copy kernel's resources as the driver sees them (issue 12: 256-thread blocks, no spills,
# <= 64 registers, at least 4 blocks per SM so a copy block never needs a whole SM).
KRES=$(cd /tmp && timeout -k 5 "$(cap 60)" $PY - "$ROOT/rust/kernels/hostkv_transfer.ptx" 2>&1 <<'PYEOF'
import ctypes, sys
import torch
torch.zeros(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1")
mod = ctypes.c_void_p()
assert cu.cuModuleLoadData(ctypes.byref(mod), open(sys.argv[1], "rb").read() + b"\0") == 0
ok, out = True, []
for name in (b"hkv_transfer", b"hkv_check_indices"):
    fn = ctypes.c_void_p()
    assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, name) == 0
    def attr(a):
        v = ctypes.c_int()
        assert cu.cuFuncGetAttribute(ctypes.byref(v), a, fn) == 0
        return v.value
    blocks = ctypes.c_int()
    assert cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), fn, 256,
                                                          ctypes.c_size_t(0)) == 0
    maxt, local, regs = attr(0), attr(3), attr(4)
    ok &= maxt == 256 and local == 0 and regs <= 64 and blocks.value >= 4
    out.append(f"{name.decode()}: regs={regs} local={local}B maxntid={maxt} "
               f"blocks/SM={blocks.value}")
print("; ".join(out))
sys.exit(0 if ok else 1)
PYEOF
)
rc=$?
echo "# kernel resources: $KRES" >>"$ENVLOG"
KLAST=$(echo "$KRES" | tail -1)
record kernel_resources "$(verdict $rc)" "${KLAST:0:160}"

# pytest from tests/ (so `import hostkv_rs` is the installed wheel), without the project's
# addopts (they name plugins this machine may lack); a per-test timeout when available.
# -W default: the project's filterwarnings=error is for CI; here a warning must not turn a green
# GPU run red (it is still printed in the log).
PYTEST=($PY -m pytest -q -ra -p no:cacheprovider -o addopts= -o console_output_style=classic
    -W default)
if $PY -c "import pytest_timeout" >/dev/null 2>&1; then
    PYTEST+=(--timeout=150 --timeout-method=thread)
fi

# 3. GPU tests: on a GPU machine nothing may be skipped there (a skip means CUDA was unusable).
# tests/gpu/test_gpu_hardening.py holds issue 12's guards: destroy() waits only for its own
# stream, bounded; destroy racing transfers; copies across registration seams; capped chunks;
# refused launches counted; capture refused; first-call JIT without the GIL; one driver.
secs=$(allow 170)
if ((secs > 0)); then
    echo "== gpu tests (up to ${secs}s, log gpu_tests.log)"
    (cd tests && run_step "$secs" "$LOG/gpu_tests.log" "${PYTEST[@]}" gpu)
    rc=$?
    S=$(summary_line "$LOG/gpu_tests.log")
    if [[ $rc -eq 0 && ( "$S" != *passed* || "$S" == *skipped* ) ]]; then rc=3; fi
    record gpu-tests "$(verdict $rc)" "$S"
    tail -n 25 "$LOG/gpu_tests.log"
else
    record gpu-tests SKIP "time budget spent"
fi

# 4. compute-sanitizer memcheck over our own kernels (hkv_*) in ten smoke tests: instrumenting
# every torch kernel would not fit the budget (some sandboxes do not support it at all).
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
SAN_TESTS="smoke_mha_round_trip or (smoke_bad_gpu_index and layer_first)"
secs=$(allow 70)
if [[ -z "$SAN" ]]; then
    record sanitizer SKIP "compute-sanitizer not found"
elif ((secs == 0)); then
    record sanitizer SKIP "time budget spent"
else
    echo "== compute-sanitizer (up to ${secs}s, log sanitizer.log)"
    san_help=$("$SAN" --help 2>&1 || true)
    if [[ $san_help == *--kernel-name* ]]; then
        ONLY=(--kernel-name kns=hkv_)
    else
        ONLY=(--filter kns=hkv_)
    fi
    (cd tests && run_step "$secs" "$LOG/sanitizer.log" "$SAN" --tool memcheck --leak-check no \
        --error-exitcode 99 --print-limit 20 --target-processes all "${ONLY[@]}" \
        "${PYTEST[@]}" gpu -k "$SAN_TESTS")
    rc=$?
    S="$(grep -aE 'ERROR SUMMARY' "$LOG/sanitizer.log" | tail -1) $(summary_line "$LOG/sanitizer.log")"
    if [[ $rc -ne 0 ]] && grep -aqE "Device not supported|not supported on this platform|Unable to find injection" "$LOG/sanitizer.log"; then
        record sanitizer SKIP "compute-sanitizer cannot run here: $(grep -aoE 'Device not supported|not supported on this platform|Unable to find injection[^.]*' "$LOG/sanitizer.log" | head -1)"
    else
        record sanitizer "$(verdict $rc)" "$S"
    fi
    tail -n 8 "$LOG/sanitizer.log"
fi

# 5. the throughput table: % of a 1 GiB pinned copy per geometry x layout x backend x op (CUDA
# events), in markdown for docs/gpu-results.md
secs=$(allow 75)
if ((secs == 0)); then
    record bench SKIP "time budget spent"
else
    echo "== bench (up to ${secs}s, table in gpu_bench.md, log bench.log)"
    (cd /tmp && run_step "$secs" "$LOG/bench.log" $PY "$ROOT/scripts/gpu_bench.py" --device cuda \
        --budget $((secs - 15)) --out "$LOG/gpu_bench.md")
    rc=$?
    record bench "$(verdict $rc)" "$(head -1 "$LOG/gpu_bench.md" 2>/dev/null | cut -c1-150)"
    tail -n 30 "$LOG/bench.log"
fi

# 5b. beside SGLang 0.5.23's default HiCache kernel (TMA, 4 CTAs), where its wheels were carried
# in .whl/ (scripts/fetch_sglang_wheels.sh): rows appended to gpu_bench.md, log in bench.log
if ! ls "$ROOT"/.whl/sglang-*.whl >/dev/null 2>&1; then
    record sglang-tma SKIP "no .whl/sglang-*.whl carried (scripts/fetch_sglang_wheels.sh)"
elif (($(allow 90) == 0)); then
    record sglang-tma SKIP "time budget spent"
else
    echo "== beside SGLang's TMA kernel (log bench.log, rows in gpu_bench.md)"
    SGL_SITE=$(mktemp -d /tmp/sglang-site.XXXXXX)
    run_step "$(allow 45)" "$LOG/bench.log" $PY -m pip install -q --no-index --no-deps \
        --no-compile --disable-pip-version-check --target "$SGL_SITE" "$ROOT"/.whl/*.whl
    rc=$?
    secs=$(allow 90)
    if ((rc != 0)); then
        record sglang-tma "$(verdict $rc)" "the carried wheels did not install (bench.log)"
    elif ((secs == 0)); then
        record sglang-tma SKIP "time budget spent"
    else
        # SGLang's folder after ours: hostkv_rs is still the installed wheel.
        (cd /tmp && run_step "$secs" "$LOG/bench.log" env PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SGL_SITE" \
            $PY "$ROOT/scripts/sglang_tma_bench.py" --budget $((secs > 40 ? secs - 30 : 10)) \
            --out "$LOG/gpu_bench.md")
        rc=$?
        detail=$(grep -aE '^not run|^\| load page_first' "$LOG/gpu_bench.md" | tail -1 | cut -c1-150)
        # 3: the comparison could not run here (its line says why), which is not a failure of ours.
        if ((rc == 3)); then record sglang-tma SKIP "$detail"; else record sglang-tma "$(verdict $rc)" "$detail"; fi
    fi
    rm -rf "$SGL_SITE"
    tail -n 14 "$LOG/bench.log"
fi

# 6. the CPU suite, only when asked (GPU_CHECK_CPU=1): CI runs it; here it would not fit twice
secs=$(allow 240)
if [[ "${GPU_CHECK_CPU:-0}" != 1 ]]; then
    record cpu-tests SKIP "CI's job (GPU_CHECK_CPU=1 runs it here)"
elif ((secs > 0)); then
    echo "== cpu tests (up to ${secs}s, log cpu_tests.log)"
    (cd tests && run_step "$secs" "$LOG/cpu_tests.log" "${PYTEST[@]}" . --ignore=gpu)
    rc=$?
    record cpu-tests "$(verdict $rc)" "$(summary_line "$LOG/cpu_tests.log")"
    tail -n 15 "$LOG/cpu_tests.log"
else
    record cpu-tests SKIP "time budget spent"
fi

# 7. summary
echo
echo "== summary ($((SECONDS - START))s; logs in $LOG)"
printf '%-16s %-14s %s\n' STEP RESULT DETAIL | tee "$LOG/summary.txt"
fail=0
for i in "${!NAMES[@]}"; do
    printf '%-16s %-14s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${DETAILS[$i]}" | tee -a "$LOG/summary.txt"
    [[ "${RESULTS[$i]}" == FAIL* ]] && fail=1
done
exit $fail
