#!/usr/bin/env bash
# Build (or reuse) a venv with one torch release and the calling interpreter's test packages, for
# the SGLang release suites: each SGLang release pins an exact torch (0.5.18-0.5.21 torch==2.13.0,
# 0.5.22-0.5.23 torch==2.14.1), and that pinned torch is what its users run our pools under.
#
#   bash scripts/torch_venv.sh 2.13.0          # the venv's directory is the last line on stdout
#
# Everything else matches the caller: numpy, psutil, pytest, hypothesis, pytest-benchmark and
# Mooncake Store at the versions the calling interpreter has (so the one difference between the
# caller and this venv is torch). The venv is rebuilt only for another Python or torch; the test
# packages follow the caller's versions in place on every call (pip does nothing when they match).
# hostkv_rs is not installed here: scripts/test_sglang.sh puts the caller's package on the path.
#
# Environment
#   HOSTKV_TORCH_VENVS   cache root (default ~/.cache/hostkv_rs/torch-venvs)
#   PYTHON               the calling interpreter (default python3)
set -euo pipefail

[[ $# -eq 1 && $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "usage: $0 <torch version, e.g. 2.13.0>" >&2; exit 2; }
VER=$1
CALLER=${PYTHON:-python3}
ROOT=${HOSTKV_TORCH_VENVS:-$HOME/.cache/hostkv_rs/torch-venvs}
DEST=$ROOT/$VER
STAMP=$DEST/.hostkv-torch-venv.stamp
log() { echo "[torch_venv $VER] $*" >&2; }

# The caller's versions of what the tests import (a package it lacks is left out here too).
mapfile -t PKGS < <("$CALLER" - <<'PY'
import importlib.metadata as m
for name in ("numpy", "psutil", "pytest", "hypothesis", "pytest-benchmark",
             "mooncake-transfer-engine-non-cuda"):
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        pass
PY
)
STAMP_WANT=$(printf '%s\n' "hostkv-torch-venv v2" \
  "$("$CALLER" -c 'import sys; print(sys.version.split()[0])')" "torch==$VER")
PIP=(-m pip install -q --disable-pip-version-check --no-input)

mkdir -p "$ROOT"
# Serialise builders and package syncs of the same venv; fd 9 holds the lock.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$DEST.lock"
  flock 9
fi

if [[ -f $STAMP && -x $DEST/bin/python && "$(cat "$STAMP")" == "$STAMP_WANT" ]]; then
  log "cached: $DEST"
else
  T0=$SECONDS
  # The stamp goes first, so an interrupted removal never leaves a stamped, half-deleted venv.
  rm -f -- "$STAMP"
  rm -rf -- "$DEST"
  log "creating venv at $DEST: torch==$VER"
  "$CALLER" -m venv "$DEST"
  "$DEST/bin/python" "${PIP[@]}" "torch==$VER" >&2
  "$DEST/bin/python" -c "import torch; torch.zeros(1).add_(1)" >&2
  printf '%s\n' "$STAMP_WANT" > "$STAMP.tmp"
  mv -f "$STAMP.tmp" "$STAMP"
  log "built in $((SECONDS - T0))s, $(du -sh "$DEST" 2>/dev/null | cut -f1)"
fi
if [[ ${#PKGS[@]} -gt 0 ]]; then
  "$DEST/bin/python" "${PIP[@]}" "${PKGS[@]}" >&2
fi
echo "$DEST"
