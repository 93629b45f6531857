"""deploy/ and systemd/ files are valid: unit (systemd-analyze or key checks), compose, Dockerfile, scripts, examples."""

from __future__ import annotations

import configparser
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from peer.config import RUN_SECTIONS

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "lpdl-peer.service"
TOML_EXAMPLE = ROOT / "systemd" / "peer.toml.example"
ENV_EXAMPLE = ROOT / "systemd" / "env.example"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SCRIPTS = sorted((ROOT / "deploy").glob("*.sh"))


# -- systemd ---------------------------------------------------------------------------------------------------
def _unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_required_keys() -> None:
    unit = _unit()
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    svc = unit["Service"]
    expected = {
        "Type": "notify",
        "Restart": "on-failure",
        "StateDirectory": "lpdl-peer",
        "CacheDirectory": "lpdl-peer",  # the int8 probe record (peer/lowp/host_record.py)
        "EnvironmentFile": "-/etc/lpdl-peer/env",
        "ExecStart": "/usr/local/bin/lpdl-peer start --config /etc/lpdl-peer/peer.toml",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }
    for key, value in expected.items():
        assert svc.get(key) == value, f"[Service] {key}={svc.get(key)!r}, expected {value!r}"
    assert int(svc["WatchdogSec"]) >= 30
    assert svc.get("DynamicUser") == "yes" or svc.get("User"), "must run as an unprivileged user"
    assert svc.get("User", "lpdl") != "root"
    families = set(svc["RestrictAddressFamilies"].split())
    # gRPC + mDNS (IPv4/6 UDP multicast), control socket + sd_notify, interface enumeration for mDNS
    assert {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"} <= families
    assert svc.get("CapabilityBoundingSet", None) == "", "no capabilities needed (ports > 1024)"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in unit["Unit"]["After"]


def _systemd_analyze() -> str:
    """The systemd-analyze executable, or skip saying how to get it (scripts/setup.sh installs it when root)."""
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed (apt-get install -y systemd; scripts/setup.sh does it as root)")
    return exe


def _verify_unit(text: str, tmp_path: Path) -> tuple[int, list[str], str]:
    """``systemd-analyze verify`` on a copy of the unit: (exit code, complaint lines about it, whole output)."""
    # verify insists that ExecStart exists: point it at a binary that does (the unit's real path is checked above)
    text = text.replace("/usr/local/bin/lpdl-peer", shutil.which("true") or "/bin/true")
    unit = tmp_path / "lpdl-peer.service"
    unit.write_text(text)
    proc = subprocess.run([_systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, timeout=60,
                          check=False)
    out = proc.stdout + proc.stderr
    # verify exits 0 on unknown keys and unparsable values (it only says "ignoring"): every such line counts
    bad = [line for line in out.splitlines()
           if "lpdl-peer.service" in line and re.search(r"Unknown|Failed|ignoring|not executable|Invalid", line)]
    return proc.returncode, bad, out


def test_unit_systemd_analyze_verify(tmp_path: Path) -> None:
    rc, bad, out = _verify_unit(UNIT.read_text(), tmp_path)
    assert rc == 0 and not bad, out


@pytest.mark.parametrize("edit", [("NoNewPrivileges=yes", "NoNewPrivilege=yes"),  # misspelt key
                                  ("Type=notify", "Type=notifyy"),                  # bad value
                                  ("ProtectSystem=strict", "ProtectSystem=strictest")],
                         ids=["typo-key", "bad-type", "bad-protect"])
def test_unit_systemd_analyze_catches_mistakes(tmp_path: Path, edit: tuple[str, str]) -> None:
    """The check above can fail: systemd-analyze and our filter flag a misspelt key and unparsable values."""
    old, new = edit
    text = UNIT.read_text()
    assert old in text
    rc, bad, out = _verify_unit(text.replace(old, new), tmp_path)
    assert rc != 0 or bad, f"{new!r} not flagged:\n{out}"


def test_unit_hardening_keys_known_to_this_systemd() -> None:
    """Every key is spelled as systemd spells it (a typo would be silently ignored by systemd)."""
    known = {
        "Unit": {"Description", "Documentation", "Wants", "After", "StartLimitIntervalSec", "StartLimitBurst"},
        "Install": {"WantedBy"},
    }
    for section, keys in known.items():
        assert set(_unit()[section]) <= keys, set(_unit()[section]) - keys
    for key in _unit()["Service"]:
        assert re.fullmatch(r"[A-Z][A-Za-z]+", key), key


# -- config examples -------------------------------------------------------------------------------------------
def test_toml_example_tables_and_keys_are_accepted() -> None:
    data = tomllib.loads(TOML_EXAMPLE.read_text())
    assert set(data) <= {*RUN_SECTIONS, "node", "net"}, set(data)
    for name, cls in RUN_SECTIONS.items():
        assert name in data, f"example lacks [{name}]"
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data[name]) - fields
        assert not unknown, f"[{name}] keys not in {cls.__name__}: {unknown}"


def test_toml_example_shows_the_real_defaults() -> None:
    """Every key the example sets equals the built-in default, unless its line says "changed" (issue 10: the
    example used to show gamma 0.5 and lr 0.1 as defaults)."""
    from peer.daemon.config import DAEMON_SECTIONS as classes

    data = tomllib.loads(TOML_EXAMPLE.read_text())
    changed = {line.split("=")[0].strip() for line in TOML_EXAMPLE.read_text().splitlines()
               if not line.lstrip().startswith("#") and "# changed" in line}
    for table, values in data.items():
        defaults = {f.name: f.default for f in dataclasses.fields(classes[table])}
        for key, value in values.items():
            if key in changed:
                continue
            default = list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key]
            assert value == default, f"[{table}] {key} = {value!r} but the default is {default!r}"


def test_toml_example_loads_through_the_config() -> None:
    from peer.daemon.config import load_daemon_config

    config = load_daemon_config(TOML_EXAMPLE, environ={})
    assert config.run.model.precision == "int8"
    assert config.node.fleet == "home-lab" and config.node.neighbors == ("auto",)


def test_env_example_lines() -> None:
    for line in ENV_EXAMPLE.read_text().splitlines():
        body = line.lstrip("#").strip()
        if "=" in body and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", body):
            key = body.split("=", 1)[0]
            assert key.startswith(("LPDL_", "OMP_")), key
        elif line.strip():
            assert line.startswith("#"), f"not a comment or VAR=value: {line!r}"
    # every LPDL_<SECTION>_<FIELD> named is one the config reads
    from peer.daemon.config import DAEMON_SECTIONS as sections

    process_switches = {"LPDL_LOWP_EAGER"}  # read by the process itself, not a config field
    for m in re.finditer(r"LPDL_([A-Z]+)_([A-Z_]+)=", ENV_EXAMPLE.read_text()):
        if m.group(0).rstrip("=") in process_switches:
            continue
        cls = sections[m.group(1).lower()]
        assert m.group(2).lower() in {f.name for f in dataclasses.fields(cls)}, m.group(0)


# -- scripts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_are_strict(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True, timeout=30)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111, f"{script} is not executable"


def test_netns_script_usage_without_root_effects() -> None:
    script = ROOT / "deploy" / "netns-testbed.sh"
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, check=True)
    for cmd in ("up N", "down", "exec I", "cut I J", "heal I J", "isolate I", "rejoin I", "loss I PCT", "cap I RATE",
                "uncap I", "fleet N", "stop"):
        assert cmd in out.stdout, cmd
    bad = subprocess.run(["bash", str(script), "frobnicate"], capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode != 0 and "unknown command" in bad.stderr


# -- compose ---------------------------------------------------------------------------------------------------
def _compose() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed (pip install pyyaml)")
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_structure() -> None:
    doc = _compose()
    assert "version" not in doc, "no version key: compose v2 warns, v1.27+ does not need it"
    services = doc["services"]
    peers = sorted(s for s in services if s.startswith("peer"))
    assert peers == ["peer0", "peer1", "peer2"]
    for i, name in enumerate(peers):
        svc = services[name]
        cmd = svc["command"]
        assert cmd[0] == "start"
        assert cmd[cmd.index("--neighbors") + 1] == "auto"
        assert cmd[cmd.index("--shard") + 1] == f"{i}/3"
        assert svc["networks"] == ["lpdl"]
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        volume, record = svc["volumes"]
        src, dst = volume.split(":")[:2]
        assert dst == "/var/lib/lpdl-peer" and src in doc["volumes"]
        # one int8 probe record for the host's containers, where the daemon looks for it
        assert record == "probe-record:/var/cache/lpdl-peer" and "probe-record" in doc["volumes"]
        assert (svc.get("environment") or {}).get("LPDL_CACHE_DIR") == "/var/cache/lpdl-peer"
    assert doc["networks"]["lpdl"]["driver"] == "bridge"
    assert len({services[p]["volumes"][0] for p in peers}) == 3, "one state volume per peer"
    # secured by default: a one-shot service issues every peer's certificate into its state volume first
    certs = services["certs"]
    script = certs["command"][0]
    assert "ca init" in script and "ca issue" in script and "--insecure" not in str(services)
    # the state volumes start empty and root-owned: the certs service hands them to the image's user
    assert str(certs.get("user")) == "0" and "chown -R lpdl:lpdl" in script
    assert "probe-record:/probe-record" in certs["volumes"] and "chown lpdl:lpdl /probe-record" in script
    assert all("user" not in services[p] for p in peers), "the peers run as the image's unprivileged user"
    for name in peers:
        assert services[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        volume = services[name]["volumes"][0].split(":")[0]
        assert f"{volume}:/peers/{name}" in certs["volumes"] and name in script


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (v1) not installed")
def test_compose_config_v1() -> None:
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_compose_config_v2() -> None:
    if shutil.which("docker") is None:
        pytest.skip("docker CLI not installed")
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip("compose v2 (docker compose) not available")
    proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


# -- Dockerfile ------------------------------------------------------------------------------------------------
def _dockerfile_lines() -> list[str]:
    """Instructions with their continuation lines joined, comments dropped."""
    out: list[str] = []
    joined = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        joined += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(joined)
            joined = ""
    return out


def test_dockerfile_contract() -> None:
    text = DOCKERFILE.read_text()
    lines = _dockerfile_lines()
    assert lines[0].startswith("ARG BASE_IMAGE="), "base image is a build argument"
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert froms[0] == "FROM ${BASE_IMAGE} AS system"
    assert froms[-1] == "FROM system", "the image is the system stage plus copies: no wheel layer in it"
    for arg in ("TORCH_SPEC", "TORCH_INDEX_URL", "PACKAGE_INDEX_URL", "OFFLINE", "EXTRAS", "MNIST_DATA", "SLIM",
                "UID"):
        assert any(ln.startswith(f"ARG {arg}") for ln in lines), arg
    final = lines[lines.index(froms[-1]):]
    users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    assert not any("COPY deploy/docker-extra/wheels" in ln for ln in final), "wheels only in a build stage"
    assert 'ENTRYPOINT ["lpdl-peer"]' in lines
    health = [ln for ln in lines if ln.startswith("HEALTHCHECK")]
    assert len(health) == 1 and "CMD lpdl-peer status --json" in health[0]
    # offline: no apt and no index when OFFLINE=1 (the tested route); the torch wheel check imports torch
    assert 'if [ "$OFFLINE" = 1 ]; then export PIP_NO_INDEX=1' in text
    assert "import torch" in final[final.index(next(ln for ln in final if ln.startswith("RUN ")))]
    # arm64-ready: no x86-only path (wheels are chosen by pip for the build's own platform); the one per-CPU choice
    # (torch's default requirement) is made at build time from `uname -m`, with a default for any other CPU
    for word in ("x86_64", "amd64", "manylinux", "cu1", "+cpu"):
        assert all(word not in ln for ln in lines), f"architecture-specific {word!r} in an instruction"
    for ln in lines:
        if "aarch64" in ln or "arm64" in ln:
            assert 'case "$(uname -m)" in' in ln and "*)" in ln, ln
    assert 'TORCH_SPEC="torch==2.9.1"' in text, "aarch64: the package index's CPU build setup.sh pins"
    # every COPY source exists in the build context (the repository root)
    for ln in lines:
        if ln.startswith("COPY ") and "--from=" not in ln:
            for src in ln.split()[1:-1]:
                if not src.startswith("--"):
                    assert list(ROOT.glob(src.rstrip("/"))) or "[" in src, f"COPY source {src} missing"
    # instructions the legacy builder (Docker 20.10 without BuildKit) understands
    for ln in lines:
        assert ln.split()[0] in {"ARG", "FROM", "ENV", "COPY", "RUN", "WORKDIR", "USER", "VOLUME", "EXPOSE",
                                 "STOPSIGNAL", "HEALTHCHECK", "ENTRYPOINT", "CMD", "LABEL"}, ln
        assert "--mount" not in ln, "RUN --mount needs BuildKit"


# -- no download host is named anywhere (issue 11): index URLs are build arguments ---------------------------
# Written as regular expressions, so this file does not match itself.
REGISTRY_HOSTS = [
    r"download\.pytorch\.org", r"\bpypi\.org", r"pypi\.python\.org", r"files\.pythonhosted\.org",
    r"\b(?:registry-1|index|hub|registry|auth)\.docker\.(?:io|com)", r"\bdocker\.io/", r"\bghcr\.io",
    r"\bquay\.io", r"\bgcr\.io", r"\bregistry\.k8s\.io", r"public\.ecr\.aws", r"\.dkr\.ecr\.",
    r"mcr\.microsoft\.com", r"\bnvcr\.io", r"registry\.gitlab\.com", r"\bdeb\.debian\.org",
    r"security\.debian\.org", r"(?:archive|ports|security)\.ubuntu\.com", r"conda\.anaconda\.org",
    r"repo\.anaconda\.com", r"registry\.npmjs\.org", r"\bpiwheels\.org",
]


def _repo_text_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), else a walk that skips the usual build outputs."""
    if shutil.which("git") and (ROOT / ".git").exists():
        proc = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard"], capture_output=True, timeout=60, check=False)
        if proc.returncode == 0:
            files = [ROOT / name for name in proc.stdout.decode().split("\0") if name]
            return [f for f in files if f.is_file()]
    skip = {".git", ".venv", "__pycache__", "build", "dist", "runs", ".pytest_cache", ".hypothesis"}
    return [f for f in ROOT.rglob("*") if f.is_file() and not skip & set(f.relative_to(ROOT).parts)]


def test_no_registry_host_names_in_the_repository() -> None:
    pattern = re.compile("|".join(REGISTRY_HOSTS), re.IGNORECASE)
    files = _repo_text_files()
    assert any(f.name == "Dockerfile" for f in files) and any(f.suffix == ".md" for f in files)
    hits = []
    for f in files:
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "download hosts named (make them build arguments / settings):\n" + "\n".join(hits)


def test_registry_host_check_would_catch_a_url(tmp_path: Path) -> None:
    """The patterns above match what they are meant to (a check that cannot fail checks nothing)."""
    pattern = re.compile("|".join(REGISTRY_HOSTS), re.IGNORECASE)
    host = "download" + ".pytorch.org"
    for line in (f"ARG TORCH_INDEX_URL=https://{host}/whl/cpu", "--extra-index-url https://pypi" + ".org/simple",
                 "FROM docker" + ".io/library/python:3.11-slim", "image: ghcr" + ".io/owner/lpdl-peer:1",
                 "MIRROR=http://deb" + ".debian.org/debian"):
        assert pattern.search(line), line
    for line in ("apt-get install -y docker.io docker-compose", "BASE_IMAGE=python:3.11-slim",
                 "the PyTorch CPU wheel index", "PyPI serves CUDA builds"):
        assert not pattern.search(line), line


def test_deploy_files_name_no_url_at_all() -> None:
    """The Dockerfile and the compose file take every location as a build argument or variable."""
    for f in (DOCKERFILE, COMPOSE):
        assert "://" not in f.read_text(), f"{f.name} names a URL"


# -- suite order: docker-marked tests after everything else (tests/conftest.py) ------------------------------
def test_docker_marked_tests_are_collected_last() -> None:
    """Collected in the real suite's configuration with the docker test selected (the default run deselects it;
    `-m slow` or `-m docker` selects it), the compose test comes after the namespace tests even when named first
    on the command line."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "slow or netns or not slow",
                           "tests/test_compose_fleet.py", "tests/test_daemon_netns.py", "tests/test_deploy_files.py"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert proc.returncode == 0 and ids, proc.stdout + proc.stderr
    docker = [i for i, n in enumerate(ids) if n.startswith("tests/test_compose_fleet.py")]
    others = [i for i, n in enumerate(ids) if not n.startswith("tests/test_compose_fleet.py")]
    assert docker and any(ids[i].startswith("tests/test_daemon_netns.py") for i in others)
    assert min(docker) > max(others), ids


def test_docker_last_keeps_each_group_in_order() -> None:
    from tests.conftest import docker_last

    class Item:
        def __init__(self, name: str, docker: bool) -> None:
            self.name, self.docker = name, docker

        def get_closest_marker(self, name: str) -> object | None:
            return object() if name == "docker" and self.docker else None

    items = [Item("a", True), Item("b", False), Item("c", True), Item("d", False)]
    assert [i.name for i in docker_last(items)] == ["b", "d", "a", "c"]  # type: ignore[arg-type]


def test_the_default_run_deselects_the_docker_test_and_says_so() -> None:
    """`pytest -q` (the README's test command, run serially) leaves the compose test out, counted as deselected."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_compose_fleet.py"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          check=False)
    assert "::" not in proc.stdout and "deselected" in proc.stdout, proc.stdout + proc.stderr


def test_the_parallel_default_run_counts_the_deselected_docker_test_too() -> None:
    """The README's command runs the suite on two workers (``-n 2``), whose controller collects nothing: its summary
    line still counts the compose test as deselected (tests/conftest.py passes the workers' count on)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           "tests/test_compose_fleet.py", "tests/test_errors.py"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\d+ passed, 1 deselected", proc.stdout), proc.stdout + proc.stderr
