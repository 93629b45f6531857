"""The zygote process of a local fleet (``python -m peer.cli.zygote``): imports torch and the daemon's modules once,
then forks one ``lpdl-peer start`` daemon per request. Why, and the protocol: peer/fleet/zygote.py, the fleet's side.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback
from typing import IO, Any, NoReturn

from peer.daemon.allocator import mark_preloaded

#: Modules the zygote imports before it forks: torch and what ``lpdl-peer start`` imports when it runs (none of
#: them starts a thread, a gRPC core or an event loop at import).
PRELOAD = ("torch", "peer.cli.main", "peer.cli.start", "peer.daemon.node", "peer.data", "peer.runtime.state",
           "peer.security.credentials")
#: Seconds between two looks for ended daemons while no request comes.
REAP_INTERVAL_S = 0.1


def _reply(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _exit_code(exc: SystemExit) -> int:
    """The process exit code ``sys.exit`` would give for ``exc`` (a message: printed, code 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_daemon(request: dict[str, Any], zygote_preload: str, zygote_fds: tuple[int, ...]) -> NoReturn:
    """In the forked child: become the daemon ``request`` asks for, run it, and exit with its code (never return
    into the zygote's loop). ``zygote_fds``: the protocol's descriptors, closed here."""
    code = 1
    try:
        os.setsid()  # its own session: a Ctrl-C on the fleet's terminal reaches only the fleet
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {log, null, *zygote_fds} - {0, 1, 2}:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        # a fork runs on the zygote's allocator, whatever it is: `start` must not re-execute (its command line
        # would be the zygote's), and its own children get the LD_PRELOAD the request had
        if zygote_preload:
            os.environ["LD_PRELOAD"] = zygote_preload
        mark_preloaded(os.environ, os.getpid(), request["env"].get("LD_PRELOAD", ""))
        import numpy
        import setproctitle
        import torch

        # ps, top and pgrep show what runs here, `lpdl-peer start --config FILE`, not the zygote's command line
        setproctitle.setproctitle(" ".join(["lpdl-peer", *request["args"]]))

        torch.seed()  # a fresh process's generators: the fork copied the zygote's
        numpy.random.seed()
        from peer.cli import main as entry  # imported by the zygote already

        entry.PROCESS_ENTRY = True
        entry.cli(args=list(request["args"]), prog_name="lpdl-peer")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - whatever it is, it ends this daemon, with its traceback in the log
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _reap(replies: int, children: set[int]) -> None:
    """Report every forked daemon that ended."""
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            _reply(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(requests: int, replies: int) -> None:
    """Fork a daemon per request line read from fd ``requests``; answer on fd ``replies``; return at its EOF."""
    zygote_preload = os.environ.get("LD_PRELOAD", "")
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([requests], [], [], REAP_INTERVAL_S)
        if readable:
            chunk = os.read(requests, 65536)
            if not chunk:
                return  # the fleet is done with us (or gone): the daemons it forked go on without a zygote
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_daemon(request, zygote_preload, (requests, replies))
                children.add(pid)
                _reply(replies, {"started": pid})
        _reap(replies, children)


def main(stdin: IO[bytes] | None = None) -> None:
    """The zygote process: cap malloc arenas, import, say ready, serve until stdin closes."""
    import importlib

    import setproctitle

    from peer.daemon.memory import limit_malloc_arenas

    # first, while the process's environment is as it started (the title is written over argv and environ's
    # memory, which the forked daemons' titles reuse): ps shows this process as what it is
    setproctitle.setproctitle("lpdl-peer zygote")

    if "MALLOC_ARENA_MAX" not in os.environ:
        limit_malloc_arenas()  # before any thread: the forked daemons inherit the cap
    replies = os.dup(1)  # the protocol's channel; fd 1 itself goes to the log so that no stray print corrupts it
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    _reply(replies, {"ready": True})
    serve((stdin or sys.stdin.buffer).fileno(), replies)


if __name__ == "__main__":
    main()
