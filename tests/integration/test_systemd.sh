#!/bin/bash
# test_systemd.sh - epd under systemd's protocols and the files in systemd/ and man/.
#
#   test_systemd.sh PART SRC_DIR BIN_DIR [BUILD_DIR CMAKE]
#
# PART is one of:
#   units     systemd-analyze verify accepts epd.service and epd.socket (with ExecStart pointing at
#             the built daemon, and the manual pages of Documentation= found); systemd-tmpfiles
#             and systemd-sysusers apply the snippets to a scratch root
#   activate  epd started by systemd-socket-activate --seqpacket serves epctl on the passed socket,
#             leaves its own --socket alone and refuses a stream socket
#   notify    READY=1, STATUS=, WATCHDOG=1 and STOPPING=1 on a NOTIFY_SOCKET (systemd_notify.py)
#   config    the example epd.conf starts the daemon as shipped and with every key uncommented
#   docs      every flag, config key and epctl command appears in the manual pages and epd.conf
#   install   cmake --install with DESTDIR and two prefixes puts every file where it belongs
#
# Exit status: 0 passed, 1 failed, 77 skipped (a tool is missing or cannot run here).
set -euo pipefail

part=${1:?part}
src=$(cd "${2:?source dir}" && pwd)
bin=$(cd "${3:?binary dir}" && pwd)
build=${4:-}
cmake_cmd=${5:-cmake}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/epd-systemd.XXXXXX")
pids=()
cleanup() {
        for p in "${pids[@]}"; do
                kill -KILL "$p" 2>/dev/null || true
        done
        rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
        echo "FAIL: $*" >&2
        exit 1
}
skip() {
        echo "SKIP: $*" >&2
        exit 77
}
need() {
        command -v "$1" >/dev/null 2>&1 || skip "$1 is not installed (Debian package ${2:-$1})"
}

# Runs epctl against $1 until it answers (the daemon may still be starting), at most 10 s.
epctl_retry() {
        local sock=$1
        shift
        for _ in $(seq 100); do
                if "$bin/epctl" --socket "$sock" "$@" >"$tmp/epctl.out" 2>"$tmp/epctl.err"; then
                        cat "$tmp/epctl.out"
                        return 0
                fi
                sleep 0.1
        done
        cat "$tmp/epctl.err" >&2
        return 1
}

# Sends SIGTERM to pid $1 and checks that it exits 0 within 40 s (the drain limit is 30 s).
stop_daemon() {
        local pid=$1 rc=0
        kill -TERM "$pid"
        for _ in $(seq 400); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && fail "epd pid $pid did not stop after SIGTERM"
        wait "$pid" || rc=$?
        [ "$rc" -eq 0 ] || fail "epd exited $rc after SIGTERM"
}

test_units() {
        need systemd-analyze systemd
        local dir=$tmp/units man_opt=--man=no
        mkdir -p "$dir" "$tmp/man/man8" "$tmp/man/man5"

        # Tell a container that cannot run the verifier from a unit it rejects: a trivial unit
        # must pass first.
        printf '[Unit]\nDescription=probe\n[Service]\nExecStart=%s\n' "$bin/epd" >"$dir/probe.service"
        if ! (cd "$dir" && systemd-analyze verify --man=no ./probe.service) >"$tmp/probe.log" 2>&1 ||
           [ -s "$tmp/probe.log" ]; then
                cat "$tmp/probe.log" >&2
                skip "systemd-analyze verify cannot run here"
        fi
        rm "$dir/probe.service"

        # The installer rewrites this exact line to the install prefix.
        grep -qx 'ExecStart=/usr/bin/epd' "$src/systemd/epd.service" ||
                fail "epd.service must start ExecStart=/usr/bin/epd (install.cmake rewrites it)"
        sed "s#^ExecStart=/usr/bin/epd\$#ExecStart=$bin/epd#" "$src/systemd/epd.service" \
                >"$dir/epd.service"
        cp "$src/systemd/epd.socket" "$dir/"
        # Documentation= names man:epd(8), man:epctl(8), man:epd.conf(5): let verify look them up
        # in ours.
        cp "$src/man/epd.8" "$src/man/epctl.8" "$tmp/man/man8/"
        cp "$src/man/epd.conf.5" "$tmp/man/man5/"
        command -v man >/dev/null 2>&1 && man_opt=--man=yes
        # verify exits 0 on parse warnings ("Unknown key ..., ignoring"), so any output fails.
        if ! (cd "$dir" && MANPATH=$tmp/man systemd-analyze verify "$man_opt" ./epd.socket \
                ./epd.service) >"$tmp/verify.log" 2>&1 || [ -s "$tmp/verify.log" ]; then
                cat "$tmp/verify.log" >&2
                fail "systemd-analyze verify rejects the units"
        fi
        echo "systemd-analyze verify $man_opt: both units clean"

        # The properties the daemon relies on, so that an edit that still parses cannot drop them.
        # shellcheck disable=SC2016 # $MAINPID is systemd's, not ours.
        for want in 'Type=notify' 'NotifyAccess=main' 'WatchdogSec=30s' 'Restart=on-failure' \
                'Requires=epd.socket' 'After=epd.socket' 'LimitMEMLOCK=infinity' \
                'DevicePolicy=closed' 'RuntimeDirectory=epd-state' 'ExecReload=/bin/kill -HUP $MAINPID'; do
                grep -qxF "$want" "$src/systemd/epd.service" || fail "epd.service lacks $want"
        done
        for bad in PrivateDevices MemoryDenyWriteExecute; do
                ! grep -q "^$bad=" "$src/systemd/epd.service" ||
                        fail "epd.service sets $bad=, which breaks CUDA"
        done
        for want in 'ListenSequentialPacket=/run/epd/epd.sock' 'SocketMode=0660' 'SocketGroup=epd' \
                'RemoveOnStop=yes'; do
                grep -qxF "$want" "$src/systemd/epd.socket" || fail "epd.socket lacks $want"
        done

        if command -v systemd-tmpfiles >/dev/null 2>&1; then
                mkdir -p "$tmp/root"
                systemd-tmpfiles --create --root="$tmp/root" "$src/systemd/epd.tmpfiles" ||
                        fail "systemd-tmpfiles rejects epd.tmpfiles"
                [ -d "$tmp/root/run/epd" ] || fail "epd.tmpfiles did not create /run/epd"
                [ "$(stat -c %a "$tmp/root/run/epd")" = 755 ] || fail "/run/epd is not mode 0755"
                echo "systemd-tmpfiles: /run/epd created"
        fi
        if command -v systemd-sysusers >/dev/null 2>&1; then
                mkdir -p "$tmp/root/etc"
                systemd-sysusers --root="$tmp/root" "$src/systemd/epd.sysusers" ||
                        fail "systemd-sysusers rejects epd.sysusers"
                grep -q '^epd:' "$tmp/root/etc/group" || fail "epd.sysusers did not create group epd"
                echo "systemd-sysusers: group epd created"
        fi
}

test_activate() {
        need systemd-socket-activate systemd
        local sock=$tmp/epd.sock own=$tmp/own.sock pid out

        # systemd-socket-activate listens, waits for the first connection, then execs epd in its
        # own process: the first client is already queued on the socket the daemon inherits.
        systemd-socket-activate --seqpacket -l "$sock" "$bin/epd" --backend host --socket "$own" \
                2>"$tmp/epd.log" &
        pid=$!
        pids+=("$pid")
        for _ in $(seq 100); do
                [ -S "$sock" ] && break
                sleep 0.1
        done
        [ -S "$sock" ] || fail "systemd-socket-activate did not create $sock"
        out=$(epctl_retry "$sock" status --json) || { cat "$tmp/epd.log" >&2; fail "epctl status through the activated socket"; }
        echo "$out" | grep '"backend": "host"' >/dev/null || fail "unexpected status: $out"
        echo "$out" | grep "\"pid\": $pid," >/dev/null || fail "status pid is not the activated process $pid: $out"
        epctl_retry "$sock" clients >/dev/null || fail "a second client on the activated socket"
        grep -q 'using activated socket' "$tmp/epd.log" || fail "epd did not report the activated socket"
        [ ! -e "$own" ] || fail "epd bound its own --socket although a socket was passed"
        stop_daemon "$pid"
        [ -S "$sock" ] || fail "epd removed the activated socket's file (it belongs to systemd)"
        echo "socket activation: epctl served on the passed socket, daemon pid $pid"

        # A stream socket (ListenStream= by mistake) must be refused with a clear message.
        if command -v python3 >/dev/null 2>&1; then
                systemd-socket-activate -l "$tmp/stream.sock" "$bin/epd" --backend host \
                        2>"$tmp/stream.log" &
                pid=$!
                pids+=("$pid")
                for _ in $(seq 100); do
                        [ -S "$tmp/stream.sock" ] && break
                        sleep 0.1
                done
                python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])' "$tmp/stream.sock"
                local rc=0
                for _ in $(seq 100); do
                        kill -0 "$pid" 2>/dev/null || break
                        sleep 0.1
                done
                wait "$pid" || rc=$?
                [ "$rc" -eq 1 ] || fail "epd on a stream socket exited $rc, expected 1"
                grep -q 'ListenSequentialPacket' "$tmp/stream.log" ||
                        fail "epd on a stream socket did not say why: $(cat "$tmp/stream.log")"
                echo "socket activation: a stream socket is refused"
        fi
}

test_notify() {
        need python3
        python3 "$src/tests/integration/systemd_notify.py" "$bin"
}

# Starts epd with config $1 on socket $2, checks that epctl is served, and stops it.
run_with_config() {
        local conf=$1 sock=$2 pid
        "$bin/epd" --config "$conf" --socket "$sock" --backend host 2>"$tmp/epd.log" &
        pid=$!
        pids+=("$pid")
        if ! epctl_retry "$sock" status >/dev/null; then
                cat "$tmp/epd.log" >&2
                fail "epd --config $conf did not serve"
        fi
        stop_daemon "$pid"
}

test_config() {
        local conf=$src/systemd/epd.conf all=$tmp/all.conf
        run_with_config "$conf" "$tmp/a.sock"
        echo "epd.conf as shipped: epd serves"

        # Every commented key ("#key = value") uncommented, with values this machine has.
        sed -E -e 's/^#([a-z_]+ = )/\1/' \
                -e "s/^(socket_group|admin_group) = .*/\\1 = $(id -gn)/" \
                -e "s/^allow_uids = .*/allow_uids = $(id -u), 0/" \
                -e "s/^allow_gids = .*/allow_gids = $(id -g)/" \
                -e 's/^metrics_listen = .*/metrics_listen = 127.0.0.1:0/' "$conf" >"$all"
        grep -q '^#[a-z_]* =' "$all" && fail "a commented key was left in $all"
        run_with_config "$all" "$tmp/b.sock"
        echo "epd.conf with every key set: epd serves"

        # A broken file is refused with its line number and exit status 2.
        printf '[daemon]\nbackend = quantum\n' >"$tmp/bad.conf"
        local rc=0
        "$bin/epd" --config "$tmp/bad.conf" --socket "$tmp/c.sock" 2>"$tmp/bad.log" || rc=$?
        [ "$rc" -eq 2 ] || fail "epd with a bad config exited $rc, expected 2"
        grep -q 'bad.conf:2:' "$tmp/bad.log" || fail "bad config error lacks the line: $(cat "$tmp/bad.log")"
}

# Prints "section key" for every key epd_config_set() accepts.
config_keys() {
        sed -nE -e 's/^[[:space:]]*(STR|NUM)_KEY\("([a-z]+)", "([a-z_]+)".*/\2 \3/p' \
                -e 's/.*strcmp\(section, "([a-z]+)"\) == 0 && strcmp\(name, "([a-z_]+)"\).*/\1 \2/p' \
                "$src/daemon/base/config.c" | sort -u
}

# Prints the lines of section $2 of file $1: "[$2]" in an INI file, ".SH [$2]" or ".SH $2" in a
# manual page. (Its readers use grep without -q: under pipefail, a grep -q that stops at the
# first match can kill the writer with SIGPIPE and fail the pipeline.)
section_of() {
        awk -v want="$2" '
                /^\[[a-z]+\]/ { cur = $0; gsub(/[][]/, "", cur); next }
                /^\.SH / { cur = $2; gsub(/[][]/, "", cur); next }
                cur == want { print }' "$1"
}

# Prints long option $1 as roff writes it: socket-mode -> \-\-socket\-mode.
roff_option() {
        printf '%s' "--$1" | sed 's/-/\\-/g'
}

test_docs() {
        local n=0 sec key opt cmd
        while read -r sec key; do
                section_of "$src/systemd/epd.conf" "$sec" | grep -E "^#?$key = " >/dev/null ||
                        fail "systemd/epd.conf lacks [$sec] $key"
                section_of "$src/man/epd.conf.5" "$sec" | grep -E '^\.BR? ' | grep -w -- "$key" >/dev/null ||
                        fail "man/epd.conf.5 lacks [$sec] $key"
                n=$((n + 1))
        done < <(config_keys)
        [ "$n" -ge 20 ] || fail "found only $n keys in daemon/base/config.c; the parser of this test is stale"
        echo "config keys documented: $n"

        n=0
        while read -r opt; do
                grep -qF -- "$(roff_option "$opt")" "$src/man/epd.8" || fail "man/epd.8 lacks --$opt"
                n=$((n + 1))
        done < <(sed -nE 's/^[[:space:]]*\{ "([a-z-]+)", (required|no)_argument.*/\1/p' "$src/daemon/main.c")
        [ "$n" -ge 10 ] || fail "found only $n epd options in daemon/main.c"
        echo "epd options documented: $n"

        n=0
        while read -r opt; do
                grep -qF -- "$(roff_option "$opt")" "$src/man/epctl.8" || fail "man/epctl.8 lacks --$opt"
                n=$((n + 1))
        done < <(sed -nE 's/^[[:space:]]*\{ "([a-z-]+)", (required|no)_argument.*/\1/p' "$src/client/epctl.c")
        [ "$n" -ge 2 ] || fail "found only $n epctl options in client/epctl.c"
        n=0
        while read -r cmd; do
                section_of "$src/man/epctl.8" COMMANDS | grep -x "\.B $cmd" >/dev/null ||
                        fail "man/epctl.8 lacks the command $cmd"
                n=$((n + 1))
        done < <(grep -oE 'strcmp\(cmd, "[a-z-]+"\)' "$src/client/epctl.c" | sed -E 's/.*"(.*)".*/\1/' | sort -u)
        [ "$n" -ge 3 ] || fail "found only $n epctl commands in client/epctl.c"
        echo "epctl commands documented: $n"

        if command -v groff >/dev/null 2>&1; then
                for page in epd.8 epctl.8 epd.conf.5; do
                        LC_ALL=C.UTF-8 groff -t -man -ww -z -Tutf8 "$src/man/$page" 2>"$tmp/groff.log"
                        [ ! -s "$tmp/groff.log" ] || fail "groff warns on $page: $(cat "$tmp/groff.log")"
                done
                echo "manual pages render without warnings"
        fi
}

test_install() {
        [ -n "$build" ] || skip "no build directory given"
        need "$cmake_cmd" cmake
        local stage=$tmp/stage prefix root f
        for prefix in /usr /opt/epd; do
                root=$stage$prefix
                DESTDIR=$stage "$cmake_cmd" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
                        { cat "$tmp/install.log" >&2; fail "cmake --install --prefix $prefix"; }
                for f in bin/epd bin/epctl lib/systemd/system/epd.service lib/systemd/system/epd.socket \
                        lib/tmpfiles.d/epd.conf lib/sysusers.d/epd.conf share/doc/epd/epd.conf \
                        share/man/man8/epd.8 share/man/man8/epctl.8 share/man/man5/epd.conf.5; do
                        [ -f "$root/$f" ] || fail "DESTDIR install with prefix $prefix lacks $f (is systemd/install.cmake included?)"
                done
                grep -qx "ExecStart=$prefix/bin/epd" "$root/lib/systemd/system/epd.service" ||
                        fail "installed epd.service does not start $prefix/bin/epd"
                # Nothing may land outside DESTDIR.
                if grep -E '^-- (Installing|Up-to-date): ' "$tmp/install.log" | grep -v -- "$stage/" >&2; then
                        fail "files installed outside DESTDIR"
                fi
                echo "install with DESTDIR and prefix $prefix: $(find "$stage$prefix" -type f | wc -l) files"
        done
}

case $part in
units) test_units ;;
activate) test_activate ;;
notify) test_notify ;;
config) test_config ;;
docs) test_docs ;;
install) test_install ;;
*) fail "unknown part $part" ;;
esac
