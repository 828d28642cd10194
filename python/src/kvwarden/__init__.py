"""kvwarden: the worker client of the kvwarden KV-cache server.

An inference-engine worker (one per GPU rank) creates one :class:`Worker`, registers its
KV-cache buffers at start-up, stores and retrieves per request, and calls
:meth:`Worker.shutdown` at exit. A heartbeat thread keeps the registration alive and
restores it, under the same instance id, after the server lost it (reap, restart).
See ``docs/python.md``.
"""

__version__ = "0.1.0"

from .buffers import (
    CUDA_IPC_HANDLE_BYTES,
    CudaIpcBuffer,
    CudaVmmBuffer,
    EnginePool,
    MemfdBuffer,
    Slot,
)
from .errors import (
    BadArgs,
    BadFrame,
    ConnectionLost,
    Forbidden,
    Internal,
    KvwardenError,
    NotReady,
    NotRegistered,
    Overloaded,
    ProtocolViolation,
    RequestTimeout,
    ServerError,
    TooLarge,
    Unavailable,
    UnknownOp,
    UntrustedServer,
)
from .heartbeat import Heartbeat, HeartbeatAction, PingReply, reap_timeout_floor_warning
from .worker import Identity, KvEvents, Worker, default_socket_path, new_instance_id

__all__ = [
    "BadArgs",
    "BadFrame",
    "CUDA_IPC_HANDLE_BYTES",
    "ConnectionLost",
    "CudaIpcBuffer",
    "CudaVmmBuffer",
    "EnginePool",
    "Forbidden",
    "Heartbeat",
    "HeartbeatAction",
    "Identity",
    "Internal",
    "KvEvents",
    "KvwardenError",
    "MemfdBuffer",
    "NotReady",
    "NotRegistered",
    "Overloaded",
    "PingReply",
    "ProtocolViolation",
    "RequestTimeout",
    "ServerError",
    "Slot",
    "TooLarge",
    "Unavailable",
    "UnknownOp",
    "UntrustedServer",
    "Worker",
    "default_socket_path",
    "new_instance_id",
    "reap_timeout_floor_warning",
]
