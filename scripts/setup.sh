#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with torch, the project and its test/demo extras.
# Usage: scripts/setup.sh            (everything the tests and the demo need)
#        LPDL_EXTRAS=demo scripts/setup.sh   (daemon + bundled demo data only)
#        LPDL_PREPARE=1 scripts/setup.sh     (also compile the default config's int8 pass graphs for this host:
#                                             a few minutes once, and the first fleet runs them compiled)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${LPDL_EXTRAS:-test}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)

# torch: pin the builds known to work beside torchvision on each platform (docs/design.md#dependencies-and-platforms).
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  case "$(uname -m)" in
    x86_64) "${PIP[@]}" torch==2.14.1 torchvision==0.29.1 ;;
    aarch64) "${PIP[@]}" torch==2.9.1 torchvision==0.24.1 ;;
    *) "${PIP[@]}" torch torchvision ;;
  esac
fi
"${PIP[@]}" -e ".[${EXTRAS}]"

# Network-namespace tests need iproute2 and nftables (root only; they skip with a reason otherwise).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v nft >/dev/null; then
  (apt-get install -y -q nftables iptables iproute2 >/dev/null 2>&1 ||
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nftables iptables iproute2 >/dev/null 2>&1)) ||
    echo "setup: could not install nftables/iproute2; namespace tests will be skipped" >&2
fi
# The daemon runs on tcmalloc where installed (peer/daemon/allocator.py; far less RSS growth than glibc's malloc).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 ||
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1)) ||
    echo "setup: could not install libtcmalloc-minimal4; the daemon will run on glibc's malloc" >&2
fi
# The unit test runs `systemd-analyze verify` (package systemd; root only, skipped with the reason otherwise).
# Docker, docker-compose and debootstrap for the compose test are installed by that test itself
# (deploy/docker-offline.sh install), so setup stays fast for every other run.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v systemd-analyze >/dev/null; then
  (apt-get install -y -q --no-install-recommends systemd >/dev/null 2>&1 ||
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends systemd >/dev/null 2>&1)) ||
    echo "setup: could not install systemd (systemd-analyze); the unit verify test will be skipped" >&2
fi
if [ "${LPDL_PREPARE:-0}" = 1 ]; then
  .venv/bin/lpdl-peer prepare ||
    echo "setup: lpdl-peer prepare failed (above); daemons run the passes it could not compile eagerly" >&2
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
