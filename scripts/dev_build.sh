#!/usr/bin/env bash
# Build the extension in place for development: python/hostkv_rs/_core.abi3.so, then run
# `PYTHONPATH=python pytest`. Serialised with flock because several people build on 2 cores.
# It is built for the tests, so it carries the kernel emulator (feature `emulator`) and the raw
# entry points (feature `raw-calls`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/hostkv_rs_build.lock
flock 9
export PYO3_BUILD_EXTENSION_MODULE=1
CARGO_PROFILE_RELEASE_LTO=false cargo build --release --features python,emulator,raw-calls --lib --quiet
# Copy then rename: overwriting the .so in place crashes processes that have it mapped.
cp -f target/release/libhostkv_rs.so python/hostkv_rs/.core.abi3.so.tmp
mv -f python/hostkv_rs/.core.abi3.so.tmp python/hostkv_rs/_core.abi3.so
echo "built python/hostkv_rs/_core.abi3.so"
