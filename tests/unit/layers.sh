#!/bin/sh
# layers.sh - the daemon's layers point one way (daemon/CMakeLists.txt, docs/architecture.md,
# "The daemon's layers"): base < backend < core < net < the top level (daemon/*.c, *.h). Fails
# when a file of the daemon includes a header of a higher layer, when base, backend or core
# includes a protobuf header (the core never sees a wire type), or when a layer folder is missing.
# Usage: layers.sh DAEMON_DIR; layers.sh --self-test DAEMON_DIR checks that a copy of DAEMON_DIR
# with a violation planted in it fails.
set -eu

if [ "${1:-}" = "--self-test" ]; then
        src=$2
        self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        sh "$self" "$src" >/dev/null || { echo "FAIL: the tree itself does not pass"; exit 1; }
        for plant in 'core/op.c:#include "net.h"' 'backend/arena.c:#include "core.h"' \
                     'base/log.c:#include "backend.h"' 'core/group.c:#include "epd.pb-c.h"' \
                     'net/conn.c:#include "admin.h"'; do
                rm -rf "$tmp/d"
                cp -R "$src" "$tmp/d"
                file=${plant%%:*}
                printf '%s\n' "${plant#*:}" >>"$tmp/d/$file"
                if sh "$self" "$tmp/d" >/dev/null 2>&1; then
                        echo "FAIL: '${plant#*:}' in $file was not caught"
                        exit 1
                fi
        done
        echo "layers.sh self-test: every planted violation caught"
        exit 0
fi

dir=${1:?usage: layers.sh DAEMON_DIR}
status=0

# The layer of a file or header by its folder: 0 base, 1 backend, 2 core, 3 net, 4 top.
layer_of_dir() {
        case $1 in
        base) echo 0 ;;
        backend) echo 1 ;;
        core) echo 2 ;;
        net) echo 3 ;;
        *) echo 4 ;;
        esac
}

for sub in base backend core net; do
        [ -d "$dir/$sub" ] || { echo "FAIL: $dir/$sub is missing"; status=1; }
done

# Every header of the daemon and its layer, one "name layer" per line.
headers=$(cd "$dir" && find . -name '*.h' | while read -r h; do
        d=$(dirname "$h" | sed 's#^\./##; s#/.*##')
        [ "$d" = "." ] && d=top
        echo "$(basename "$h") $(layer_of_dir "$d")"
done)

for f in $(cd "$dir" && find . -name '*.c' -o -name '*.h' | sed 's#^\./##' | sort); do
        d=$(dirname "$f" | sed 's#/.*##')
        [ "$d" = "." ] && d=top
        mine=$(layer_of_dir "$d")
        for inc in $(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^">]+)[">].*/\1/p' "$dir/$f"); do
                name=$(basename "$inc")
                theirs=$(printf '%s\n' "$headers" | awk -v n="$name" '$1 == n { print $2; exit }')
                if [ -n "$theirs" ] && [ "$theirs" -gt "$mine" ]; then
                        echo "FAIL: daemon/$f (layer $d) includes $inc of a higher layer"
                        status=1
                fi
                case $name in
                *.pb-c.h | protobuf-c.h)
                        if [ "$mine" -le 2 ]; then
                                echo "FAIL: daemon/$f (layer $d) includes the protobuf header $inc"
                                status=1
                        fi
                        ;;
                esac
        done
done
[ $status -eq 0 ] && echo "layers.sh: daemon/ includes point one way"
exit $status
