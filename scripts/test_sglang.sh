#!/usr/bin/env bash
# hostkv_rs against REAL SGLang releases: for each release, build (or reuse) its CPU venv with
# scripts/sglang_venv.sh and run tests/sglang in it.
#
#   bash scripts/test_sglang.sh                    # 0.5.18 ... 0.5.23, every release
#   HOSTKV_SGLANG_RELEASES="0.5.23" bash scripts/test_sglang.sh -x -k roundtrip
#
# Extra arguments go to pytest. Each release runs under the torch it pins (what `pip install
# sglang==<release>` gives its users): its venv is built over a venv with that torch
# (scripts/torch_venv.sh), and the pin is checked against the installed release's metadata.
# `import hostkv_rs` there is what the caller imports from tests/ (its installed wheel, as in
# scripts/test.sh, or a PYTHONPATH tree: PYTHONPATH=python tests the source tree after
# scripts/dev_build.sh), put first on the path.
#
# Environment
#   HOSTKV_SGLANG_RELEASES   releases to test (default "0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23")
#   HOSTKV_SGLANG_VENVS      venv cache root (see scripts/sglang_venv.sh)
#   HOSTKV_SGLANG_TIMEOUT    seconds per release before it counts as failed (default 900)
#   HOSTKV_SGLANG_TORCH      "pinned" (default): each release's own torch; "caller": the calling
#                            interpreter's torch for every release (no torch download)
#   HOSTKV_SGLANG_PYTHON     with HOSTKV_SGLANG_TORCH=caller, the base interpreter of the venvs
#                            (default: $PYTHON); pinned runs build theirs over the torch venvs
# Exit status: 0 when every release passed, 1 otherwise (2: bad usage).
set -uo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
RELEASES=${HOSTKV_SGLANG_RELEASES:-0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23}
TIMEOUT=${HOSTKV_SGLANG_TIMEOUT:-900}
PY=${PYTHON:-python3}
TORCH_MODE=${HOSTKV_SGLANG_TORCH:-pinned}
[[ $TORCH_MODE == pinned || $TORCH_MODE == caller ]] || {
  echo "HOSTKV_SGLANG_TORCH must be 'pinned' or 'caller', got '$TORCH_MODE'" >&2; exit 2; }

# The torch each release's metadata pins (`Requires-Dist: torch==`); every run checks this table
# against the installed release, so a wrong row fails rather than testing under another torch.
torch_pin() {
  case $1 in
    0.5.18|0.5.19|0.5.20|0.5.21) echo 2.13.0 ;;
    0.5.22|0.5.23) echo 2.14.1 ;;
    *) echo "" ;;
  esac
}

# The base interpreter for a release's venv: a venv with the release's torch, or (caller mode)
# the caller's interpreter.
release_base() {
  local pin venv
  pin=$(torch_pin "$1")
  if [[ $TORCH_MODE == caller || -z $pin ]]; then
    echo "${HOSTKV_SGLANG_PYTHON:-$PY}"
    return
  fi
  venv=$(PYTHON=$PY bash scripts/torch_venv.sh "$pin" | tail -n1) || return 1
  echo "$venv/bin/python"
}

# "<torch the venv imports> <torch the release pins>", from metadata only.
torch_versions() {
  "$1" - <<'PY'
import importlib.metadata as m
pins = [r.split("==")[1].split(";")[0].strip() for r in m.requires("sglang") or []
        if r.replace(" ", "").startswith("torch==")]
print(m.version("torch").split("+")[0], pins[0] if pins else "none")
PY
}

# pytest runs from tests/: make the caller's relative PYTHONPATH entries absolute first.
if [[ -n ${PYTHONPATH:-} ]]; then
  IFS=: read -r -a _pp <<<"$PYTHONPATH"
  for i in "${!_pp[@]}"; do
    [[ -n ${_pp[$i]} && ${_pp[$i]} != /* ]] && _pp[$i]="$CALLER_DIR/${_pp[$i]}"
  done
  PYTHONPATH=$(IFS=:; echo "${_pp[*]}")
  export PYTHONPATH
fi

# The hostkv_rs the caller imports from tests/ (its installed wheel, or PYTHONPATH's tree), alone
# in a directory of its own that goes first on the release venvs' path: a pinned venv does not
# see the caller's site-packages (nor its torch), and nothing is written into a shared venv.
if ! HOSTKV_PKG=$(cd tests && "$PY" -c 'import os, hostkv_rs; print(os.path.dirname(hostkv_rs.__file__))'); then
  echo "$PY cannot import hostkv_rs from tests/: install the wheel or set PYTHONPATH" >&2
  exit 2
fi
PKG_DIR=$(mktemp -d)
trap 'rm -rf -- "$PKG_DIR"' EXIT
ln -s "$HOSTKV_PKG" "$PKG_DIR/hostkv_rs"
export PYTHONPATH="$PKG_DIR${PYTHONPATH:+:$PYTHONPATH}"

declare -a SUMMARY=()
FAILED=0
T_ALL=$SECONDS

for REL in $RELEASES; do
  echo "== SGLang $REL: venv"
  T0=$SECONDS
  if ! BASE=$(release_base "$REL") ||
     ! VENV=$(HOSTKV_SGLANG_PYTHON=$BASE bash scripts/sglang_venv.sh "$REL" | tail -n1) ||
     [[ ! -x $VENV/bin/python ]]; then
    SUMMARY+=("$(printf '%-8s FAILED  venv build (%ss)' "$REL" $((SECONDS - T0)))")
    FAILED=1
    continue
  fi
  T_VENV=$((SECONDS - T0))
  # read empties both where the query printed nothing.
  read -r TORCH_HAVE TORCH_PIN < <(torch_versions "$VENV/bin/python")
  if [[ -z $TORCH_HAVE ]]; then
    SUMMARY+=("$(printf '%-8s FAILED  cannot read the torch and sglang versions in %s' "$REL" "$VENV")")
    FAILED=1
    continue
  fi
  if [[ $TORCH_MODE == pinned && ($TORCH_PIN == none || $TORCH_HAVE != "$TORCH_PIN") ]]; then
    SUMMARY+=("$(printf '%-8s FAILED  torch %s, but the release pins %s (update torch_pin in %s)' \
      "$REL" "$TORCH_HAVE" "$TORCH_PIN" "$0")")
    FAILED=1
    continue
  fi
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
  SUMMARY+=("$(printf '%-8s %-7s %s (torch %s, tests %ss, venv %ss)' "$REL" "$STATUS" \
    "${COUNTS:-no summary}" "$TORCH_HAVE" "$T_TEST" "$T_VENV")")
done

echo
echo "== hostkv_rs vs SGLang releases (total $((SECONDS - T_ALL))s)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
exit $FAILED
