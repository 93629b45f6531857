#!/usr/bin/env bash
# The aarch64 (Raspberry Pi / Jetson CPU) check of the 8-bit mode, on an x86_64 Debian host, as root:
#   1. an arm64 Debian root built with debootstrap, run under qemu-user-static (binfmt_misc when the kernel has it,
#      else the first stage only and a note);
#   2. the project installed in it by scripts/setup.sh (its aarch64 torch pins);
#   3. the int8 probe (which product kernels exist and are exact there, which quantization-pass path is used) and
#      the lowp unit tests, run inside.
# Timing under emulation means nothing; exactness, which kernels exist, and that the install works, do.
#
#   deploy/aarch64-emulation.sh                 # ROOT=/var/tmp/lpdl-arm64, MIRROR=<Debian mirror URL> [the first
#                                               #   Debian archive in this host's apt sources: debian-mirror.sh]
#   STEP=probe deploy/aarch64-emulation.sh      # re-run one step: root | install | probe | tests
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${ROOT:-/var/tmp/lpdl-arm64}
MIRROR=${MIRROR:-$("$REPO/deploy/debian-mirror.sh")}
SUITE=${SUITE:-bookworm}  # Python 3.11, as the project targets
STEP=${STEP:-all}
log() { echo "[aarch64 $(date +%T)] $*" >&2; }

need_root() { [ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, binfmt_misc, chroot)" >&2; exit 2; }; }

binfmt() {
  # qemu-user-static registers qemu-aarch64 with the F flag (interpreter opened at registration), so a chroot
  # without qemu inside still runs arm64 binaries. binfmt_misc must be mountable: no kernel modules here, built in.
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  fi
  if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64 2>/dev/null || update-binfmts --import qemu-aarch64
  fi
  grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64
}

in_root() {  # run a command in the arm64 root with /proc, /sys and /dev mounted (unmounted on exit)
  for fs in proc sys dev; do mountpoint -q "$ROOT/$fs" || mount --bind "/$fs" "$ROOT/$fs"; done
  trap 'for fs in dev sys proc; do umount -l "$ROOT/$fs" 2>/dev/null || true; done' RETURN
  chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DEFAULT_TIMEOUT=180 LPDL_EXTRAS="${LPDL_EXTRAS:-test}" \
    bash -c "$1"
}

make_root() {
  apt-get install -y -q --no-install-recommends debootstrap qemu-user-static binfmt-support >/dev/null
  binfmt
  if [ ! -e "$ROOT/.lpdl-root-ready" ]; then
    if [ ! -d "$ROOT/debootstrap" ]; then  # first stage: download and unpack (host speed)
      log "debootstrap (first stage) arm64 $SUITE into $ROOT"
      debootstrap --foreign --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates,git \
        "$SUITE" "$ROOT" "$MIRROR"
    fi
    log "debootstrap second stage (arm64 dpkg under qemu)"
    chroot "$ROOT" /debootstrap/debootstrap --second-stage
    touch "$ROOT/.lpdl-root-ready"
  fi
  # outbound HTTPS may be re-signed by a proxy: trust what the host trusts
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  in_root 'uname -m; python3 --version'
}

install_project() {
  log "copy the committed tree to $ROOT/opt/lpdl-peer and run scripts/setup.sh there"
  mkdir -p "$ROOT/opt/lpdl-peer"  # a fresh copy of the tree; the installed .venv (torch: minutes to reinstall) stays
  find "$ROOT/opt/lpdl-peer" -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
  git -C "$REPO" archive HEAD | tar -x -C "$ROOT/opt/lpdl-peer"
  in_root 'cd /opt/lpdl-peer && scripts/setup.sh'
}

probe() {
  log "int8 probe inside (kernels available and exact per op kind; fused-pass path)"
  in_root 'cd /opt/lpdl-peer && .venv/bin/python - <<"EOF"
import json, platform, torch
from peer.lowp import PrecisionConfig, resolve_precision
torch.set_num_threads(1)
r = resolve_precision(PrecisionConfig("int8"), torch.device("cpu"))
d = r.describe()
print(platform.machine(), "torch", torch.__version__, "capability", torch.backends.cpu.get_cpu_capability())
print("mode", d["mode"], "backend", d["backend"], "quantizers", d.get("quantizers"))
print("unavailable kernels", json.dumps(d.get("kernels_unavailable")))
for op, detail in d.get("kernels", {}).items():
    for shape in detail["shapes"]:
        print(op, shape["case"], "chosen", shape["kernel"], "admitted", sorted(shape["timings_ms"]),
              "rejected", json.dumps(shape["rejected"]))
EOF'
}

tests() {
  log "lowp unit tests inside (fast ones)"
  in_root 'cd /opt/lpdl-peer && LPDL_LOWP_EAGER=${LPDL_LOWP_EAGER:-} .venv/bin/python -m pytest -q -m "not slow" \
    -p no:cacheprovider tests/test_lowp_kernels.py tests/test_lowp_passes.py tests/test_lowp_precision.py \
    tests/test_lowp_layers.py tests/test_lowp_memory.py tests/test_lowp_compiler_env.py tests/test_lowp_eager.py'
}

need_root
case "$STEP" in
  root) make_root ;;
  install) install_project ;;
  probe) probe ;;
  tests) tests ;;
  all) make_root; install_project; probe; tests ;;
  *) echo "STEP must be root, install, probe, tests or all" >&2; exit 2 ;;
esac
