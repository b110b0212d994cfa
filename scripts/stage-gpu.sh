#!/usr/bin/env bash
# stage-gpu.sh - builds what a GPU host without libuv, protobuf-c, inih, jansson or Check needs to
# run bench/gpu-check.sh, and copies it, stripped, into one directory to carry there:
#
#   scripts/stage-gpu.sh STAGE_DIR [SOURCE_DIR]
#
# SOURCE_DIR (default: this checkout) is built twice with -DEPD_CUDA=ON: SOURCE_DIR/build-gpu with
# -DEPD_STATIC_DEPS=ON (the daemon, epctl, epd-bench and the GPU test binaries), and
# SOURCE_DIR/build-gpu-so with the shared libepd.so that the Python binding loads (it needs only
# libprotobuf-c beside it). STAGE_DIR then holds bin/, lib/ and tests/gpu/gpu-tests.list, the
# layout run-gpu-tests.sh -b and gpu-check.sh expect. Give an older checkout (git worktree add)
# as SOURCE_DIR to stage the BEFORE_BUILD_DIR of an A/B; only bin/epd and bin/epd-bench are then
# needed, and built. JOBS (default: the CPUs) sets the build's parallelism.
set -eu

stage=${1:?usage: stage-gpu.sh STAGE_DIR [SOURCE_DIR]}
src=$(cd "${2:-$(dirname "$0")/..}" && pwd)
jobs=${JOBS:-$(nproc)}
own=$(cd "$(dirname "$0")/.." && pwd)

cmake -S "$src" -B "$src/build-gpu" -DCMAKE_BUILD_TYPE=Release -DEPD_CUDA=ON \
        -DEPD_STATIC_DEPS=ON > /dev/null
mkdir -p "$stage/bin" "$stage/lib" "$stage/tests/gpu"
stage=$(cd "$stage" && pwd)

if [ "$src" != "$own" ]; then
        cmake --build "$src/build-gpu" -j "$jobs" --target epd epd-bench
        for b in epd epd-bench; do
                strip -o "$stage/bin/$b" "$src/build-gpu/bin/$b"
        done
        exit 0
fi

cmake --build "$src/build-gpu" -j "$jobs"
cmake -S "$src" -B "$src/build-gpu-so" -DCMAKE_BUILD_TYPE=Release -DEPD_CUDA=ON > /dev/null
cmake --build "$src/build-gpu-so" -j "$jobs" --target epd_client

# Every program the GPU steps run: the list's binaries and the benchmarks.
bins="epd epctl epd-bench epd-soak-hostile"
while read -r line; do
        b=${line##* }
        bins="$bins ${b#bin/}"
done < "$src/build-gpu/tests/gpu/gpu-tests.list"
for b in $(echo "$bins" | tr ' ' '\n' | sort -u); do
        strip -o "$stage/bin/$b" "$src/build-gpu/bin/$b"
done
cp "$src/build-gpu/tests/gpu/gpu-tests.list" "$stage/tests/gpu/"
cp -L "$src/build-gpu-so/lib/libepd.so" "$stage/lib/libepd.so"
strip "$stage/lib/libepd.so"
ln -sf libepd.so "$stage/lib/libepd.so.0"
protobuf=$(ldd "$stage/lib/libepd.so" | awk '/libprotobuf-c/ { print $3 }')
[ -n "$protobuf" ] && cp -L "$protobuf" "$stage/lib/"
du -sh "$stage"
