#!/bin/sh
# make demo: run the demo binary from the build directory given as $1.
set -eu
exec "${1:-build}/bin/epd-demo"
