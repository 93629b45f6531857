"""The namespace testbed really connects and isolates: TCP across hosts, nft cuts and loss, tc tbf caps, mDNS.

Needs root, iproute2 and nftables (skipped with the reason otherwise). About 15 s.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import pytest

from tests.netns import NetnsTestbed, cleanup_stale, netns_available

_OK, _WHY = netns_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _OK, reason=_WHY), pytest.mark.timeout(120)]

PORT = 7411

# Serves forever: each connection is read to EOF, then answered with the byte count.
SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.settimeout(30); n = 0
    try:
        while True:
            b = c.recv(1 << 16)
            if not b: break
            n += len(b)
        c.sendall(str(n).encode())
    except OSError:
        pass
    finally:
        c.close()
"""

# Sends N bytes, half-closes, waits for the count; prints "<bytes> <seconds>"; exit 1 on any socket error.
CLIENT = r"""
import socket, sys, time
host, port, nbytes, tmo = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
t0 = time.monotonic()
try:
    c = socket.create_connection((host, port), timeout=tmo)
    c.settimeout(tmo)
    c.sendall(b"x" * nbytes); c.shutdown(socket.SHUT_WR)
    reply = c.recv(64)
except OSError as exc:
    print("error", type(exc).__name__, exc); sys.exit(1)
print(int(reply or b"-1"), time.monotonic() - t0)
"""


def _wait_line(proc: subprocess.Popen[str], want: str, timeout: float) -> str:
    """First stdout line of ``proc`` containing ``want``, read with a bounded wait."""
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if want in line:
            return line
    err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
    raise AssertionError(f"no {want!r} from {proc.args} within {timeout}s (rc {proc.poll()}): {err}")


def _send(tb: NetnsTestbed, src: int, dst: int, nbytes: int = 1000, timeout: float = 1.5) -> tuple[bool, float, str]:
    r = tb.run(src, [sys.executable, "-c", CLIENT, tb.ip(dst), str(PORT), str(nbytes), str(timeout)],
               timeout=timeout + 30)
    if r.returncode != 0:
        return False, 0.0, r.stdout + r.stderr
    count, secs = r.stdout.split()
    assert int(count) == nbytes, r.stdout
    return True, float(secs), r.stdout


def _server(tb: NetnsTestbed, host: int) -> subprocess.Popen[str]:
    proc = tb.popen(host, [sys.executable, "-c", SERVER, tb.ip(host), str(PORT)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_line(proc, "ready", 10)
    return proc


@pytest.fixture
def tb():
    with NetnsTestbed(n_hosts=3, prefix="lpt") as testbed:
        yield testbed


def test_hosts_connect_and_cut_heal(tb: NetnsTestbed) -> None:
    _server(tb, 1)
    _server(tb, 2)
    ok, _, out = _send(tb, 0, 1)
    assert ok, f"host 0 cannot reach host 1: {out}"

    tb.cut(0, 1)
    ok, _, out = _send(tb, 0, 1)
    assert not ok and "error" in out, out
    ok, _, out = _send(tb, 1, 0, timeout=1.0)  # both directions: replies from host 0 are dropped too
    assert not ok
    ok, _, out = _send(tb, 0, 2)  # other links untouched
    assert ok, out

    tb.heal(0, 1)
    ok, _, out = _send(tb, 0, 1)
    assert ok, f"still cut after heal: {out}"
    tb.heal(0, 1)  # idempotent


def test_one_way_cut_and_loss(tb: NetnsTestbed) -> None:
    _server(tb, 1)
    tb.cut(0, 1, both=False)
    ok, _, _ = _send(tb, 0, 1)
    assert not ok
    tb.heal(0, 1)
    tb.loss(0, 100)
    ok, _, _ = _send(tb, 0, 1)
    assert not ok, "100% loss still delivered"
    tb.loss(0, 0)
    ok, _, out = _send(tb, 0, 1)
    assert ok, out


def test_isolate_and_rejoin(tb: NetnsTestbed) -> None:
    _server(tb, 0)
    _server(tb, 1)
    tb.isolate(2)
    for src, dst in ((2, 0), (2, 1), (0, 2)):
        ok, _, _ = _send(tb, src, dst, timeout=1.0)
        assert not ok, f"host {src} reached host {dst} while host 2 is isolated"
    ok, _, out = _send(tb, 0, 1)  # the rest of the LAN is untouched
    assert ok, out
    tb.isolate(2)  # idempotent
    tb.rejoin(2)
    for src, dst in ((2, 0), (1, 2)):
        if dst == 2:
            _server(tb, 2)
        ok, _, out = _send(tb, src, dst)
        assert ok, f"host {src} cannot reach host {dst} after rejoin: {out}"
    tb.rejoin(2)  # a no-op now


def test_bandwidth_cap(tb: NetnsTestbed) -> None:
    _server(tb, 1)
    nbytes = 2_000_000
    ok, uncapped, out = _send(tb, 0, 1, nbytes, timeout=20)
    assert ok, out

    tb.cap(0, "8mbit")
    qd = tb.qdisc(0)
    assert "tbf" in qd and "8Mbit" in qd, qd
    ok, capped, out = _send(tb, 0, 1, nbytes, timeout=20)
    assert ok, f"capped transfer failed: {out}"
    # 2 MB at 8 Mbit/s is about 2 s (measured 7.7 Mbit/s here); uncapped veth takes milliseconds.
    assert capped > 1.0, f"capped 2 MB took only {capped:.3f}s"
    assert capped > 5 * uncapped, f"capped {capped:.3f}s vs uncapped {uncapped:.3f}s"

    tb.uncap(0)
    assert "tbf" not in tb.qdisc(0)
    tb.uncap(0)  # idempotent


def _bridge_sent_bytes(tb: NetnsTestbed) -> int:
    out = subprocess.run(["tc", "-s", "-n", tb.bridge_ns, "qdisc", "show", "dev", "br0"], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split("Sent ")[1].split()[0])


def test_shared_link_carries_every_hosts_traffic() -> None:
    """share_link: the transfers of two disjoint host pairs both leave through the one tbf on br0 (its byte counter
    holds both payloads), so they share its rate; the hosts still reach each other."""
    with NetnsTestbed(n_hosts=4, prefix="lpt") as tb:
        tb.share_link("100mbit")
        assert "tbf" in subprocess.run(["tc", "-n", tb.bridge_ns, "qdisc", "show", "dev", "br0"], check=True,
                                       capture_output=True, text=True).stdout
        _server(tb, 1)
        _server(tb, 3)
        before = _bridge_sent_bytes(tb)
        nbytes = 1_000_000
        for src, dst in ((0, 1), (2, 3)):
            ok, _, out = _send(tb, src, dst, nbytes, timeout=20)
            assert ok, f"host {src} cannot reach host {dst} through the shared link: {out}"
        assert _bridge_sent_bytes(tb) - before >= 2 * nbytes


REGISTER = r"""
import socket, sys, time
from zeroconf import ServiceInfo, Zeroconf
ip, name = sys.argv[1], sys.argv[2]
zc = Zeroconf(interfaces=[ip])
info = ServiceInfo("_lpdltest._tcp.local.", f"{name}._lpdltest._tcp.local.", port=7070,
                   addresses=[socket.inet_aton(ip)], properties={"peer": name}, server=f"{name}.local.")
zc.register_service(info)
print("registered", flush=True)
time.sleep(60)
"""

BROWSE = r"""
import sys, time
from zeroconf import ServiceBrowser, ServiceStateChange, Zeroconf
ip, want, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
zc = Zeroconf(interfaces=[ip])
found = []
def on_change(zeroconf, service_type, name, state_change):
    if state_change is ServiceStateChange.Added:
        found.append(name)
ServiceBrowser(zc, "_lpdltest._tcp.local.", handlers=[on_change])
t0 = time.monotonic()
while time.monotonic() - t0 < limit:
    for name in list(found):
        if name.startswith(want + "."):
            info = zc.get_service_info("_lpdltest._tcp.local.", name, timeout=2000)
            if info is not None:
                print("resolved", name, info.parsed_addresses()[0], info.port, info.properties[b"peer"].decode(),
                      round(time.monotonic() - t0, 3), flush=True)
                zc.close(); sys.exit(0)
    time.sleep(0.05)
print("not found; saw", found); zc.close(); sys.exit(1)
"""


def test_mdns_across_namespaces(tb: NetnsTestbed) -> None:
    pytest.importorskip("zeroconf")
    reg = tb.popen(1, [sys.executable, "-c", REGISTER, tb.ip(1), "peer-h1"],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_line(reg, "registered", 15)
    r = tb.run(0, [sys.executable, "-c", BROWSE, tb.ip(0), "peer-h1", "10"], timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    _, _name, addr, port, peer, _secs = r.stdout.split()
    assert (addr, port, peer) == (tb.ip(1), "7070", "peer-h1")

    # a cut host no longer sees the announcement traffic of its neighbour (multicast from h1 dropped in h2)
    tb.cut(2, 1)
    r = tb.run(2, [sys.executable, "-c", BROWSE, tb.ip(2), "peer-h1", "2"], timeout=30)
    assert r.returncode == 1, r.stdout


def test_teardown_on_exception_and_stale_cleanup() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), NetnsTestbed(n_hosts=2, prefix="lptx") as t:
        names = [t.bridge_ns, t.ns(0), t.ns(1)]
        t.popen(0, ["sleep", "60"])
        raise RuntimeError("boom")
    left = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    assert not any(n in left for n in names), left

    # a namespace left by a crashed run (its pid is gone) is removed by the next testbed with that prefix
    dead_pid = 2**22 + 12345  # above the default pid_max: never alive
    stale = f"lptx-{dead_pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in cleanup_stale("lptx")
        assert stale not in subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)
