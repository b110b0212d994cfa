#!/bin/sh
# run_gpu.sh - the Python binding's tests on a GPU host (tests/python/run_gpu.py says what runs).
#
# Usage: EPD_LIBRARY=/path/libepd.so EPD_BIN_DIR=/path/bin tests/python/run_gpu.sh [ARGS...]
#   EPD_LIBRARY  libepd.so built with CUDA (-DEPD_CUDA=ON); its directory goes first on
#                LD_LIBRARY_PATH, so shared libraries it needs may sit next to it.
#   EPD_BIN_DIR  the directory holding the epd daemon binary (a static build is fine).
#   EPD_PYTHON   the interpreter (default python3); it needs NumPy and torch with CUDA.
#   ARGS         passed to run_gpu.py: -k PATTERN, --gpu-only, --no-example, --allow-skip.
# Prints PASS / FAIL / SKIP per test and a summary; exits 0 when nothing failed, 1 otherwise.
set -u
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "${EPD_LIBRARY:-}" ] || [ -z "${EPD_BIN_DIR:-}" ]; then
        sed -n '2,10p' "$0" >&2
        echo "run_gpu.sh: set EPD_LIBRARY and EPD_BIN_DIR" >&2
        exit 2
fi
if [ ! -e "$EPD_LIBRARY" ]; then
        echo "run_gpu.sh: EPD_LIBRARY=$EPD_LIBRARY does not exist" >&2
        exit 2
fi
if [ ! -x "$EPD_BIN_DIR/epd" ]; then
        echo "run_gpu.sh: no executable $EPD_BIN_DIR/epd" >&2
        exit 2
fi
if [ -d "$EPD_LIBRARY" ]; then
        libdir=$(cd "$EPD_LIBRARY" && pwd)
else
        libdir=$(cd "$(dirname "$EPD_LIBRARY")" && pwd)
fi
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PATH="$EPD_BIN_DIR:$PATH"
export LD_LIBRARY_PATH PATH EPD_LIBRARY EPD_BIN_DIR
exec "${EPD_PYTHON:-python3}" "$here/run_gpu.py" "$@"
