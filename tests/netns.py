"""A throwaway LAN of network namespaces for tests: N hosts on one bridge, link cuts, loss and bandwidth caps.

    with NetnsTestbed(n_hosts=3, prefix="lpt") as tb:
        server = tb.popen(1, [sys.executable, "-m", "http.server", "--bind", tb.ip(1), "8000"])
        tb.run(0, ["python3", "-c", "..."])       # like subprocess.run inside host 0
        tb.cut(0, 1); tb.heal(0, 1); tb.loss(0, 20); tb.cap(0, "8mbit"); tb.uncap(0)
        tb.isolate(2); tb.rejoin(2)                # host 2 off the LAN (every packet of its eth0) and back

Layout (the same as deploy/netns-testbed.sh): namespace ``<prefix>-<pid>-<k>-br`` holds bridge ``br0`` and one veth
``v<i>`` per host; host ``i`` is namespace ``<prefix>-<pid>-<k>-h<i>`` with ``lo`` up and ``eth0`` =
``<subnet>.<i+1>/24``, multicast on. Names carry the creating pid, so parallel test processes never clash and
leftovers of crashed runs (pid gone) with the same prefix are removed on the next start. The subnet exists only
inside these namespaces: nothing is added to the root namespace.

Teardown (``close``/``__exit__``, also on exceptions and at interpreter exit) kills every process still inside the
hosts' namespaces (only processes this testbed started can be there) and deletes the namespaces.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Self

CHAOS_TABLE = "lpchaos"
#: nft table of :meth:`NetnsTestbed.isolate` (separate from the chaos table: deleting it is the rejoin)
ISOLATE_TABLE = "lpiso"
_counter = itertools.count()
_live: set[NetnsTestbed] = set()


def _sh(argv: Sequence[str], check: bool = True, timeout: float = 20.0, input: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (rc {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class NetnsError(RuntimeError):
    """A namespace, nft or tc command failed; the message holds the command and its stderr."""


def netns_available() -> tuple[bool, str]:
    """Whether namespace testbeds can run here, and if not, why (a pytest skip reason)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "no Linux network namespaces on this platform"
    if os.geteuid() != 0:
        return False, "network namespace tests need root (run as root or with sudo)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (apt-get install -y {pkg})"
    name = f"lpprobe-{os.getpid()}-{next(_counter)}"
    try:
        proc = _sh(["ip", "netns", "add", name], check=False, timeout=10)
        if proc.returncode != 0:
            return False, f"cannot create a network namespace: {proc.stderr.strip()}"
        proc = _sh(["ip", "-n", name, "link", "add", "br0", "type", "bridge"], check=False, timeout=10)
        if proc.returncode != 0:
            return False, f"cannot create a bridge in a namespace: {proc.stderr.strip()}"
        proc = _sh(["ip", "netns", "exec", name, "nft", "list", "ruleset"], check=False, timeout=10)
        if proc.returncode != 0:
            return False, f"nft does not work in a namespace: {proc.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"namespace probe failed: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    return True, "ok"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_list() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_ns_processes(ns: str, grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``ns``."""
    def pids() -> list[int]:
        proc = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True)
        return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]

    first = pids()
    if not first:
        return
    for pid in first:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and pids():
        time.sleep(0.05)
    for pid in pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete_group(names: Sequence[str]) -> None:
    for ns in names:
        _kill_ns_processes(ns)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def cleanup_stale(prefix: str) -> list[str]:
    """Delete namespaces ``<prefix>-<pid>-...`` whose creating process is gone; returns the names removed."""
    pat = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-(br|h\d+)$")
    stale = [ns for ns in _netns_list() if (m := pat.match(ns)) and not _pid_alive(int(m.group(1)))]
    _delete_group(stale)
    return stale


class NetnsTestbed:
    """N namespaces on one bridge; see the module docstring."""

    def __init__(self, n_hosts: int = 2, prefix: str = "lpt", subnet: str = "10.213.0") -> None:
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts must be 1..250, got {n_hosts}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ValueError(f"prefix must be 1-8 lowercase letters/digits, got {prefix!r}")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be the first three octets (like 10.213.0), got {subnet!r}")
        self.n_hosts = n_hosts
        self.prefix = prefix
        self.subnet = subnet
        self.tag = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.bridge_ns = f"{self.tag}-br"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._chaos: set[int] = set()
        self._isolated: set[int] = set()

    # -- naming --------------------------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        """Namespace name of host ``i``."""
        self._check(i)
        return f"{self.tag}-h{i}"

    def ip(self, i: int) -> str:
        """IPv4 address of host ``i`` (on its eth0)."""
        self._check(i)
        return f"{self.subnet}.{i + 1}"

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host {i} out of range 0..{self.n_hosts - 1}")

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        ok, why = netns_available()
        if not ok:
            raise NetnsError(why)
        cleanup_stale(self.prefix)
        _live.add(self)
        try:
            self._add_ns(self.bridge_ns)
            _sh(["ip", "-n", self.bridge_ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
            # Keep bridged frames out of iptables (dockerd's FORWARD DROP): the sysctl is per namespace.
            for f in ("iptables", "ip6tables", "arptables"):
                subprocess.run(["ip", "netns", "exec", self.bridge_ns, "sh", "-c",
                                f"echo 0 > /proc/sys/net/bridge/bridge-nf-call-{f}"], check=False, capture_output=True)
            _sh(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
            for i in range(self.n_hosts):
                ns = f"{self.tag}-h{i}"
                self._add_ns(ns)
                _sh(["ip", "-n", self.bridge_ns, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0",
                     "netns", ns])
                _sh(["ip", "-n", self.bridge_ns, "link", "set", f"v{i}", "master", "br0"])
                _sh(["ip", "-n", self.bridge_ns, "link", "set", f"v{i}", "up"])
                _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
                _sh(["ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0"])
                _sh(["ip", "-n", ns, "link", "set", "eth0", "up", "multicast", "on"])
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        self._created.append(name)

    def close(self) -> None:
        """Stop processes started here, kill anything left in the namespaces, delete them. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        _delete_group(list(reversed(self._created)))
        self._created.clear()
        _live.discard(self)

    # -- processes -----------------------------------------------------------------------------------------------
    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``."""
        return ["ip", "netns", "exec", self.ns(i), *map(str, argv)]

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i`` (subprocess.Popen keywords pass through); stopped on close."""
        proc = subprocess.Popen(self.argv(i, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], timeout: float = 30.0, **kw: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run inside host ``i`` with a bounded timeout (output captured as text unless overridden)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("check", False)
        return subprocess.run(self.argv(i, argv), timeout=timeout, **kw)  # noqa: PLW1510 (check defaults to False above)

    # -- link faults ---------------------------------------------------------------------------------------------
    def _nft(self, i: int, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return _sh(["ip", "netns", "exec", self.ns(i), "nft", *args], check=check, input=input)

    def _ensure_chaos(self, i: int) -> None:
        if i in self._chaos:
            return
        self._nft(i, "-f", "-", input=f"""
table inet {CHAOS_TABLE} {{
    set cut_out {{ type ipv4_addr; }}
    set cut_in {{ type ipv4_addr; }}
    chain loss {{ }}
    chain out {{ type filter hook output priority 0; policy accept; ip daddr @cut_out drop; jump loss; }}
    chain in {{ type filter hook input priority 0; policy accept; ip saddr @cut_in drop; }}
}}
""")
        self._chaos.add(i)

    def cut(self, i: int, j: int, both: bool = True) -> None:
        """Drop traffic from host i to host j (and, with ``both``, from j to i), by nft rules inside host i."""
        if i == j:
            raise ValueError("cut: hosts must differ")
        self._ensure_chaos(i)
        self._nft(i, "add", "element", "inet", CHAOS_TABLE, "cut_out", f"{{ {self.ip(j)} }}")
        if both:
            self._nft(i, "add", "element", "inet", CHAOS_TABLE, "cut_in", f"{{ {self.ip(j)} }}")

    def heal(self, i: int, j: int) -> None:
        """Undo :meth:`cut` (both directions); a no-op where nothing was cut."""
        self._ensure_chaos(i)
        for s in ("cut_out", "cut_in"):
            self._nft(i, "delete", "element", "inet", CHAOS_TABLE, s, f"{{ {self.ip(j)} }}", check=False)

    def isolate(self, i: int) -> None:
        """Take host i off the LAN: every packet in or out of its eth0 is dropped (mDNS included), by an nft table
        of its own inside host i; the interface stays up, so nothing but the traffic changes. Idempotent."""
        self._nft(i, "-f", "-", input=f"""
table inet {ISOLATE_TABLE} {{
    chain out {{ type filter hook output priority -10; policy accept; oifname "eth0" drop; }}
    chain in {{ type filter hook input priority -10; policy accept; iifname "eth0" drop; }}
}}
""")
        self._isolated.add(i)

    def rejoin(self, i: int) -> None:
        """Undo :meth:`isolate` (a no-op where host i is not isolated)."""
        if i in self._isolated:
            self._nft(i, "delete", "table", "inet", ISOLATE_TABLE, check=False)
            self._isolated.discard(i)

    def loss(self, i: int, pct: int) -> None:
        """Drop ``pct`` percent of host i's outgoing testbed packets at random (0 removes the loss)."""
        if not 0 <= pct <= 100:
            raise ValueError(f"pct must be 0..100, got {pct}")
        self._ensure_chaos(i)
        self._nft(i, "flush", "chain", "inet", CHAOS_TABLE, "loss")
        rule = ["ip", "daddr", f"{self.subnet}.0/24"]
        if 0 < pct < 100:
            rule += ["numgen", "random", "mod", "100", "<", str(pct)]
        if pct:
            self._nft(i, "add", "rule", "inet", CHAOS_TABLE, "loss", *rule, "drop")

    def cap(self, i: int, rate: str, burst: str | None = None, latency: str = "50ms") -> None:
        """Limit host i's egress to ``rate`` (tc tbf, e.g. "8mbit"); replaces an earlier cap."""
        if burst is None:
            burst = f"{max(4096, _rate_bits(rate) // 8 // 100)}b"  # >= rate/HZ: 10 ms worth of rate
        _sh(["tc", "-n", self.ns(i), "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
             "burst", burst, "latency", latency])

    def share_link(self, rate: str, latency: str = "100ms") -> str:
        """Make every host-to-host packet cross ONE link of ``rate`` (tc tbf), shared by all hosts; returns the
        router's address.

        The bridge namespace becomes a router (``br0`` = ``<subnet>.254``, forwarding on, ICMP redirects off) and
        each host's route to the subnet goes through it instead of straight across the bridge. A packet then enters
        the bridge namespace once and leaves once, by ``br0``'s egress, where the tbf sits: all flows queue on one
        token bucket, like devices behind one access point or one uplink. A per-host cap (:meth:`cap`) would give
        each host its own rate instead. Multicast (mDNS) still crosses the bridge directly, unshaped. Undone only
        by closing the testbed.
        """
        router = f"{self.subnet}.254"
        br = ["ip", "netns", "exec", self.bridge_ns]
        _sh(["ip", "-n", self.bridge_ns, "addr", "add", f"{router}/24", "dev", "br0"])
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0",
                    "net.ipv4.conf.br0.send_redirects=0"):
            _sh([*br, "sysctl", "-qw", key])
        for i in range(self.n_hosts):
            _sh(["ip", "netns", "exec", self.ns(i), "sysctl", "-qw", "net.ipv4.conf.all.accept_redirects=0"])
            _sh(["ip", "-n", self.ns(i), "route", "replace", f"{self.subnet}.0/24", "via", router, "dev", "eth0",
                 "onlink"])
        burst = f"{max(4096, _rate_bits(rate) // 8 // 100)}b"  # >= rate/HZ: 10 ms worth of rate
        _sh(["tc", "-n", self.bridge_ns, "qdisc", "replace", "dev", "br0", "root", "tbf", "rate", rate,
             "burst", burst, "latency", latency])
        return router

    def uncap(self, i: int) -> None:
        """Remove host i's bandwidth cap (a no-op without one)."""
        if "tbf" in self.qdisc(i):
            _sh(["tc", "-n", self.ns(i), "qdisc", "del", "dev", "eth0", "root"])

    def qdisc(self, i: int) -> str:
        """``tc qdisc show dev eth0`` of host i."""
        return _sh(["tc", "-n", self.ns(i), "qdisc", "show", "dev", "eth0"]).stdout


def _rate_bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)(bit|bps)", rate.lower())
    if not m:
        raise ValueError(f"rate must look like 8mbit, 500kbit, 1gbit, got {rate!r}")
    bits = int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]
    return bits * 8 if m.group(3) == "bps" else bits


@atexit.register
def _close_all() -> None:
    for tb in list(_live):
        tb.close()
