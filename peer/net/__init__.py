"""The network room: gRPC server and client streams, discovery, per-link accounting.

Every module here imports grpc, whose C core reads GRPC_VERBOSITY once, at import: the package keeps it below
INFO first (peer/logs.py says why), unless the project logs at DEBUG or the operator exported a value.
"""

import logging

from peer.logs import quiet_grpc_core

quiet_grpc_core(logging.getLogger().getEffectiveLevel())
