#!/usr/bin/env bash
# The CUDA driver ABI the crate relies on, checked without a GPU against NVIDIA's headers:
# compiles tests/abi/cuda_abi.cpp (sizes, offsets, enum values, function types) and checks that
# every driver symbol the crate calls or looks up by name is declared there.
#
#   CUDA_INCLUDE=<dir with cuda.h> scripts/check_cuda_abi.sh
set -euo pipefail
cd "$(dirname "$0")/.."
INC=${CUDA_INCLUDE:?set CUDA_INCLUDE to a directory holding cuda.h and cudaTypedefs.h}
CXX=${CXX:-$(command -v g++ || command -v c++)}
"$CXX" -std=c++17 -fsyntax-only -Wall -Werror -I "$INC" tests/abi/cuda_abi.cpp
echo "cuda_abi.cpp: sizes, offsets, enum values and function types match $INC/cuda.h"
missing=0
n=0
for sym in $(grep -rhoE 'sys::cu[A-Z][A-Za-z0-9_]+|b"cu[A-Z][A-Za-z0-9_]+\\0"' rust/src |
    sed -E 's/^sys:://; s/^b"//; s/\\0"$//' | sort -u); do
    n=$((n + 1))
    if ! grep -qw "$sym" "$INC/cuda.h" "$INC/cudaTypedefs.h"; then
        echo "check_cuda_abi.sh: $sym is not declared in $INC/cuda.h or cudaTypedefs.h" >&2
        missing=1
    fi
done
((missing == 0)) || exit 1
echo "all $n driver symbols the crate uses are declared in the headers"
