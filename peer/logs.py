"""Logging set-up shared by every command: the project's handler on stderr, gRPC's C core kept below ERROR.

gRPC's C core logs through absl straight to file descriptor 2, past Python's ``logging``: lines such as
``I1123 15:27:38.607010 4427 chttp2_transport.cc:1403] ipv4:127.0.0.1:34689: Got goaway [2] ...`` land raw in the
middle of a live table or a test report. grpcio offers no hook to route them into ``logging``; what it offers is the
``GRPC_VERBOSITY`` variable (DEBUG, INFO, ERROR or NONE; unset leaves absl's default, which prints INFO), read when
the first channel or server initialises the core. It has no WARNING step, so outside DEBUG we set ERROR: the core's
INFO and WARNING lines are dropped, its errors still show. A value the operator exported wins.

Torch- and grpc-free: the CLI calls :func:`setup_logging` from its group callback, before any command imports grpc.
"""

from __future__ import annotations

import logging
import os

#: The format of every log line the project writes (stderr; journald adds its own timestamp, tests capture it).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Environment variable gRPC's C core reads for its own log threshold.
GRPC_VERBOSITY = "GRPC_VERBOSITY"


def quiet_grpc_core(level: int = logging.INFO) -> None:
    """Keep gRPC's C core to errors unless the project logs at DEBUG (then absl's default, INFO, shows).

    Must run before the process opens its first gRPC channel or server; an exported GRPC_VERBOSITY is kept.
    """
    if level > logging.DEBUG:
        os.environ.setdefault(GRPC_VERBOSITY, "ERROR")


def setup_logging(level_name: str) -> None:
    """Log at ``level_name`` (DEBUG, INFO, WARNING, ERROR) to stderr and set gRPC's C core threshold to match."""
    level = logging.getLevelName(level_name)
    quiet_grpc_core(level)
    logging.basicConfig(level=level, format=LOG_FORMAT)
