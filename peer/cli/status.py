"""``lpdl-peer status``: what a peer is doing, from its local control socket or a remote peer's Status RPC.

Starts without torch, grpc or zeroconf: the socket path and reader come from the torch-free ``peer.daemon`` modules,
and grpc is imported only for ``--peer``.
"""

from __future__ import annotations

import asyncio
import json
import math
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from peer.daemon.control import CONTROL_TIMEOUT_S, read_control_socket
from peer.daemon.paths import TLS_DIR_NAME, control_socket_path
from peer.daemon.status import (ConsensusStatus, GossipStatus, ModelStatus, NeighbourStatus, StatusDocument,
                                StatusFormatError)
from peer.errors import PeerError
from peer.gossip.reach import describe

#: Columns the human view fits into (a classic terminal; --watch redraws it in place).
WIDTH = 80
#: Indent of the continuation of a wrapped line (under the value column of the header lines).
INDENT = 10
#: The neighbour table's columns: (header, right-aligned). "seen" is how long ago the peer was last heard from.
COLUMNS = (("neighbour", False), ("state", False), ("address", False), ("sent", True), ("received", True),
           ("rtt ms", True), ("seen", True))
#: Columns shortened (cut in the middle) when a row would not fit, in this order, each down to MIN_COLUMN.
SHRINK_ORDER = (0, 2)
#: Narrowest a shortened column gets (characters).
MIN_COLUMN = 12


class StatusUnavailable(PeerError):
    """No status could be read; the message is one line naming where and why."""

    default_reason = "status_unavailable"


async def _remote_status(address: str, timeout_s: float, tls_dir: Path | None) -> dict[str, Any]:
    import grpc

    from peer.net.proto.lpdl.v1 import peer_pb2 as pb
    from peer.net.proto.lpdl.v1 import peer_pb2_grpc
    from peer.security.credentials import TlsConfigError, TransportSecurity

    try:
        security = TransportSecurity.for_holder(tls_dir) if tls_dir else TransportSecurity.insecure()
    except TlsConfigError as exc:
        raise StatusUnavailable(str(exc)) from None
    try:
        async with security.channel(address, []) as channel:
            reply = await peer_pb2_grpc.PeerStub(channel).Status(pb.StatusRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        details = " ".join((exc.details() or "").split())
        hint = "" if tls_dir else " - a secured peer needs --tls-dir with an operator certificate"
        raise StatusUnavailable(f"no peer answering at {address}: {exc.code().name}"
                                + (f" ({details})" if details else "") + hint) from None
    return json.loads(reply.json)


async def _local_status(path: Path, timeout_s: float) -> dict[str, Any]:
    try:
        return await read_control_socket(path, timeout_s)
    except asyncio.TimeoutError:
        raise StatusUnavailable(f"no peer answering at {path}: no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise StatusUnavailable(f"no peer answering at {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise StatusUnavailable(f"unreadable status from {path}: {exc}") from None


def fetch_status(socket_path: Path | None, peer: str | None, timeout_s: float = CONTROL_TIMEOUT_S,
                 tls_dir: Path | None = None) -> StatusDocument:
    """Status from a remote peer (``peer`` = host:port) or the local control socket, waiting up to ``timeout_s``.
    A remote call uses mutual TLS with the operator (or device) certificate in ``tls_dir``; None = insecure (a
    peer started with --insecure).

    Raises:
        StatusUnavailable: nothing answered, or the answer was not a status document (one-line reason).
    """
    if peer:
        data = asyncio.run(_remote_status(peer, timeout_s, tls_dir))
    else:
        assert socket_path is not None
        data = asyncio.run(_local_status(socket_path, timeout_s))
    try:
        return StatusDocument.from_json(data)
    except StatusFormatError as exc:
        raise StatusUnavailable(f"unreadable status from {peer or socket_path}: {exc}") from None


def _duration(seconds: float) -> str:
    """A compact duration: 4.2s, 12m, 3h25m."""
    if seconds < 100:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def _age(seconds_since_epoch: float) -> str:
    return _duration(max(0.0, time.time() - seconds_since_epoch)) if seconds_since_epoch else "never"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _number(x: float | None, fmt: str) -> str:
    """A reported figure, or '-' while the daemon has none (loss is NaN before the first step)."""
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _shorten(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` characters (peer ids differ at both ends)."""
    if len(text) <= width:
        return text
    head = (width - 2 + 1) // 2
    return text[:head] + ".." + text[len(text) - (width - 2 - head):]


def _table(rows: list[tuple[str, ...]], width: int) -> list[str]:
    """Rows under COLUMNS' headers; the SHRINK_ORDER columns are narrowed, in turn, until a line fits ``width``."""
    widths = [max(len(header), *(len(r[i]) for r in rows)) for i, (header, _) in enumerate(COLUMNS)]
    for i in SHRINK_ORDER:
        excess = sum(widths) + len(widths) - 1 - width
        if excess > 0:
            widths[i] = max(MIN_COLUMN, widths[i] - excess)

    def line(cells: tuple[str, ...]) -> str:
        out = []
        for cell, w, (_, right) in zip(cells, widths, COLUMNS):
            cell = _shorten(cell, w)
            out.append(cell.rjust(w) if right else cell.ljust(w))
        return " ".join(out).rstrip()

    return [line(tuple(header for header, _ in COLUMNS)), *(line(r) for r in rows)]


def _model_line(model: ModelStatus) -> str:
    """The model, where it comes from (registry / torchvision / module / file / python) and, for a converted
    model, the converter's one-line summary (``--layers`` shows its table)."""
    kind = model.source_kind or "registry"
    summary = f"; {model.layers_summary}" if model.layers_summary else ""
    return f"model     {model.name} ({kind}, fingerprint {model.fingerprint}){summary}"


def _consensus_line(consensus: ConsensusStatus, neighbours: Mapping[str, NeighbourStatus]) -> str:
    """The consensus phase a peer is in, its rounds and bytes, and each neighbour's relative model distance."""
    tolerance = consensus.tolerance
    line = (f"consensus {consensus.phase}  {consensus.rounds} round(s), {_bytes(consensus.bytes_sent)} sent"
            + (f"  tolerance {tolerance:.3g}" if tolerance is not None else "  (no phase configured)"))
    distances = [f"{peer_id} {n.consensus_distance:.3g}" for peer_id, n in neighbours.items()
                 if n.consensus_distance is not None]
    return line + ("  distance: " + ", ".join(distances) if distances else "")


def _robust_line(g: GossipStatus) -> str:
    """The robust receive rule, and the most insiders within the honest spread this peer's graph lets any local rule
    bound (peer/gossip/reach.py); empty for a daemon of a version that does not say."""
    if g.robust is None:
        return ""
    if not g.robust:
        return "robust    off (gossip.robust = false): every message applied as sent"
    if g.senders is None or g.max_insiders is None:
        return "robust    on; no peer scheduled to send here yet"
    return f"robust    on; {describe(g.senders, g.max_insiders)}"


def format_status(s: StatusDocument, width: int = WIDTH, layers: bool = False) -> str:
    """Human-readable status, every line at most ``width`` characters (8 neighbours fit 80 columns)."""
    ev, g, p = s.eval, s.gossip, s.precision
    round_ms = _number(s.last_round_s * 1000 if s.last_round_s else None, ".0f")
    head = [
        f"peer      {s.peer_id}  fleet {s.fleet}  {s.phase.value}  up {_duration(s.uptime_s)}",
        (f"training  round {s.round}  epoch {s.epoch:.2f}  lr {s.lr:.4g}  "
         f"loss {_number(s.loss, '.4f')}  {round_ms} ms/round"
         + (f"  waited {s.pace_wait_s:.1f} s for neighbours" if s.pace_wait_s >= 0.05 else "")),
        f"test acc  {ev.test_acc * 100:.2f}% (round {ev.round})" if ev is not None else "test acc  not yet",
        _model_line(s.model),
        f"precision {p.backend} (requested {p.requested}: {p.reason})",
        (f"gossip    {g.algorithm} c={g.compression} {g.bits}-bit gamma={g.gamma:.4g} "
         f"{g.topology}  w {s.w:.4f}"),
    ]
    robust = _robust_line(g)
    if robust:
        head.append(robust)
    if s.divergences:
        head.append(f"diverged  {s.divergences} time(s): model rolled back, gamma halved "
                    f"{s.gamma_halvings} time(s) (configured {g.configured_gamma:.4g}), the learning rate "
                    f"{s.lr_halvings} time(s)")
    if s.storage is not None and s.storage.gossip_paused:  # peer/daemon/durability.py
        head.append(f"STORAGE   gossip paused, training goes on: {s.storage.gossip_paused} ({s.storage.errors} "
                    f"failed write(s))")
    if s.consensus is not None:  # None from a peer of an older version
        head.append(_consensus_line(s.consensus, s.neighbours))
    rows: list[tuple[str, ...]] = []
    for peer_id, n in s.neighbours.items():
        rtt = _number(n.rtt_s * 1000 if n.rtt_s else None, ".1f")
        rows.append((peer_id, n.state, n.address or "-", _bytes(n.bytes_sent), _bytes(n.bytes_received),
                     rtt, _age(n.last_seen)))
    table = _table(rows, width) if rows else ["(no neighbours yet)"]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(s.refused.items())) or "none"
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(s.dropped.items())) or "none"
    tail = [f"inputs    applied {s.applied}  refused: {refused}  dropped: {dropped}"]
    for peer_id, n in s.neighbours.items():  # the robust receive rule's view of a neighbour (peer/gossip/robust.py)
        r = n.robust
        if r.get("sink"):  # peer/gossip/sinks.py; absent from an older daemon's document
            routed = r.get("routed_around_since")
            tail.append(f"sink      {peer_id}: silent in {r.get('silent_rounds', '?')} scheduled rounds, "
                        + (f"routed around since round {routed} (next probe round {r.get('next_probe')})"
                           if routed is not None else "in the schedule"))
        left_out = r.get("left_out_on_notice_since")  # peer/gossip/notices.py; absent from older documents
        if left_out is not None:
            tail.append(f"noticed   {peer_id}: out of the fleet's schedule since round {left_out}: quarantined by "
                        f"{', '.join(r.get('named_by', []))}, every peer it sends to")
        factor = r.get("outlier_factor", 1.0)  # absent from an older daemon's document
        if factor < 1.0 and r.get("quarantined_since") is None:
            since = r.get("outlier_since")
            tail.append(f"outlier   {peer_id}: its model is {r.get('implied_distance', 0.0):.3g} of this peer's norm "
                        f"away, far beyond the other neighbours'; its radius and share are cut to "
                        f"{100 * factor:.2g}%" + (f", not closing since round {since}" if since is not None else ""))
        heading = r.get("heading_factor", 1.0)  # absent from an older daemon's document
        if heading < 1.0 and r.get("quarantined_since") is None:
            tail.append(f"heading   {peer_id}: its replica travelled against this peer's own (cosine "
                        f"{r.get('heading', 0.0):.2f}); its radius is cut to {100 * heading:.2g}%")
        if not r or (not r.get("score") and r.get("quarantined_since") is None):
            continue
        since = r["quarantined_since"]
        state = f"QUARANTINED since round {since} ({r['reason']})" if since is not None else f"last: {r['reason']}"
        serial = f", certificate serial {n.certificate_serial}" if n.certificate_serial else ""
        tail.append(f"robust    {peer_id}: score {r['score']:.2f}, clipped {100 * r['clipped_fraction']:.1f}%, "
                    f"{state}{serial}")
    memory = s.memory
    if memory is not None:
        # whole MiB, rounded first: a stage that freed a fraction of a MiB reads +0, not -0
        stages = ", ".join(f"{stage} {round(added):+d}" for stage, added in memory.added.items())
        allocator = f"{memory.allocator}; " if memory.allocator else ""
        tail.append(f"memory    RSS {memory.rss_mib:.0f} MiB (peak {memory.peak_mib:.0f}; {allocator}gossip "
                    f"state {memory.gossip_state_mib:.1f}): {stages}")
        if memory.seconds:
            tail.append("start-up  " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in memory.seconds.items()
                                                  if stage != "training"))
    wrap = textwrap.TextWrapper(width=width, subsequent_indent=" " * INDENT, break_on_hyphens=False)
    layer_table = ["", s.model.layers] if layers and s.model.layers else []
    return "\n".join([*(wrap.fill(line) for line in head), "", *table, "", *(wrap.fill(line) for line in tail),
                      *layer_table])


@click.command("status")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="State directory of the local daemon [$STATE_DIRECTORY or ~/.local/state/lpdl-peer].")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="Control socket path [STATE_DIR/control.sock].")
@click.option("--peer", default=None, help="host:port of a remote peer (Status RPC) instead of the local socket.")
@click.option("--tls-dir", type=click.Path(file_okay=False), default=None,
              help="With --peer: TLS directory holding an operator certificate (`lpdl-peer ca issue --operator`) "
                   "[STATE_DIR/tls if it exists, else none: only a peer started with --insecure answers].")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON snapshot.")
@click.option("--watch", type=click.FloatRange(min=0.1), default=None,
              help="Refresh every N seconds until interrupted.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=CONTROL_TIMEOUT_S,
              help="Seconds to wait for an answer.")
@click.option("--layers", is_flag=True, help="Also print a converted model's layer table (layer, type, precision "
              "path, parameters, multiply-adds).")
def status(state_dir: str | None, socket_path: str | None, peer: str | None, tls_dir: str | None, as_json: bool,
           watch: float | None, timeout: float, layers: bool) -> None:
    """Show a peer's round, loss, accuracy, weight, precision backend and per-neighbour links."""
    path = Path(socket_path) if socket_path else control_socket_path(Path(state_dir) if state_dir else None)
    default_tls = path.parent / TLS_DIR_NAME
    tls = Path(tls_dir) if tls_dir else (default_tls if default_tls.is_dir() else None)
    while True:
        try:
            snapshot = fetch_status(None if peer else path, peer, timeout, tls)
        except StatusUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        text = json.dumps(snapshot.to_json(), indent=2) if as_json else format_status(snapshot, layers=layers)
        if watch:
            click.clear()
        click.echo(text)
        if not watch:
            return
        time.sleep(watch)
