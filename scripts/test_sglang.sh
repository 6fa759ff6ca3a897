#!/usr/bin/env bash
# hostkv_rs against REAL SGLang releases: for each release, build (or reuse) its CPU venv with
# scripts/sglang_venv.sh and run tests/sglang in it.
#
#   bash scripts/test_sglang.sh                    # 0.5.18 ... 0.5.23, every release
#   HOSTKV_SGLANG_RELEASES="0.5.23" bash scripts/test_sglang.sh -x -k roundtrip
#
# Extra arguments go to pytest. The venvs share the system torch and see the installed hostkv_rs
# wheel (--system-site-packages); pytest runs from tests/ so `import hostkv_rs` is that wheel, as
# in scripts/test.sh. A PYTHONPATH set by the caller is kept (PYTHONPATH=$PWD/python tests the
# source tree after scripts/dev_build.sh).
#
# Environment
#   HOSTKV_SGLANG_RELEASES   releases to test (default "0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23")
#   HOSTKV_SGLANG_VENVS      venv cache root (see scripts/sglang_venv.sh)
#   HOSTKV_SGLANG_TIMEOUT    seconds per release before it counts as failed (default 900)
# Exit status: 0 when every release passed, 1 otherwise (2: bad usage).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RELEASES=${HOSTKV_SGLANG_RELEASES:-0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23}
TIMEOUT=${HOSTKV_SGLANG_TIMEOUT:-900}

# pytest runs from tests/: make the caller's relative PYTHONPATH entries absolute first.
if [[ -n ${PYTHONPATH:-} ]]; then
  IFS=: read -r -a _pp <<<"$PYTHONPATH"
  for i in "${!_pp[@]}"; do
    [[ -n ${_pp[$i]} && ${_pp[$i]} != /* ]] && _pp[$i]="$ROOT/${_pp[$i]}"
  done
  PYTHONPATH=$(IFS=:; echo "${_pp[*]}")
  export PYTHONPATH
fi

declare -a SUMMARY=()
FAILED=0
T_ALL=$SECONDS

for REL in $RELEASES; do
  echo "== SGLang $REL: venv"
  T0=$SECONDS
  if ! VENV=$(bash scripts/sglang_venv.sh "$REL" | tail -n1) || [[ ! -x $VENV/bin/python ]]; then
    SUMMARY+=("$(printf '%-8s FAILED  venv build (%ss)' "$REL" $((SECONDS - T0)))")
    FAILED=1
    continue
  fi
  T_VENV=$((SECONDS - T0))
  echo "== SGLang $REL: pytest tests/sglang ($VENV)"
  LOG=$(mktemp)
  T1=$SECONDS
  # No GPU is needed, and none is used: tests compare against SGLang's CPU behaviour.
  (cd tests && CUDA_VISIBLE_DEVICES="" PYTHONDONTWRITEBYTECODE=1 timeout "$TIMEOUT" \
      "$VENV/bin/python" -m pytest sglang -q -p no:cacheprovider "$@") 2>&1 | tee "$LOG"
  RC=${PIPESTATUS[0]}
  T_TEST=$((SECONDS - T1))
  COUNTS=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|[0-9]+ (passed|failed)' "$LOG" | tail -n1 | sed -E 's/^=+ //; s/ =+$//')
  rm -f "$LOG"
  if [[ $RC -eq 0 ]]; then
    STATUS=ok
  else
    STATUS=FAILED
    FAILED=1
  fi
  [[ $RC -eq 124 ]] && COUNTS="timed out after ${TIMEOUT}s; $COUNTS"
  SUMMARY+=("$(printf '%-8s %-7s %s (tests %ss, venv %ss)' "$REL" "$STATUS" "${COUNTS:-no summary}" "$T_TEST" "$T_VENV")")
done

echo
echo "== hostkv_rs vs SGLang releases (total $((SECONDS - T_ALL))s)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
exit $FAILED
