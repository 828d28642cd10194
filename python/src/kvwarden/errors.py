"""Typed errors: one class per error code of the wire protocol, plus the client's own.

A server error reply ``{"code": ..., "message": ...}`` becomes an instance of the class
registered for its code, so an engine can ``except NotRegistered`` without comparing
strings. Codes a newer server invents map to the base :class:`ServerError`, keeping the
code as sent.
"""

from __future__ import annotations

from typing import Dict, Optional, Type


class KvwardenError(Exception):
    """Base of every error this package raises.

    ``code`` is the protocol's error code (``"not_registered"``, ...) for server replies,
    or one of the client's own codes (``"connection_lost"``, ``"timeout"``,
    ``"protocol"``) for failures that never reached a reply.
    """

    code: str = "error"

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class ServerError(KvwardenError):
    """The server answered with an error reply; ``code`` and ``message`` are as sent."""


class BadFrame(ServerError):
    """The server could not parse the stream; it closes the connection."""

    code = "bad_frame"


class TooLarge(ServerError):
    """A frame exceeded the server's ``--max-frame-bytes``; it closes the connection."""

    code = "too_large"


class UnknownOp(ServerError):
    """The server does not know the op: it is older than this client."""

    code = "unknown_op"


class BadArgs(ServerError):
    """Wrong argument count or types, usually a client/server version mismatch."""

    code = "bad_args"


class NotRegistered(ServerError):
    """The server does not hold the instance (reaped, restarted): re-register."""

    code = "not_registered"


class NotReady(ServerError):
    """The instance's context is still being built on the server."""

    code = "not_ready"


class Forbidden(ServerError):
    """Not allowed: the connection has not ``attach``-ed the instance (the message
    says to attach first), the instance is bound to another secret or tenant, a TCP
    ``auth`` for a token the server does not hold or a TCP ``hello`` without a proof
    of one, or an op this tenant may not use."""

    code = "forbidden"


class Unavailable(ServerError):
    """The feature is not available on this server (no GPU, not built yet)."""

    code = "unavailable"


class Overloaded(ServerError):
    """The server is at a limit; try again later."""

    code = "overloaded"


class Internal(ServerError):
    """A bug or an unexpected system error on the server."""

    code = "internal"


class ConnectionLost(KvwardenError):
    """The socket could not be connected, or broke; the next request reconnects."""

    code = "connection_lost"


class UntrustedServer(ConnectionLost):
    """The process listening on the endpoint is not the server this worker trusts, and
    was sent nothing it could use. On the Unix socket: it runs as a uid this worker
    does not trust (not 0, not its own, not in ``trusted_server_uids``), and nothing
    was sent to it, no fd in particular; ``uid`` is the uid found. Over TCP: it could
    not prove it holds the token of ``tcp_token_file`` (answering ``auth``), and was
    sent nothing after ``auth``, the token least of all (it never travels); ``uid`` is
    -1. ``socket_path`` is the endpoint (the path, or ``tcp:HOST:PORT``)."""

    code = "untrusted_server"

    def __init__(self, message: str, socket_path: str = "", uid: int = -1) -> None:
        super().__init__(message)
        self.socket_path = socket_path
        self.uid = uid


class RequestTimeout(KvwardenError):
    """No reply within the request's timeout. The request may still be carried out."""

    code = "timeout"


class ProtocolViolation(KvwardenError):
    """The server sent something this client cannot read (not a reply frame)."""

    code = "protocol"


_BY_CODE: Dict[str, Type[ServerError]] = {
    cls.code: cls
    for cls in (
        BadFrame,
        TooLarge,
        UnknownOp,
        BadArgs,
        NotRegistered,
        NotReady,
        Forbidden,
        Unavailable,
        Overloaded,
        Internal,
    )
}


def server_error(code: str, message: str) -> ServerError:
    """The typed exception for an error reply; unknown codes keep their spelling."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ServerError(message, code=code)
    return cls(message)
