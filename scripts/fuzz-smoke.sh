#!/bin/sh
# `make fuzz-smoke`: builds the libFuzzer targets (tests/fuzz/CMakeLists.txt) with clang, ASan and
# UBSan in build-fuzz, replays the committed seeds and past crashes (CTest label fuzz), then
# fuzzes each target for SECONDS (default 60) starting from its seeds. New inputs go to
# build-fuzz/fuzz-corpus/<target>, never into the source tree; a crash leaves its input in
# build-fuzz/fuzz-artifacts/ and fails the run. Usage: fuzz-smoke.sh [BUILD_DIR [SECONDS]]
set -eu
cd "$(dirname "$0")/.."
build=${1:-build-fuzz}
seconds=${2:-60}
jobs=$(nproc)

# Called from make: keep the parent's flags (directory messages, jobserver) out of the build.
unset MAKEFLAGS MFLAGS MAKELEVEL
cmake -S . -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DEPD_CUDA=OFF \
        -DEPD_SANITIZE=ON -DEPD_FUZZ=ON >/dev/null
cmake --build "$build" -j "$jobs" --target fuzz_frame fuzz_request fuzz_config
(cd "$build" && ctest --output-on-failure -L fuzz)

# The sanitizer's report from its first line (the error and the faulting stack come first, and
# the thread and allocation stacks after them can be long), then the log's last lines.
report() {
        first=$(grep -n -m 1 -E '^==[0-9]+==ERROR|runtime error:|^==[0-9]+== ERROR: libFuzzer|^WARNING: ThreadSanitizer' "$1" | cut -d: -f1)
        if [ -z "$first" ]; then
                tail -n 60 "$1"
                return
        fi
        sed -n "${first},$((first + 150))p" "$1"
        if [ "$(wc -l <"$1")" -gt $((first + 150)) ]; then
                echo "fuzz-smoke: [...] the log's last lines:"
                tail -n 20 "$1"
        fi
}

mkdir -p "$build/fuzz-artifacts"
for target in fuzz_frame fuzz_request fuzz_config; do
        mkdir -p "$build/fuzz-corpus/$target"
        echo "fuzz-smoke: $target for ${seconds}s"
        # -timeout: one input of fuzz_request may wait for op timeouts, never for seconds.
        "$build/bin/$target" -max_total_time="$seconds" -max_len=4096 -timeout=60 \
                -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$target-" \
                "$build/fuzz-corpus/$target" "tests/fuzz/corpus/$target" \
                >"$build/fuzz-artifacts/$target.log" 2>&1 || {
                report "$build/fuzz-artifacts/$target.log"
                for input in "$build/fuzz-artifacts/$target"-*; do
                        [ -f "$input" ] || continue
                        # CI keeps only the output: the input itself, to replay elsewhere with
                        # `base64 -d > input && $build/bin/$target input`.
                        echo "fuzz-smoke: $input, base64:"
                        base64 -w 0 "$input"
                        echo
                done
                echo "fuzz-smoke: $target failed; the input is in $build/fuzz-artifacts/" >&2
                exit 1
        }
        grep '^stat::\|^Done' "$build/fuzz-artifacts/$target.log"
done
