#!/bin/sh
# Installs the Debian packages epd's build, tests and demo need, when any is missing.
# Runs as root on Debian 12 (the CI machine); elsewhere it only reports what is missing.
set -eu
pkgs="cmake make gcc pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler check
libsystemd-dev libinih-dev libjansson-dev libmicrohttpd-dev python3 python3-numpy systemd tmux"
missing=""
for p in $pkgs; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
                missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "setup-deps: installing:$missing"
if [ "$(id -u)" -ne 0 ]; then
        echo "setup-deps: not root; install these packages first:$missing" >&2
        exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing
