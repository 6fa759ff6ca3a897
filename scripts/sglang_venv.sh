#!/usr/bin/env bash
# Build (or reuse) a CPU-only venv with a REAL SGLang release, for the
# hostkv_rs <-> SGLang HiCache compatibility tests.
#
#   bash scripts/sglang_venv.sh 0.5.23 [DEST]
#
# DEST defaults to ${HOSTKV_SGLANG_VENVS:-$HOME/.cache/hostkv_rs/sglang-venvs}/<release>.
# On success the venv directory is the last line on stdout (logs go to stderr):
#
#   VENV=$(bash scripts/sglang_venv.sh 0.5.23 | tail -n1)
#   "$VENV/bin/python" scripts/sglang_import_check.py
#
# How it works
#   * `python3 -m venv --system-site-packages --without-pip`, plus a .pth naming
#     the calling interpreter's site-packages (which differ from the base's when
#     the caller is itself a venv): torch, numpy, psutil, pytest, ... (and
#     hostkv_rs, if installed) come from the calling interpreter; nothing
#     CUDA-sized is downloaded per venv.
#     --without-pip: the system pip (found through system site-packages) installs
#     into the venv, and the venv does not get ensurepip's old setuptools that
#     would shadow the system one (torch wants setuptools>=77).
#   * `pip install --no-deps` of sglang plus the explicit, pinned list below:
#     the smallest set of (mostly pure-Python) packages that lets the HiCache
#     host-pool modules import on CPU. No sgl-kernel / sglang-kernel,
#     flashinfer, deep-gemm, cutlass, CUDA wheels or stubs are needed.
#     --no-deps is essential: sglang's own metadata pins torch==2.13/2.14 and
#     ~70 GPU packages.
#   * The stamp file is written last and holds the release + package list +
#     interpreter/torch identity; a venv without a matching stamp (partial
#     build, changed list, new system torch) is deleted and rebuilt. A flock on
#     DEST.lock serialises concurrent builders of the same release.
#
# Environment
#   HOSTKV_SGLANG_VENVS      cache root (default ~/.cache/hostkv_rs/sglang-venvs)
#   HOSTKV_SGLANG_PYTHON     base interpreter (default $PYTHON, else python3; needs torch)
#   HOSTKV_SGLANG_WHEELHOUSE directory holding sglang-<rel>-*.whl (directly or
#                            under v<rel>/); used instead of PyPI for sglang
#   HOSTKV_SGLANG_SKIP_CHECK=1  don't run scripts/sglang_import_check.py before
#                            writing the stamp
#   HOSTKV_SGLANG_FORCE=1    rebuild even if the stamp matches
#
# CPU notes: nothing needs to be set. sglang.srt.utils.is_cuda() is
# `torch.cuda.is_available() and torch.version.cuda is not None`, so it is False
# on a machine without a driver even with a +cu13x torch. Export
# CUDA_VISIBLE_DEVICES= in tests to get the same answer on a GPU machine.
# Importing prints two harmless UserWarnings on CPU (awq.py "Only CUDA, HIP and
# XPU support AWQ currently", gguf.py "Only CUDA, MUSA and NPU support GGUF
# quantization currently").
set -euo pipefail

usage() { echo "usage: $0 <sglang-release e.g. 0.5.23> [dest-dir]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
REL=$1
[[ $REL =~ ^[0-9]+\.[0-9]+\.[0-9]+([.a-z0-9]*)$ ]] || usage

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${HOSTKV_SGLANG_VENVS:-$HOME/.cache/hostkv_rs/sglang-venvs}
DEST=${2:-$ROOT/$REL}
BASE_PY=${HOSTKV_SGLANG_PYTHON:-${PYTHON:-python3}}
STAMP="$DEST/.hostkv-sglang-venv.stamp"

log() { echo "[sglang_venv $REL] $*" >&2; }

# --------------------------------------------------------------------------
# Package lists. Versions are the ones SGLang itself pins where it pins them
# (transformers, tokenizers, openai, compressed-tensors, apache-tvm-ffi,
# sentencepiece); the rest are pinned to versions verified to import.
# Why each one is there (first importer, all at import time):
#   sglang/__init__ -> transformers (+ huggingface_hub, httpx, httpcore, h11,
#     tokenizers, safetensors (version-checked), tqdm), aiohttp (+ its deps:
#     aiohappyeyeballs aiosignal frozenlist multidict propcache yarl),
#     openai (+ anyio, distro), dill, pybase64, pillow, starlette, msgspec, pyzmq
#   srt.configs -> multimodal/internvl_utils.py: `import torchvision.transforms`
#   srt.layers.quantization -> compressed_tensors (+ loguru), gguf
#   srt.layers.dp_attention -> sglang.kernels.ops.communication.all_reduce:
#     `import tvm_ffi` (apache-tvm-ffi: a CPU-only C++ FFI runtime, not CUDA)
#   tokenizer/function-call paths -> sentencepiece, partial_json_parser
#   sglang/utils.py -> `from IPython.display import ...` (+ traitlets);
#     srt.utils -> orjson, pydantic (+ pydantic_core, annotated_types,
#     typing_inspection), yaml (PyYAML); transformers -> regex; openai -> sniffio.
#     A python3 with its own site-packages may already have these, a bare one
#     does not, and the venv must not depend on which it was made from.
# --------------------------------------------------------------------------
COMMON_PKGS=(
  aiohappyeyeballs==2.7.1
  aiohttp==3.14.5
  aiosignal==1.4.0
  annotated-types==0.8.0
  anyio==4.16.0
  apache-tvm-ffi==0.1.11
  compressed-tensors==0.18.0
  dill==0.4.1
  distro==1.9.0
  frozenlist==1.8.0
  gguf==0.19.0
  h11==0.16.0
  httpcore==1.0.9
  httpx==0.28.1
  huggingface_hub==1.33.0
  ipython==9.19.1
  loguru==0.7.3
  msgspec==0.23.0
  multidict==7.2.1
  orjson==3.13.0
  partial-json-parser==0.2.1.1.post7
  pillow==13.0.0
  propcache==0.5.4
  pybase64==1.5.1
  pydantic==2.14.4
  pydantic_core==2.50.5
  PyYAML==6.0.4
  pyzmq==27.3.0
  regex==2026.12.2
  safetensors==0.8.0
  sentencepiece==0.2.1
  sniffio==1.3.1
  starlette==1.10.0
  tqdm==4.70.1
  traitlets==5.16.1
  typing-inspection==0.4.5
  yarl==1.25.1
)

# Per-release additions (the packages SGLang pins differently per release).
case "$REL" in
  0.5.18|0.5.19|0.5.20)
    # xgrammar (114 MB, CPU-capable): hisparse_coordinator / hybrid_pool_assembler
    # -> configs.model_config -> server_args -> function_call.function_call_parser
    # -> inkling_detector.py `from xgrammar import StructuralTag`. From 0.5.21 on
    # that chain is no longer reached by the HiCache modules.
    REL_PKGS=(transformers==5.12.1 tokenizers==0.22.2 openai==2.6.1 xgrammar==0.2.1) ;;
  0.5.21)
    REL_PKGS=(transformers==5.12.1 tokenizers==0.22.2 openai==2.6.1) ;;
  0.5.22)
    REL_PKGS=(transformers==5.19.0 tokenizers==0.23.2 openai==2.6.1) ;;
  0.5.23)
    REL_PKGS=(transformers==5.19.0 tokenizers==0.23.2 openai==2.8.0) ;;
  *)
    log "no package list for release $REL; add a case to $0"
    exit 2 ;;
esac

# torchvision goes with the base's torch, not with the release (SGLang does not pin it; pip gives
# a release's users the newest one its pinned torch allows): 0.28.0 requires torch==2.13.0, 0.29.x
# torch>=2.14. importlib.metadata instead of `import torch`: keeps a cache hit well under 1s.
if ! BASE_TORCH=$("$BASE_PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null); then
  log "$BASE_PY cannot import torch; install torch into the base interpreter first"
  exit 1
fi
case "$BASE_TORCH" in
  2.13.*) TORCHVISION=torchvision==0.28.0 ;;
  *) TORCHVISION=torchvision==0.29.2 ;;
esac

PKGS=("${COMMON_PKGS[@]}" "${REL_PKGS[@]}" "$TORCHVISION")

# --------------------------------------------------------------------------
# Stamp: anything that should invalidate the cache goes in here.
# --------------------------------------------------------------------------
BASE_ID=$("$BASE_PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')" torch $BASE_TORCH"
STAMP_WANT=$(printf '%s\n' "hostkv-sglang-venv v2" "sglang==$REL" "base: $BASE_ID" "${PKGS[@]}")

# The stamp must match AND every pinned distribution must still be installed
# at its version (catches a hand-edited venv); ~0.1s.
stamp_ok() {
  [[ -z ${HOSTKV_SGLANG_FORCE:-} && -f $STAMP && -x $DEST/bin/python ]] &&
    [[ "$(cat "$STAMP")" == "$STAMP_WANT" ]] &&
    "$DEST/bin/python" - "sglang==$REL" "${PKGS[@]}" <<'PY'
import sys, importlib.metadata as m
bad = []
for spec in sys.argv[1:]:
    name, ver = spec.split("==")
    try:
        have = m.version(name)
    except m.PackageNotFoundError:
        have = None
    if have != ver:
        bad.append(f"{name}: want {ver}, have {have}")
if bad:
    print("[sglang_venv] cached venv is inconsistent: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
PY
}

if stamp_ok; then
  log "cached: $DEST"
  echo "$DEST"
  exit 0
fi

mkdir -p "$(dirname "$DEST")"
# Serialise builders of the same venv (parallel CI jobs); fd 9 holds the lock.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$DEST.lock"
  flock 9
  if stamp_ok; then  # someone else finished it while we waited
    log "cached: $DEST"
    echo "$DEST"
    exit 0
  fi
fi

T0=$SECONDS
if [[ -e $DEST ]]; then
  log "removing stale/partial venv at $DEST"
  rm -rf -- "$DEST"
fi

log "creating venv (system site-packages) at $DEST"
"$BASE_PY" -m venv --system-site-packages --without-pip "$DEST"
VPY="$DEST/bin/python"
# --system-site-packages exposes the *base* installation's packages. When $BASE_PY is itself a
# venv (a newcomer's, or .ci/run's), torch, pytest and hostkv_rs live in that venv's
# site-packages instead, so a .pth in the new venv names them (ahead of the base's).
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$BASE_PY" -c 'import sysconfig
p = sysconfig.get_paths()
print("\n".join(dict.fromkeys([p["purelib"], p["platlib"]])))' > "$SITE/_hostkv_caller_site.pth"
if ! "$VPY" -m pip --version >/dev/null 2>&1; then
  # Base interpreter has no pip of its own: bootstrap one into the venv and
  # drop ensurepip's old setuptools so the system one stays visible.
  log "no pip visible in the venv; bootstrapping with ensurepip"
  "$VPY" -m ensurepip --default-pip >&2
  "$VPY" -m pip uninstall -y -q setuptools >&2 || true
fi

PIP=("$VPY" -m pip install --no-deps --no-warn-conflicts --no-input
     --disable-pip-version-check --only-binary=:all: --progress-bar off -q)

SGL_SPEC="sglang==$REL"
if [[ -n ${HOSTKV_SGLANG_WHEELHOUSE:-} ]]; then
  shopt -s nullglob
  whl=("$HOSTKV_SGLANG_WHEELHOUSE"/sglang-"$REL"-*.whl "$HOSTKV_SGLANG_WHEELHOUSE"/v"$REL"/sglang-"$REL"-*.whl)
  shopt -u nullglob
  if [[ ${#whl[@]} -gt 0 ]]; then SGL_SPEC=${whl[0]}; fi
fi

log "pip install --no-deps $SGL_SPEC + ${#PKGS[@]} packages"
"${PIP[@]}" "$SGL_SPEC" "${PKGS[@]}" >&2

if [[ -z ${HOSTKV_SGLANG_SKIP_CHECK:-} ]]; then
  log "import check"
  if ! "$VPY" "$SCRIPT_DIR/sglang_import_check.py" --quiet >&2; then
    log "import check FAILED; venv left at $DEST without a stamp (will be rebuilt next run)"
    exit 1
  fi
fi

printf '%s\n' "$STAMP_WANT" > "$STAMP.tmp"
mv -f "$STAMP.tmp" "$STAMP"
log "built in $((SECONDS - T0))s, $(du -sh "$DEST" 2>/dev/null | cut -f1): $DEST"
echo "$DEST"
