#!/usr/bin/env bash
# netns-testbed.sh - an N-host LAN built from Linux network namespaces, for running an lpdl-peer fleet on one box.
#
#   namespace  <P>-br        holds bridge br0 and one veth per host (v0, v1, ...)
#   namespaces <P>-h0..hN-1  each with lo up and eth0 = <SUBNET>.(i+1)/24, multicast on (mDNS works across hosts)
#
# Everything lives inside namespaces this script creates: nothing is added to the root namespace's interfaces,
# routes or firewall, and the subnet is reachable only from inside the testbed.
#
# Usage: deploy/netns-testbed.sh COMMAND [ARGS]
#   up N                 build N hosts (idempotent; a different N rebuilds)
#   down                 stop the fleet, delete every namespace of this testbed (always safe to run)
#   status               namespaces, addresses, cuts, loss, caps, fleet processes
#   exec I CMD...        run CMD inside host I (ip netns exec)
#   ip I                 print host I's address
#   cut I J [--one-way]  drop traffic between host I and host J (nft rules inside host I; default both directions:
#                        I->J on output and J->I on input; --one-way drops only I->J)
#   heal I J             undo cut I J
#   isolate I            take host I off the LAN: every packet in or out of its eth0 dropped, mDNS included (an nft
#                        table of its own inside host I; the interface stays up)
#   rejoin I             undo isolate I
#   loss I PCT           drop PCT% of host I's outgoing packets at random (nft numgen); PCT 0 removes it
#   cap I RATE [BURST]   cap host I's egress bandwidth with tc tbf (RATE like 8mbit, 500kbit); replaces a cap
#   uncap I              remove the cap
#   fleet N [ARGS...]    up N, then start one `lpdl-peer start` per host with --neighbors auto, --shard i/N,
#                        its own --listen/--mdns-ip/--state-dir; ARGS are passed to every peer
#   stop [TIMEOUT]       SIGTERM the fleet (peers finish their round, checkpoint, say goodbye), SIGKILL after
#                        TIMEOUT seconds (default 30)
#   forward-check        explain whether dockerd's iptables FORWARD DROP policy can affect this testbed
#
# Environment:
#   LPNS_PREFIX   name prefix of the namespaces (default lp: lp-br, lp-h0, ...)
#   LPNS_SUBNET   first three octets of the private /24 (default 10.213.0)
#   LPNS_DIR      run directory: logs, pids, peer state (default /run/lpdl-netns/<prefix>)
#   LPDL_BIN      the lpdl-peer executable (default: lpdl-peer on PATH, else <repo>/.venv/bin/lpdl-peer)
#   LPDL_PORT     peer listen port (default 7070); LPDL_FLEET fleet name (default netns-<prefix>)
#   LPNS_INSECURE 1 = start the fleet with --insecure; default: mutual TLS with a CA in RUN_DIR/ca, each host's
#                 certificate (peer id <fleet>-h<i>) in its state dir, an operator certificate in RUN_DIR/operator
#   LPDL_METRICS_PORT  Prometheus port per peer (default 0 = off; each host has its own address so one port works)
#
# Needs root, iproute2 (ip, tc) and nftables (nft): apt-get install -y iproute2 nftables
set -euo pipefail

PREFIX="${LPNS_PREFIX:-lp}"
SUBNET="${LPNS_SUBNET:-10.213.0}"
RUN_DIR="${LPNS_DIR:-/run/lpdl-netns/${PREFIX}}"
BR_NS="${PREFIX}-br"
PORT="${LPDL_PORT:-7070}"
FLEET="${LPDL_FLEET:-netns-${PREFIX}}"
METRICS_PORT="${LPDL_METRICS_PORT:-0}"
CHAOS_TABLE="lpchaos"
ISOLATE_TABLE="lpiso"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"

die() { echo "netns-testbed: error: $*" >&2; exit 1; }
say() { echo "netns-testbed: $*" >&2; }

host_ns() { echo "${PREFIX}-h$1"; }
host_ip() { echo "${SUBNET}.$(( $1 + 1 ))"; }

need_root() { [[ ${EUID} -eq 0 ]] || die "needs root (network namespaces, nft, tc); re-run with sudo"; }
need_cmd() {
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || die "'$c' not found; install it: apt-get install -y iproute2 nftables"
    done
}

validate() {
    [[ "${PREFIX}" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "LPNS_PREFIX must be 1-8 lowercase letters/digits, got '${PREFIX}'"
    [[ "${SUBNET}" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "LPNS_SUBNET must look like 10.213.0, got '${SUBNET}'"
}

ns_exists() { [[ -e "/var/run/netns/$1" ]] || ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -- "$1"; }

# Number of hosts currently built (0 if none).
current_n() {
    local n=0
    while ns_exists "$(host_ns "$n")"; do n=$((n + 1)); done
    echo "$n"
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

check_host() {
    is_uint "$1" || die "host index must be a number, got '$1'"
    ns_exists "$(host_ns "$1")" || die "host $1 does not exist (testbed '${PREFIX}' has $(current_n) hosts; run: $0 up N)"
}

# ---------------------------------------------------------------------------------------------------------------
# dockerd caveat: Docker sets the iptables FORWARD policy to DROP, and with br_netfilter (bridge-nf-call-iptables=1)
# bridged frames pass through iptables. The bridge of this testbed lives in its own namespace, where we switch
# bridge-nf-call-* off (the sysctl is per namespace on current kernels) and, where iptables exists, also add an
# explicit ACCEPT for br0 -> br0. If frames still die, the root namespace's rules are in the path: see forward-check.
# ---------------------------------------------------------------------------------------------------------------
root_forward_policy() {
    command -v iptables >/dev/null 2>&1 || { echo unknown; return; }
    iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" {print $3; exit}' || echo unknown
}

protect_bridge_from_br_netfilter() {
    local f
    for f in bridge-nf-call-iptables bridge-nf-call-ip6tables bridge-nf-call-arptables; do
        if ip netns exec "${BR_NS}" test -w "/proc/sys/net/bridge/$f" 2>/dev/null; then
            ip netns exec "${BR_NS}" sh -c "echo 0 > /proc/sys/net/bridge/$f" 2>/dev/null || true
        fi
    done
    if command -v iptables >/dev/null 2>&1; then
        ip netns exec "${BR_NS}" iptables -C FORWARD -i br0 -o br0 -j ACCEPT 2>/dev/null \
            || ip netns exec "${BR_NS}" iptables -I FORWARD -i br0 -o br0 -j ACCEPT 2>/dev/null || true
    fi
}

forward_check() {
    local pol; pol="$(root_forward_policy)"
    if [[ "${pol}" == "DROP" ]]; then
        cat >&2 <<EOF
netns-testbed: the root namespace's iptables FORWARD policy is DROP (dockerd sets it while it runs).
  This testbed's bridge lives in namespace ${BR_NS}, where bridge-nf-call-iptables is switched off and br0->br0 is
  accepted, so it is normally unaffected. If hosts still cannot reach each other (see 'up' self-test):
    - stop dockerd (by its pid) and restore the policy:   iptables -P FORWARD ACCEPT
    - or accept bridged testbed traffic explicitly:       iptables -I FORWARD -i br0 -o br0 -j ACCEPT
      (and undo it later with: iptables -D FORWARD -i br0 -o br0 -j ACCEPT)
EOF
    else
        say "root iptables FORWARD policy: ${pol} (no dockerd interference expected)"
    fi
}

# Bounded TCP self-test: host 0 -> every other host on a throwaway port. Needs python3; skipped without it.
selftest() {
    local n="$1" i py
    [[ "$n" -ge 2 ]] || return 0
    py="$(command -v python3 || true)"
    [[ -n "${py}" ]] || { say "python3 not found: skipping the connectivity self-test"; return 0; }
    for ((i = 1; i < n; i++)); do
        ip netns exec "$(host_ns "$i")" timeout 5 "${py}" -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7999)); s.listen(1); s.settimeout(4)
c, _ = s.accept(); c.sendall(b"ok"); c.close()' "$(host_ip "$i")" &
        local srv=$!
        if ! ip netns exec "$(host_ns 0)" timeout 5 "${py}" -c '
import socket, sys, time
deadline = time.monotonic() + 4
while True:
    try:
        c = socket.create_connection((sys.argv[1], 7999), timeout=1); break
    except OSError:
        if time.monotonic() > deadline: sys.exit(1)
        time.sleep(0.05)
c.settimeout(2); sys.exit(0 if c.recv(2) == b"ok" else 1)' "$(host_ip "$i")"; then
            kill "${srv}" 2>/dev/null || true; wait "${srv}" 2>/dev/null || true
            forward_check
            die "self-test failed: host 0 cannot reach host $i ($(host_ip "$i")); run '$0 down' to clean up"
        fi
        wait "${srv}" 2>/dev/null || true
    done
    say "self-test ok: host 0 reaches hosts 1..$((n - 1)) over TCP"
}

# ---------------------------------------------------------------------------------------------------------------
cmd_up() {
    local n="${1:-}"
    is_uint "$n" && [[ "$n" -ge 1 && "$n" -le 250 ]] || die "usage: $0 up N   (1 <= N <= 250)"
    need_root; need_cmd ip
    local cur; cur="$(current_n)"
    if ns_exists "${BR_NS}" && [[ "${cur}" -eq "$n" ]] && ! ns_exists "$(host_ns "$n")"; then
        say "testbed '${PREFIX}' already up with $n hosts"
        return 0
    fi
    if ns_exists "${BR_NS}" || [[ "${cur}" -gt 0 ]]; then
        say "testbed '${PREFIX}' exists with ${cur} hosts: rebuilding with $n"
        cmd_down
    fi
    trap 'say "up failed; cleaning up"; cmd_down >/dev/null 2>&1 || true' ERR
    ip netns add "${BR_NS}"
    ip -n "${BR_NS}" link set lo up
    ip -n "${BR_NS}" link add br0 type bridge
    protect_bridge_from_br_netfilter
    ip -n "${BR_NS}" link set br0 up
    local i ns
    for ((i = 0; i < n; i++)); do
        ns="$(host_ns "$i")"
        ip netns add "${ns}"
        ip -n "${BR_NS}" link add "v$i" type veth peer name eth0 netns "${ns}"
        ip -n "${BR_NS}" link set "v$i" master br0
        ip -n "${BR_NS}" link set "v$i" up
        ip -n "${ns}" link set lo up
        ip -n "${ns}" addr add "$(host_ip "$i")/24" dev eth0
        ip -n "${ns}" link set eth0 up multicast on
    done
    trap - ERR
    mkdir -p "${RUN_DIR}"
    echo "$n" > "${RUN_DIR}/hosts"
    say "up: $n hosts ${PREFIX}-h0..${PREFIX}-h$((n - 1)) on ${SUBNET}.0/24 (bridge ${BR_NS}/br0)"
    [[ "$(root_forward_policy)" == "DROP" ]] && forward_check
    selftest "$n"
}

cmd_down() {
    need_root; need_cmd ip
    cmd_stop 10 >/dev/null 2>&1 || true
    local ns pid found=0
    # every namespace of this testbed, including hosts left over from a larger N
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(br|h[0-9]+)$" || true); do
        found=1
        # processes still inside (a peer started by hand with 'exec'): they would outlive the namespace
        for pid in $(ip netns pids "${ns}" 2>/dev/null || true); do kill -TERM "${pid}" 2>/dev/null || true; done
    done
    if [[ "${found}" -eq 1 ]]; then
        sleep 0.2
        for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(br|h[0-9]+)$" || true); do
            for pid in $(ip netns pids "${ns}" 2>/dev/null || true); do kill -KILL "${pid}" 2>/dev/null || true; done
            ip netns del "${ns}" 2>/dev/null || say "could not delete namespace ${ns}"
        done
    fi
    rm -f "${RUN_DIR}/hosts" "${RUN_DIR}/pids"
    say "down: testbed '${PREFIX}' removed (logs and state kept in ${RUN_DIR})"
}

cmd_status() {
    local n i ns; n="$(current_n)"
    if [[ "$n" -eq 0 ]] && ! ns_exists "${BR_NS}"; then echo "testbed '${PREFIX}': down"; return 0; fi
    echo "testbed '${PREFIX}': ${n} hosts on ${SUBNET}.0/24, run dir ${RUN_DIR}"
    for ((i = 0; i < n; i++)); do
        ns="$(host_ns "$i")"
        local cuts loss qd iso
        cuts="$(ip netns exec "${ns}" nft list set inet "${CHAOS_TABLE}" cut_out 2>/dev/null \
                | sed -n 's/.*elements = { \(.*\) }.*/\1/p' || true)"
        loss="$(ip netns exec "${ns}" nft list chain inet "${CHAOS_TABLE}" loss 2>/dev/null \
                | grep -o 'numgen random mod 100 < [0-9]*\|/24 drop' | awk '{print ($1 == "/24") ? "100%" : $NF "%"}' || true)"
        qd="$(tc -n "${ns}" qdisc show dev eth0 2>/dev/null | grep -o 'tbf.*rate [^ ]*' | awk '{print $NF}' || true)"
        iso=no; ip netns exec "${ns}" nft list table inet "${ISOLATE_TABLE}" >/dev/null 2>&1 && iso=yes
        printf '  h%-3s %-15s cut_out=[%s] loss=%s cap=%s isolated=%s\n' "$i" "$(host_ip "$i")" "${cuts}" \
            "${loss:-0%}" "${qd:-none}" "${iso}"
    done
    if [[ -f "${RUN_DIR}/pids" ]]; then
        local idx pid
        while read -r idx pid; do
            if kill -0 "${pid}" 2>/dev/null; then state=running; else state=exited; fi
            echo "  peer h${idx}: pid ${pid} ${state}  log ${RUN_DIR}/logs/h${idx}.log"
        done < "${RUN_DIR}/pids"
    fi
}

cmd_exec() {
    [[ $# -ge 2 ]] || die "usage: $0 exec I CMD..."
    need_root; check_host "$1"
    local ns; ns="$(host_ns "$1")"; shift
    exec ip netns exec "${ns}" "$@"
}

# The chaos table inside a host: named sets for cuts, a chain for random loss.
ensure_chaos() {
    local ns="$1"
    ip netns exec "${ns}" nft -f - <<EOF
table inet ${CHAOS_TABLE} {
    set cut_out { type ipv4_addr; }
    set cut_in { type ipv4_addr; }
    chain loss { }
    chain out { type filter hook output priority 0; policy accept; }
    chain in { type filter hook input priority 0; policy accept; }
}
EOF
    # the rules are added once (a table definition with rules would duplicate them on every call)
    if ! ip netns exec "${ns}" nft list chain inet "${CHAOS_TABLE}" out | grep -q '@cut_out'; then
        ip netns exec "${ns}" nft add rule inet "${CHAOS_TABLE}" out ip daddr @cut_out drop
        ip netns exec "${ns}" nft add rule inet "${CHAOS_TABLE}" out jump loss
        ip netns exec "${ns}" nft add rule inet "${CHAOS_TABLE}" in ip saddr @cut_in drop
    fi
}

cmd_cut() {
    local i="${1:-}" j="${2:-}" mode="${3:-}"
    [[ -n "$i" && -n "$j" ]] || die "usage: $0 cut I J [--one-way]"
    [[ -z "${mode}" || "${mode}" == "--one-way" ]] || die "unknown option '${mode}' (expected --one-way)"
    need_root; need_cmd nft; check_host "$i"; check_host "$j"
    [[ "$i" != "$j" ]] || die "cut: I and J must differ"
    local ns; ns="$(host_ns "$i")"
    ensure_chaos "${ns}"
    ip netns exec "${ns}" nft add element inet "${CHAOS_TABLE}" cut_out "{ $(host_ip "$j") }"
    if [[ "${mode}" != "--one-way" ]]; then
        ip netns exec "${ns}" nft add element inet "${CHAOS_TABLE}" cut_in "{ $(host_ip "$j") }"
        say "cut: h$i <-> h$j ($(host_ip "$i") <-> $(host_ip "$j")) dropped inside h$i"
    else
        say "cut: h$i -> h$j dropped (one way)"
    fi
}

cmd_heal() {
    local i="${1:-}" j="${2:-}"
    [[ -n "$i" && -n "$j" ]] || die "usage: $0 heal I J"
    need_root; need_cmd nft; check_host "$i"; check_host "$j"
    local ns set; ns="$(host_ns "$i")"
    ensure_chaos "${ns}"
    for set in cut_out cut_in; do
        if ip netns exec "${ns}" nft get element inet "${CHAOS_TABLE}" "${set}" "{ $(host_ip "$j") }" >/dev/null 2>&1; then
            ip netns exec "${ns}" nft delete element inet "${CHAOS_TABLE}" "${set}" "{ $(host_ip "$j") }"
        fi
    done
    say "heal: h$i <-> h$j restored"
}

cmd_isolate() {
    local i="${1:-}"
    [[ -n "$i" ]] || die "usage: $0 isolate I"
    need_root; need_cmd nft; check_host "$i"
    ip netns exec "$(host_ns "$i")" nft -f - <<EOF
table inet ${ISOLATE_TABLE} {
    chain out { type filter hook output priority -10; policy accept; oifname "eth0" drop; }
    chain in { type filter hook input priority -10; policy accept; iifname "eth0" drop; }
}
EOF
    say "isolate: h$i off the LAN (every eth0 packet dropped)"
}

cmd_rejoin() {
    local i="${1:-}"
    [[ -n "$i" ]] || die "usage: $0 rejoin I"
    need_root; need_cmd nft; check_host "$i"
    ip netns exec "$(host_ns "$i")" nft delete table inet "${ISOLATE_TABLE}" 2>/dev/null || true
    say "rejoin: h$i back on the LAN"
}

cmd_loss() {
    local i="${1:-}" pct="${2:-}"
    [[ -n "$i" ]] && is_uint "${pct}" && [[ "${pct}" -le 100 ]] || die "usage: $0 loss I PCT   (0 <= PCT <= 100)"
    need_root; need_cmd nft; check_host "$i"
    local ns; ns="$(host_ns "$i")"
    ensure_chaos "${ns}"
    ip netns exec "${ns}" nft flush chain inet "${CHAOS_TABLE}" loss
    if [[ "${pct}" -ge 100 ]]; then
        ip netns exec "${ns}" nft add rule inet "${CHAOS_TABLE}" loss ip daddr "${SUBNET}.0/24" drop
    elif [[ "${pct}" -gt 0 ]]; then
        ip netns exec "${ns}" nft add rule inet "${CHAOS_TABLE}" loss ip daddr "${SUBNET}.0/24" \
            numgen random mod 100 "<" "${pct}" drop
    fi
    say "loss: h$i drops ${pct}% of its outgoing testbed packets"
}

# tbf needs a burst of at least rate/HZ; use max(4 KiB, 10 ms worth of rate).
burst_for() {
    local rate="$1" num unit bits
    [[ "${rate}" =~ ^([0-9]+)([kmg]?)(bit|bps)$ ]] || die "rate must look like 8mbit, 500kbit, 1gbit (got '${rate}')"
    num="${BASH_REMATCH[1]}"; unit="${BASH_REMATCH[2]}"
    case "${unit}" in k) bits=$((num * 1000));; m) bits=$((num * 1000000));; g) bits=$((num * 1000000000));; *) bits=${num};; esac
    [[ "${BASH_REMATCH[3]}" == "bps" ]] && bits=$((bits * 8))
    local b=$((bits / 8 / 100))
    [[ "$b" -lt 4096 ]] && b=4096
    echo "${b}b"
}

cmd_cap() {
    local i="${1:-}" rate="${2:-}" burst="${3:-}"
    [[ -n "$i" && -n "${rate}" ]] || die "usage: $0 cap I RATE [BURST]   e.g. cap 0 8mbit"
    need_root; need_cmd tc; check_host "$i"
    [[ -n "${burst}" ]] || burst="$(burst_for "${rate}")"
    tc -n "$(host_ns "$i")" qdisc replace dev eth0 root tbf rate "${rate}" burst "${burst}" latency 50ms
    say "cap: h$i egress limited to ${rate} (tbf burst ${burst})"
}

cmd_uncap() {
    local i="${1:-}"
    [[ -n "$i" ]] || die "usage: $0 uncap I"
    need_root; need_cmd tc; check_host "$i"
    if tc -n "$(host_ns "$i")" qdisc show dev eth0 | grep -q '^qdisc tbf'; then
        tc -n "$(host_ns "$i")" qdisc del dev eth0 root
    fi
    say "uncap: h$i unlimited"
}

find_bin() {
    if [[ -n "${LPDL_BIN:-}" ]]; then echo "${LPDL_BIN}"; return; fi
    if command -v lpdl-peer >/dev/null 2>&1; then command -v lpdl-peer; return; fi
    if [[ -x "${REPO_DIR}/.venv/bin/lpdl-peer" ]]; then echo "${REPO_DIR}/.venv/bin/lpdl-peer"; return; fi
    die "lpdl-peer not found: pip install the project, or set LPDL_BIN=/path/to/lpdl-peer"
}

cmd_fleet() {
    local n="${1:-}"
    is_uint "$n" && [[ "$n" -ge 1 ]] || die "usage: $0 fleet N [lpdl-peer start args...]"
    shift
    need_root
    local bin; bin="$(find_bin)"
    if [[ -f "${RUN_DIR}/pids" ]]; then
        local idx pid alive=0
        while read -r idx pid; do kill -0 "${pid}" 2>/dev/null && alive=1; done < "${RUN_DIR}/pids"
        [[ "${alive}" -eq 0 ]] || die "a fleet is already running (see '$0 status'); '$0 stop' first"
    fi
    cmd_up "$n"
    mkdir -p "${RUN_DIR}/logs" "${RUN_DIR}/state"
    : > "${RUN_DIR}/pids"
    local i ip security=()
    if [[ "${LPNS_INSECURE:-0}" == 1 ]]; then
        security=(--insecure)
    else
        [[ -f "${RUN_DIR}/ca/ca.pem" ]] || "${bin}" ca init --ca-dir "${RUN_DIR}/ca" --fleet "${FLEET}" >/dev/null
        [[ -f "${RUN_DIR}/operator/cert.pem" ]] || "${bin}" ca issue --ca-dir "${RUN_DIR}/ca" --name operator \
            --operator --out "${RUN_DIR}/operator" >/dev/null
    fi
    for ((i = 0; i < n; i++)); do
        ip="$(host_ip "$i")"
        mkdir -p "${RUN_DIR}/state/h$i"
        if [[ "${#security[@]}" -eq 0 && ! -f "${RUN_DIR}/state/h$i/tls/cert.pem" ]]; then
            "${bin}" ca issue --ca-dir "${RUN_DIR}/ca" --name "${FLEET}-h$i" --out "${RUN_DIR}/state/h$i/tls" >/dev/null
        fi
        # setsid: the peer leaves our process group, so a Ctrl-C here does not kill the fleet; 'stop' does.
        ip netns exec "$(host_ns "$i")" setsid "${bin}" start \
            --listen "${ip}:${PORT}" --neighbors auto --fleet "${FLEET}" \
            --state-dir "${RUN_DIR}/state/h$i" --shard "$i/$n" \
            --mdns-ip "${ip}" --metrics-port "${METRICS_PORT}" "${security[@]}" \
            "$@" </dev/null >"${RUN_DIR}/logs/h$i.log" 2>&1 &
        echo "$i $!" >> "${RUN_DIR}/pids"
        say "peer h$i: pid $! listening on ${ip}:${PORT}, log ${RUN_DIR}/logs/h$i.log"
    done
    sleep 1
    local idx pid dead=0
    while read -r idx pid; do
        if ! kill -0 "${pid}" 2>/dev/null; then
            dead=1; say "peer h${idx} exited at once; last lines of its log:"; tail -n 20 "${RUN_DIR}/logs/h${idx}.log" >&2 || true
        fi
    done < "${RUN_DIR}/pids"
    [[ "${dead}" -eq 0 ]] || die "some peers failed to start ('$0 stop' / '$0 down' to clean up)"
    say "fleet of $n peers started (fleet '${FLEET}'); '$0 status', '$0 stop', '$0 down'"
}

cmd_stop() {
    local timeout="${1:-30}"
    is_uint "${timeout}" || die "usage: $0 stop [TIMEOUT_SECONDS]"
    [[ -f "${RUN_DIR}/pids" ]] || { say "stop: no fleet recorded"; return 0; }
    local idx pid pids=()
    while read -r idx pid; do
        if kill -0 "${pid}" 2>/dev/null; then kill -TERM "${pid}" 2>/dev/null || true; pids+=("${pid}"); fi
    done < "${RUN_DIR}/pids"
    local deadline=$((SECONDS + timeout)) left
    while :; do
        left=0
        for pid in "${pids[@]}"; do kill -0 "${pid}" 2>/dev/null && left=$((left + 1)); done
        [[ "${left}" -eq 0 || ${SECONDS} -ge ${deadline} ]] && break
        sleep 0.2
    done
    for pid in "${pids[@]}"; do
        if kill -0 "${pid}" 2>/dev/null; then say "pid ${pid} ignored SIGTERM for ${timeout}s: SIGKILL"; kill -KILL "${pid}" 2>/dev/null || true; fi
    done
    rm -f "${RUN_DIR}/pids"
    say "stop: fleet stopped (${#pids[@]} peers signalled)"
}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

main() {
    validate
    local cmd="${1:-}"; [[ $# -gt 0 ]] && shift
    case "${cmd}" in
        up) cmd_up "$@" ;;
        down) cmd_down ;;
        status) cmd_status ;;
        exec) cmd_exec "$@" ;;
        ip) check_host "${1:-x}"; host_ip "$1" ;;
        cut) cmd_cut "$@" ;;
        heal) cmd_heal "$@" ;;
        isolate) cmd_isolate "$@" ;;
        rejoin) cmd_rejoin "$@" ;;
        loss) cmd_loss "$@" ;;
        cap) cmd_cap "$@" ;;
        uncap) cmd_uncap "$@" ;;
        fleet) cmd_fleet "$@" ;;
        stop) cmd_stop "$@" ;;
        forward-check) forward_check ;;
        -h|--help|help) usage ;;
        "") usage; exit 2 ;;
        *) usage >&2; die "unknown command '${cmd}'" ;;
    esac
}

main "$@"
