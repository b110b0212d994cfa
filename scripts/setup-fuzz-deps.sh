#!/bin/sh
# Installs what the fuzz targets need beyond setup-deps.sh: clang and its libFuzzer/sanitizer
# runtimes (Debian 12: clang 14; libclang-rt-14-dev is only recommended by clang, so a
# --no-install-recommends install lacks libFuzzer). Runs as root on Debian 12 (the CI machine);
# elsewhere it only reports what is missing.
set -eu
pkgs="clang libclang-rt-14-dev"
missing=""
for p in $pkgs; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
                missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "setup-fuzz-deps: installing:$missing"
if [ "$(id -u)" -ne 0 ]; then
        echo "setup-fuzz-deps: not root; install these packages first:$missing" >&2
        exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing
