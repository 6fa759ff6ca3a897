#!/usr/bin/env bash
# Wheels for the SGLang TMA comparison on a GPU machine without network access
# (scripts/sglang_tma_bench.py, step 5b of scripts/gpu_check.sh): SGLang 0.5.23 and what its
# HiCache kernel module imports that the GPU machine's image lacks, for CPython 3.12 on
# manylinux x86-64, into .whl/ (git-ignored; about 45 MiB). Found by importing
# `sglang.kernels.ops.kvcache.hicache` with only these on top of torch, numpy, pillow, anyio
# and tqdm. Run here, where PyPI is reachable; carry .whl/ to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
rm -f .whl/*.whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_24_x86_64 -d .whl \
    sglang==0.5.23 apache-tvm-ffi==0.1.11 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 starlette==1.10.0 \
    pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1
ls -la .whl
du -sh .whl
