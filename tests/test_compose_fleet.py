"""deploy/docker-compose.yml really runs: a secured 3-peer fleet in containers finds itself by mDNS, trains and
gossips, survives a killed container, and the restarted one resumes from its volume.

Everything without a registry (deploy/docker-offline.sh): Debian's docker.io / docker-compose / debootstrap from
apt, a debootstrap'ed base image (`docker import`, cached in /var/cache/lpdl-peer), every wheel collected on this
host (the torch CPU wheel from pip's local find-links folder), `docker build --network none --build-arg OFFLINE=1`.
dockerd runs with --iptables=false --ip-forward=false --ip-masq=false only while this module runs: the bridge
between the containers carries TCP and mDNS without any firewall rule, and the host's iptables FORWARD policy,
nft ruleset and forwarding sysctls stay as they were (checked while the fleet runs and after dockerd stopped), so
network-namespace tests keep working beside it. The conftest runs docker-marked tests last.

Root only (dockerd); skipped with the reason where dockerd cannot start. Cold (nothing installed or cached) this
took 12 minutes here on 2 busy cores, warm (packages, base image, wheels, layers cached) 3-4.5; deploy/README.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "docker-offline.sh"
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
TAG = "lpdl-peer:compose-test"
PEERS = ("peer0", "peer1", "peer2")
UP = ("active", "busy")
CHECKPOINT_EVERY = 5
FLEET_NAME = "compose-test"

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1800)]


def _run(argv: list[str], timeout: float = 60, check: bool = True, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          env=None if env is None else {**os.environ, **env})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def host_network_state() -> dict[str, str]:
    """What dockerd could change that namespace testbeds depend on."""
    state = {}
    for name, argv in (("iptables", ["iptables", "-S"]), ("ip6tables", ["ip6tables", "-S"]),
                       ("nft", ["nft", "list", "ruleset"])):
        if shutil.which(argv[0]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            state[name] = proc.stdout + proc.stderr
    for key in ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/bridge/bridge-nf-call-iptables",
                "net/bridge/bridge-nf-call-ip6tables"):
        path = Path("/proc/sys") / key
        state[key] = path.read_text().strip() if path.exists() else "absent"
    return state


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


def _our_dockerd_alive() -> bool:
    """Whether deploy/docker-offline.sh dockerd-up's dockerd (its pid file) is running."""
    pidfile = Path("/run/lpdl-dockerd/dockerd.pid")
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def _why_no_docker() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the compose test needs Linux (dockerd)"
    if os.geteuid() != 0:
        return "the compose test starts dockerd and installs Debian packages: needs root"
    if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
        return "no dockerd and no apt-get to install Debian's docker.io"
    return None


# -- dockerd, only while this module runs --------------------------------------------------------------------
@pytest.fixture(scope="module")
def docker_daemon() -> Iterator[dict[str, str]]:
    why = _why_no_docker()
    if why:
        pytest.skip(why)
    before = host_network_state()
    leftover = _our_dockerd_alive()  # a previous run killed before its teardown: ours to stop
    external = _docker_answers() and not leftover
    started = leftover
    t0 = time.monotonic()
    proc = _run([str(SCRIPT), "install"], timeout=900, check=False)
    if proc.returncode != 0:
        pytest.skip(f"could not install docker.io / docker-compose / debootstrap: {proc.stderr.strip()[-500:]}")
    print(f"\npackages ready in {time.monotonic() - t0:.1f} s")
    # SIGTERM (a CI runner, an operator) becomes KeyboardInterrupt, on which pytest still runs the finalizers below
    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}: tearing the compose fleet and dockerd down")

    previous = signal.signal(signal.SIGTERM, _terminate)
    if leftover:
        print("dockerd left running by an earlier run of this test: used, and stopped at the end")
    elif not external:
        t1 = time.monotonic()
        proc = _run([str(SCRIPT), "dockerd-up"], timeout=120, check=False)
        started = proc.returncode == 0
        if not started:
            _run([str(SCRIPT), "dockerd-down"], timeout=120, check=False)
            signal.signal(signal.SIGTERM, previous)
            pytest.skip(f"dockerd cannot start here: {proc.stderr.strip()[-800:]}")
        print(f"dockerd started in {time.monotonic() - t1:.1f} s")
    else:
        print("dockerd already running: used and left as found")
    try:
        _remove_stale_projects()
        yield before
    finally:
        signal.signal(signal.SIGTERM, previous)
        if started:
            down = _run([str(SCRIPT), "dockerd-down"], timeout=180, check=False)
            print(down.stderr.strip()[-1500:])
        after = host_network_state()
        changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
        assert not changed, f"host firewall / sysctls differ after the docker test: {changed}"
        if started:
            assert not _docker_answers(), "dockerd still answers after teardown"


def _remove_stale_projects() -> None:
    """Containers, volumes and networks of compose projects of this test whose process is gone (killed runs)."""
    out = _run(["docker", "ps", "-a", "--format", '{{.Label "com.docker.compose.project"}}'], check=False).stdout
    for project in sorted(set(out.split())):
        m = re.fullmatch(r"lpdlt(\d+)", project)
        if not m or _pid_alive(int(m.group(1))):
            continue
        label = f"label=com.docker.compose.project={project}"
        ids = _run(["docker", "ps", "-aq", "--filter", label], check=False).stdout.split()
        if ids:
            _run(["docker", "rm", "-f", "-v", *ids], timeout=120, check=False)
        for kind in ("volume", "network"):
            names = _run(["docker", kind, "ls", "-q", "--filter", label], check=False).stdout.split()
            if names:
                _run(["docker", kind, "rm", *names], timeout=60, check=False)
        print(f"removed the leftovers of compose project {project} (its test process is gone)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="module")
def image(docker_daemon: dict[str, str]) -> dict[str, Any]:
    t0 = time.monotonic()
    proc = _run([str(SCRIPT), "build", TAG], timeout=1200, check=False, env={"PYTHON": sys.executable})
    build_s = time.monotonic() - t0
    assert proc.returncode == 0, f"offline image build failed:\n{proc.stderr[-4000:]}\n{proc.stdout[-4000:]}"
    print("\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith("[docker-offline")))
    info = json.loads(_run(["docker", "image", "inspect", TAG]).stdout)[0]
    print(f"image {TAG}: built (base, wheels, build) in {build_s:.0f} s, {info['Size'] / 1e6:.0f} MB "
          f"({info['Size'] / 2**20:.0f} MiB), {info['Os']}/{info['Architecture']}")
    return info


# -- the compose fleet ---------------------------------------------------------------------------------------
class Fleet:
    """One compose project of deploy/docker-compose.yml (docker-compose v1, else `docker compose` v2)."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project = project
        self.env = env
        if shutil.which("docker-compose"):
            self.cmd = ["docker-compose"]
        else:
            self.cmd = ["docker", "compose"]
        self.cmd += ["-p", project, "-f", str(COMPOSE_FILE)]
        self._ids: dict[str, str] = {}

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self.cmd, *args], timeout=timeout, check=check, env=self.env)

    def container(self, service: str) -> str:
        if service not in self._ids:
            cid = self.compose("ps", "-q", service).stdout.strip()
            assert cid, f"no container for {service}"
            self._ids[service] = cid
        return self._ids[service]

    def status(self, service: str) -> dict[str, Any] | None:
        """`lpdl-peer status --json` run inside the container (docker exec), None while the daemon does not answer."""
        proc = _run(["docker", "exec", self.container(service), "lpdl-peer", "status", "--json", "--timeout", "10"],
                    timeout=40, check=False)
        if proc.returncode != 0:
            return None
        try:
            return json.loads(proc.stdout)
        except json.JSONDecodeError:
            return None

    def logs(self, service: str, since: float | None = None) -> str:
        argv = ["docker", "logs"]
        if since is not None:
            argv += ["--since", f"{since:.3f}"]
        proc = _run([*argv, self.container(service)], timeout=60, check=False)
        return proc.stdout + proc.stderr

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(_run(["docker", "inspect", self.container(service)]).stdout)[0]

    def wait(self, service: str, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str
             ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.status(service)
            if last is not None and pred(last):
                return last
            time.sleep(2)
        brief = None if last is None else {k: last.get(k) for k in ("phase", "round", "applied", "neighbours")}
        raise AssertionError(f"{service}: not {what} within {timeout:.0f} s; last status {brief}\n"
                             f"log tail:\n{self.logs(service)[-3000:]}")

    def down(self) -> None:
        t0 = time.monotonic()
        for service in PEERS:
            try:
                print(f"--- {service} log tail ---\n{self.logs(service)[-1500:]}")
            except AssertionError:
                pass
        self.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=300, check=False)
        label = f"label=com.docker.compose.project={self.project}"
        left = _run(["docker", "ps", "-aq", "--filter", label], check=False).stdout.split()
        if left:
            _run(["docker", "rm", "-f", "-v", *left], check=False)
        vols = _run(["docker", "volume", "ls", "-q", "--filter", label], check=False).stdout.split()
        if vols:
            _run(["docker", "volume", "rm", "-f", *vols], check=False)
        print(f"compose down in {time.monotonic() - t0:.1f} s")


def neighbours_up(status: dict[str, Any], others: tuple[str, ...]) -> bool:
    nb = status.get("neighbours", {})
    return all(p in nb and nb[p]["live"] and nb[p]["state"] in UP for p in others)


@pytest.fixture
def fleet(image: dict[str, Any]) -> Iterator[Fleet]:
    env = {"LPDL_IMAGE": TAG, "LPDL_FLEET": FLEET_NAME, "LPDL_THREADS": "1", "LPDL_EVAL_EVERY": "10",
           "LPDL_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY), "LPDL_MAX_ROUNDS": "0"}
    f = Fleet(f"lpdlt{os.getpid()}", env)
    try:
        t0 = time.monotonic()
        f.compose("up", "-d", "--no-build", timeout=300)
        print(f"compose up -d in {time.monotonic() - t0:.1f} s")
        yield f
    finally:
        f.down()


# -- the test -------------------------------------------------------------------------------------------------
def test_compose_fleet_secured_discovers_trains_and_resumes(docker_daemon: dict[str, str],
                                                            image: dict[str, Any], fleet: Fleet) -> None:
    t_start = time.monotonic()
    # the image: an unprivileged user, a health check asking the daemon, this machine's platform
    config = image["Config"]
    assert config["User"] == "lpdl"
    assert "lpdl-peer status --json" in " ".join(config["Healthcheck"]["Test"])
    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    assert image["Os"] == "linux" and image["Architecture"] == machine
    uid = _run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "id", TAG, "-u"]).stdout.strip()
    assert uid == "10001", uid

    # 1. every peer discovers the other two by mDNS, over mutual TLS, and applies their updates
    for me in PEERS:
        others = tuple(p for p in PEERS if p != me)
        s = fleet.wait(me, lambda st, others=others: st["phase"] == "training" and neighbours_up(st, others)
                       and st["applied"] > 0 and st["round"] >= 5, 420, "gossiping with both others")
        assert s["peer_id"] == me and s["fleet"] == FLEET_NAME  # the id its certificate binds
        log = fleet.logs(me)
        assert "(port 7070, mutual TLS)" in log, log[-2000:]
        for other in others:
            assert re.search(rf"discovery: found peer {other} at [\d.]+:7070 \(verified by its certificate\)", log)
    print(f"fleet gossiping after {time.monotonic() - t_start:.0f} s")

    # 2. status of a remote peer over the network with the operator certificate (Status RPC, mutual TLS); a
    #    look-alike operator certificate of another CA with the same fleet name is refused
    net, ca_volume = f"{fleet.project}_lpdl", f"{fleet.project}_ca"
    remote = _run(["docker", "run", "--rm", "--network", net, "-v", f"{ca_volume}:/ca:ro", "--user", "0",
                   TAG, "status", "--peer", "peer1:7070", "--tls-dir", "/ca/operator", "--json"], timeout=120)
    assert json.loads(remote.stdout)["peer_id"] == "peer1"
    script = (f"lpdl-peer ca init --ca-dir /tmp/ca --fleet {FLEET_NAME} >/dev/null; "
              "lpdl-peer ca issue --ca-dir /tmp/ca --name operator --operator --out /tmp/op >/dev/null; "
              "lpdl-peer status --peer peer1:7070 --tls-dir /tmp/op --json --timeout 10")
    forged = _run(["docker", "run", "--rm", "--network", net, "--entrypoint", "sh", TAG, "-euc", script],
                  timeout=120, check=False)
    assert forged.returncode != 0 and '"peer_id"' not in forged.stdout, forged.stdout + forged.stderr

    # 3. memory per daemon: the status document's own figures and the container's cgroup (docker stats)
    stats = {}
    for line in _run(["docker", "stats", "--no-stream", "--format", "{{.ID}} {{.MemUsage}}",
                      *[fleet.container(p) for p in PEERS]]).stdout.splitlines():
        cid, usage = line.split(" ", 1)
        stats[cid] = usage.split(" / ")[0]
    for me in PEERS:
        mem = fleet.status(me)["memory"]
        print(f"{me}: rss {mem['rss_mib']:.0f} MiB, peak {mem['peak_mib']:.0f} MiB, "
              f"docker stats {stats.get(fleet.container(me)[:12], '?')}")
        assert 100 < mem["rss_mib"] < 2048, mem  # under the systemd unit's MemoryMax=2G
        assert mem["allocator"] == "tcmalloc", mem  # the image installs it; the daemon re-executed onto it

    # 4. the HEALTHCHECK (lpdl-peer status inside the container) reports healthy
    deadline = time.monotonic() + 150
    health = {}
    while time.monotonic() < deadline:
        health = {p: fleet.inspect(p)["State"].get("Health", {}).get("Status") for p in PEERS}
        if all(h == "healthy" for h in health.values()):
            break
        time.sleep(5)
    assert all(h == "healthy" for h in health.values()), health

    # 5. dockerd changed nothing namespace testbeds depend on, and a namespace LAN works beside it
    assert host_network_state() == docker_daemon, "dockerd changed the host firewall or sysctls while running"
    _namespace_lan_works()

    # 6. docker kill one peer: the other two carry on
    victim = "peer1"
    r_kill = fleet.status(victim)["round"]
    killed_at = time.time()
    _run(["docker", "kill", fleet.container(victim)])
    deadline = time.monotonic() + 30
    while (state := fleet.inspect(victim)["State"])["Running"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not state["Running"] and state["ExitCode"] == 137, state
    # (a killed peer says no goodbye: its mDNS record stays in zeroconf's cache, so until the liveness checks
    # evict it (net.peer_expiry_s, 60 s) the ring still routes peer0 -> peer1 -> peer2; the edge peer2 -> peer0
    # carries on)
    survivors = ("peer0", "peer2")
    before = {me: fleet.status(me) for me in survivors}
    for me in survivors:
        fleet.wait(me, lambda st, s0=before[me]: st["round"] >= s0["round"] + 10, 180, "training with peer1 down")
    fleet.wait("peer2", lambda st: st["neighbours"]["peer0"]["delivered"]
               >= before["peer2"]["neighbours"]["peer0"]["delivered"] + 5, 120, "delivering to peer0")
    fleet.wait("peer0", lambda st: st["applied"] >= before["peer0"]["applied"] + 5, 120,
               "applying peer2's updates with peer1 down")
    time.sleep(3)
    assert not fleet.inspect(victim)["State"]["Running"], "a killed container came back by itself"

    # 7. restarted, it resumes from the checkpoint in its volume (not from round 0) and rejoins the gossip
    _run(["docker", "start", fleet.container(victim)])
    deadline = time.monotonic() + 240
    restored = None
    while time.monotonic() < deadline and restored is None:
        restored = re.search(r"restored checkpoint \S+ \(round (\d+),", fleet.logs(victim, since=killed_at))
        time.sleep(2)
    assert restored, fleet.logs(victim, since=killed_at)[-3000:]
    r_restored = int(restored.group(1))
    assert r_restored > 0 and r_restored >= r_kill - 2 * CHECKPOINT_EVERY, (r_restored, r_kill)
    first = fleet.wait(victim, lambda st: True, 240, "answering after the restart")
    assert first["round"] >= r_restored, (first["round"], r_restored)
    fleet.wait(victim, lambda st: neighbours_up(st, ("peer0", "peer2")) and st["applied"] > 0
               and st["round"] >= r_restored + 5, 300, "gossiping again after the restart")
    assert "joined: pulled the model" not in fleet.logs(victim, since=killed_at), "re-joined instead of resuming"
    print(f"{victim}: killed at round {r_kill}, restored round {r_restored}, first status round {first['round']}; "
          f"test body {time.monotonic() - t_start:.0f} s")


def _namespace_lan_works() -> None:
    """Two network namespaces on a bridge reach each other over TCP while dockerd and the fleet run."""
    from tests.netns import NetnsTestbed, netns_available

    ok, why = netns_available()
    if not ok:
        print(f"namespace check skipped: {why}")
        return
    server = ("import socket; s = socket.socket(); s.bind(('10.214.9.2', 7171)); s.listen(); c, _ = s.accept(); "
              "c.sendall(b'pong'); c.close()")
    client = ("import socket, time\nfor _ in range(50):\n    try:\n"
              "        s = socket.create_connection(('10.214.9.2', 7171), timeout=2); break\n"
              "    except OSError: time.sleep(0.1)\nprint(s.recv(4).decode())")
    with NetnsTestbed(n_hosts=2, prefix="lpdk", subnet="10.214.9") as tb:
        tb.popen(1, [sys.executable, "-c", server])
        out = tb.run(0, [sys.executable, "-c", client], timeout=30)
        assert out.stdout.strip() == "pong", out.stdout + out.stderr
