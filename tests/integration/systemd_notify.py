#!/usr/bin/env python3
"""systemd_notify.py BIN_DIR - epd's side of the sd_notify protocol, checked the way systemd sees it.

The test plays the service manager: it listens on an AF_UNIX datagram socket, starts build/bin/epd
with NOTIFY_SOCKET and WATCHDOG_USEC set, and checks that
  - READY=1 arrives with STATUS= and MAINPID=, and the socket serves epctl as soon as it has;
  - WATCHDOG=1 pings follow every half period, each after a STATUS= line with live counts
    (a connected client shows as "1 clients");
  - SIGHUP re-reads the configuration (log_level switched to debug) and the pings go on;
  - SIGTERM sends STOPPING=1 and the daemon exits 0;
  - every message comes from the daemon's main pid, as NotifyAccess=main requires.
Exit status 0 passed, 1 failed, 77 skipped.
"""
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

WATCHDOG_USEC = 200000


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


class Manager:
    """The notify socket and the daemon under test."""

    def __init__(self, bin_dir, tmp):
        self.bin_dir = bin_dir
        self.tmp = tmp
        self.path = os.path.join(tmp, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.messages = []  # (monotonic time, {key: value})
        self.proc = None

    def start(self, args):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("LISTEN_", "WATCHDOG_", "NOTIFY_", "JOURNAL_"))}
        env["NOTIFY_SOCKET"] = self.path
        env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        self.log_path = os.path.join(self.tmp, "epd.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([os.path.join(self.bin_dir, "epd")] + args, env=env,
                                         stdout=log, stderr=log)

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def receive(self, until, timeout):
        """Collects messages until until(message fields) is true or timeout seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Short slices, so that a daemon that dies is noticed once its queued messages
            # are read.
            self.sock.settimeout(max(0.001, min(0.05, deadline - time.monotonic())))
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                if self.proc.poll() is not None:
                    fail("epd exited %d early:\n%s" % (self.proc.returncode, self.log()))
                continue
            pid = None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
            if pid != self.proc.pid:
                fail("notify message from pid %s, not the main pid %d: %r"
                     % (pid, self.proc.pid, data))
            fields = {}
            for line in data.decode().split("\n"):
                if line:
                    key, _, value = line.partition("=")
                    fields[key] = value
            self.messages.append((time.monotonic(), fields))
            if until(fields):
                return fields
        return None

    def epctl(self, sock_path, *args):
        return subprocess.run([os.path.join(self.bin_dir, "epctl"), "--socket", sock_path] + list(args),
                              capture_output=True, text=True, timeout=30)


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    bin_dir = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="epd-notify.") as tmp:
        if len(os.path.join(tmp, "notify")) >= 108:
            tmp = tempfile.mkdtemp(prefix="epd-notify.", dir="/tmp")
        m = Manager(bin_dir, tmp)
        epd_sock = os.path.join(tmp, "epd.sock")
        conf = os.path.join(tmp, "epd.conf")
        with open(conf, "w") as f:
            f.write("[daemon]\nlog_level = info\n")
        m.start(["--backend", "host", "--socket", epd_sock, "--config", conf])
        try:
            run(m, epd_sock, conf)
        finally:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
    return 0


def run(m, epd_sock, conf):
    # Readiness: READY=1 with a STATUS= and MAINPID= in the same message, and a socket that
    # serves at once (a Type=notify dependant may connect the moment it arrives).
    ready = m.receive(lambda f: "READY" in f, 20)
    if ready is None:
        fail("no READY=1 within 20 s:\n" + m.log())
    if ready["READY"] != "1":
        fail("READY=%s" % ready["READY"])
    if not ready.get("STATUS", "").startswith("serving on"):
        fail("READY without a STATUS= line: %r" % ready)
    if ready.get("MAINPID") != str(m.proc.pid):
        fail("MAINPID=%s, daemon pid %d" % (ready.get("MAINPID"), m.proc.pid))
    r = m.epctl(epd_sock, "status", "--json")
    if r.returncode != 0:
        fail("epctl status right after READY=1: %s" % r.stderr)
    if json.loads(r.stdout)["pid"] != m.proc.pid:
        fail("epctl reached another daemon: %s" % r.stdout)
    print("READY=1 with %r; epctl served at once" % ready["STATUS"])

    # Watchdog: pings every WATCHDOG_USEC/2, each after a STATUS= line with live counts.
    start = time.monotonic()
    m.receive(lambda f: False, 1.5)
    pings = [t for t, f in m.messages if f.get("WATCHDOG") == "1" and t >= start]
    if len(pings) < 5:
        fail("%d WATCHDOG=1 pings in 1.5 s with WATCHDOG_USEC=%d" % (len(pings), WATCHDOG_USEC))
    gaps = sorted(b - a for a, b in zip(pings, pings[1:]))
    median = gaps[len(gaps) // 2]
    # Half the period is 100 ms. The worst gap is allowed some slack for a loaded test machine;
    # systemd itself would only act after a full period without a ping.
    if not 0.05 <= median <= 0.15 or gaps[-1] > 0.4:
        fail("watchdog gaps median %.3f s, max %.3f s; expected about %.3f s"
             % (median, gaps[-1], WATCHDOG_USEC / 2e6))
    statuses = [f["STATUS"] for t, f in m.messages if "STATUS" in f and t >= start]
    pattern = re.compile(r"^\d+ clients, \d+ groups, \d+ ops$")
    if len(statuses) < len(pings) - 1 or not all(pattern.match(s) for s in statuses):
        fail("STATUS= lines with the pings: %r" % statuses[:5])
    print("%d WATCHDOG=1 pings in 1.5 s, median gap %.0f ms; STATUS=%r"
          % (len(pings), median * 1000, statuses[-1]))

    # A connected client shows in the next STATUS=.
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(epd_sock)
    if m.receive(lambda f: f.get("STATUS", "").startswith("1 clients"), 5) is None:
        fail("STATUS= never showed the connected client")
    client.close()
    if m.receive(lambda f: f.get("STATUS", "").startswith("0 clients"), 5) is None:
        fail("STATUS= never showed the client gone")
    print("STATUS= follows clients connecting and leaving")

    # SIGHUP: the file now asks for debug logging, which shows on the next connection.
    if "client connected" in m.log():
        fail("debug line logged at log_level=info")
    with open(conf, "w") as f:
        f.write("[daemon]\nlog_level = debug\n")
    m.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "configuration reloaded" not in m.log():
        if time.monotonic() > deadline:
            fail("no 'configuration reloaded' after SIGHUP:\n" + m.log())
        m.receive(lambda f: False, 0.1)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(epd_sock)
    deadline = time.monotonic() + 10
    while "client connected" not in m.log():
        if time.monotonic() > deadline:
            fail("log_level=debug did not take effect after SIGHUP:\n" + m.log())
        m.receive(lambda f: False, 0.1)
    client.close()
    after = time.monotonic()
    m.receive(lambda f: False, 0.5)
    if sum(1 for t, f in m.messages if f.get("WATCHDOG") == "1" and t >= after) < 2:
        fail("watchdog pings stopped after SIGHUP")
    print("SIGHUP reloaded the configuration; pings go on")

    # SIGTERM: STOPPING=1, then exit 0.
    m.proc.send_signal(signal.SIGTERM)
    if m.receive(lambda f: f.get("STOPPING") == "1", 10) is None:
        fail("no STOPPING=1 after SIGTERM")
    try:
        rc = m.proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        fail("epd did not exit within 40 s of SIGTERM")
    if rc != 0:
        fail("epd exited %d after SIGTERM:\n%s" % (rc, m.log()))
    print("SIGTERM: STOPPING=1, exit 0; %d notify messages, all from pid %d"
          % (len(m.messages), m.proc.pid))


if __name__ == "__main__":
    sys.exit(main())
