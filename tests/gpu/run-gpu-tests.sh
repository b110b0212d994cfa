#!/usr/bin/env bash
# run-gpu-tests.sh - runs every GPU test binary of a build directory and keeps one log per test.
#
# Usage: run-gpu-tests.sh [-b BUILD_DIR] [-o OUT_DIR] [-t SECONDS] [-- ARGS...]
#   -b  the build directory. Default: the build directory this script sits in (the build copies
#       it to BUILD/tests/gpu/), else ./build under the repository when run from the source tree.
#   -o  where the logs go (one NAME.log per test and summary.txt). Default: BUILD/gpu-logs.
#   -t  the most seconds one test may run (default 600, or EPD_GPU_TEST_TIMEOUT): a test still
#       running then is killed and counts as failed, so that a hung kernel cannot hang the run.
#   ARGS are passed to every test binary (for example --quick or --no-timing).
#
# The binaries are found relative to the build directory (tests/gpu/gpu-tests.list, written at
# configure time, else BUILD/bin/*gpu*test*), never through CTest files, whose absolute paths do
# not survive copying the build directory to a GPU host. A list line may start with environment
# assignments, as in "EPD_TEST_BACKEND=cuda bin/integ_ops" (the host-memory integration matrix on
# the CUDA backend); its log is then NAME_VALUE.log, and it is skipped on a host without an
# NVIDIA device node, since such a binary has no skip of its own.
#
# Exit: 0 when every test passed (or skipped while another passed), 1 when any failed, 77 when
# every test skipped (no GPU).
set -u

here=$(cd "$(dirname "$0")" && pwd)
build=""
out=""
limit=${EPD_GPU_TEST_TIMEOUT:-600}
while [ $# -gt 0 ]; do
        case "$1" in
        -b) build=$2; shift 2 ;;
        -o) out=$2; shift 2 ;;
        -t) limit=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) break ;;
        esac
done

if [ -z "$build" ]; then
        if [ -f "$here/../../CMakeCache.txt" ] || [ -d "$here/../../bin" ]; then
                build=$(cd "$here/../.." && pwd)
        elif [ -d "$here/../../build" ]; then
                build=$(cd "$here/../../build" && pwd)
        else
                echo "run-gpu-tests: no build directory found; pass -b BUILD_DIR" >&2
                exit 1
        fi
fi
build=$(cd "$build" && pwd)
[ -n "$out" ] || out="$build/gpu-logs"
mkdir -p "$out"
out=$(cd "$out" && pwd)

tests=()
if [ -f "$build/tests/gpu/gpu-tests.list" ]; then
        while IFS= read -r line; do
                [ -n "$line" ] && tests+=("$line")
        done < "$build/tests/gpu/gpu-tests.list"
else
        for f in "$build"/bin/*gpu*test*; do
                [ -x "$f" ] && tests+=("$f")
        done
fi
if [ ${#tests[@]} -eq 0 ]; then
        echo "run-gpu-tests: no GPU test binaries under $build" >&2
        exit 1
fi

passed=0
failed=0
skipped=0
: > "$out/summary.txt"
have_gpu=0
for dev in /dev/nvidia[0-9]*; do
        [ -e "$dev" ] && have_gpu=1
done

for line in "${tests[@]}"; do
        # Leading NAME=value words are environment for this test; the next word is the binary.
        envs=()
        suffix=""
        t=""
        for word in $line; do
                if [ -z "$t" ] && [[ $word =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
                        envs+=("$word")
                        suffix="${suffix}_${word#*=}"
                elif [ -z "$t" ]; then
                        t=$word
                fi
        done
        case $t in
        /*) ;;
        *) t="$build/$t" ;;
        esac
        name=$(basename "$t")$suffix
        if [ ! -x "$t" ]; then
                echo "$name: MISSING ($t)" | tee -a "$out/summary.txt"
                failed=$((failed + 1))
                continue
        fi
        if [ ${#envs[@]} -gt 0 ] && [ $have_gpu -eq 0 ]; then
                echo "$name: SKIP (no /dev/nvidia* device)" | tee -a "$out/summary.txt"
                skipped=$((skipped + 1))
                continue
        fi
        echo "== ${envs[*]:-}${envs[*]:+ }$name $*"
        start=$(date +%s)
        (cd "$build" && timeout -k 10 "$limit" env ${envs[@]+"${envs[@]}"} "$t" "$@") \
                > "$out/$name.log" 2>&1
        rc=$?
        secs=$(( $(date +%s) - start ))
        tail -n 40 "$out/$name.log"
        if [ $rc -eq 127 ] && [ $have_gpu -eq 0 ]; then
                rc=77 # it could not load without the driver's libcuda: no GPU here
        fi
        case $rc in
        0) verdict=PASS; passed=$((passed + 1)) ;;
        77) verdict=SKIP; skipped=$((skipped + 1)) ;;
        124|137)
                verdict="FAIL (killed after ${limit}s: timed out)"
                failed=$((failed + 1))
                ;;
        *) verdict="FAIL (exit $rc)"; failed=$((failed + 1)) ;;
        esac
        echo "$name: $verdict in ${secs}s, log $out/$name.log" | tee -a "$out/summary.txt"
done

echo "passed $passed, failed $failed, skipped $skipped" | tee -a "$out/summary.txt"
if [ $failed -ne 0 ]; then
        exit 1
fi
if [ $passed -eq 0 ]; then
        exit 77
fi
exit 0
