"""The wire protocol (version 1) over a Unix socket: framing, fds, request/reply matching.

A frame is a 4-byte big-endian length and a MessagePack body. Requests are
``[request_id, op, args]``; replies ``[request_id, ok, value]``. File descriptors travel
as ``SCM_RIGHTS`` on the ``sendmsg`` that carries a frame's first byte.

Threading: one :class:`Connection` is shared by the engine's thread(s) and the
heartbeat thread. A FIFO lock serializes whole round trips (send, then read until the
reply with our request id), which keeps three properties simple and true:

* the server sees one worker's requests in the order the worker issued them, so a
  recovery's re-register can never overtake the ``unregister`` of a shutdown;
* fds that arrive on a read belong to the one reply being waited for (or to a stale
  reply of a timed-out request, whose fds are closed);
* no reader thread to start, stop or leak.

FIFO matters: CPython's ``Lock`` is not fair, and an engine thread storing in a tight
loop could otherwise starve the heartbeat's ping past its timeout and make a live
worker believe it is unhealthy. Replies of requests that timed out arrive later and are
discarded by request id.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import msgpack

from .errors import (
    ConnectionLost,
    KvwardenError,
    ProtocolViolation,
    RequestTimeout,
    server_error,
)

log = logging.getLogger("kvwarden")

PROTOCOL_VERSION = 1
LENGTH_PREFIX = struct.Struct(">I")
#: The largest reply this client accepts; the server's request limit defaults to 1 MiB
#: and a status map of many instances can be larger, so allow generously.
MAX_REPLY_BYTES = 64 * 1024 * 1024
#: fds accepted on one read; only ``register_engine_driven`` replies carry one.
MAX_FDS_PER_READ = 16
RECV_CHUNK_BYTES = 64 * 1024


def encode_frame(request_id: int, op: str, args: Sequence[Any]) -> bytes:
    """A framed request ``[request_id, op, args]``."""
    body = msgpack.packb([request_id, op, list(args)], use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


class FifoLock:
    """A lock granted in request order, with a timeout on acquire.

    Why not ``threading.Lock``: it is not fair (a releasing thread usually wins the
    race to re-acquire), and the heartbeat must get its turn between an engine
    thread's back-to-back transfers.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: Deque[object] = collections.deque()
        self._held = False

    def acquire(self, timeout: Optional[float] = None) -> bool:
        """Waits for the turn; False when ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        token = object()
        with self._cond:
            self._queue.append(token)
            while self._held or self._queue[0] is not token:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._queue.remove(token)
                    # We may have been first in line: let the next waiter look.
                    self._cond.notify_all()
                    return False
                try:
                    self._cond.wait(remaining)
                except BaseException:  # KeyboardInterrupt: never leave a dead token first
                    self._queue.remove(token)
                    self._cond.notify_all()
                    raise
            self._queue.popleft()
            self._held = True
            return True

    def release(self) -> None:
        """Hands the lock to the longest waiter."""
        with self._cond:
            self._held = False
            self._cond.notify_all()


class _Reply:
    __slots__ = ("request_id", "ok", "value", "fds")

    def __init__(self, request_id: int, ok: bool, value: Any, fds: List[int]) -> None:
        self.request_id = request_id
        self.ok = ok
        self.value = value
        self.fds = fds


class HelloInfo:
    """What the server said in ``hello``: its version, boot id and liveness windows."""

    def __init__(self, value: Dict[str, Any]) -> None:
        self.raw = value
        self.protocol = int(value.get("protocol", 0))
        self.server = str(value.get("server", ""))
        self.boot_id = value.get("boot_id")
        self.reap_timeout_seconds = float(value.get("reap_timeout_seconds", 0.0))
        self.registration_grace_seconds = float(value.get("registration_grace_seconds", 0.0))
        #: How the server will notice this worker's death: ``"pidfd_from_peer"``,
        #: ``"pidfd_by_pid"`` or ``"timeout_only"``; None from an older server.
        self.exit_proof: Optional[str] = value.get("exit_proof")

    def __repr__(self) -> str:
        return (
            f"HelloInfo(server={self.server!r}, protocol={self.protocol}, boot_id={self.boot_id}, "
            f"reap_timeout_seconds={self.reap_timeout_seconds}, exit_proof={self.exit_proof!r})"
        )


class Connection:
    """A reconnecting connection to the server's Unix socket.

    Connects lazily, says ``hello`` on every new connection, and closes itself on any
    stream error so that the next request starts over on a fresh socket (a restarted
    server is reached this way). ``on_connect`` is called with the hello reply.

    With ``send_pidfd`` (the default), every ``hello`` carries a pidfd of this process
    (``os.pidfd_open(os.getpid())``, Linux 5.3+), so the server can prove this worker's
    death in any PID namespace; where the platform has none, or the server refuses it
    (an older server), hello goes without it.
    """

    def __init__(
        self,
        socket_path: str,
        client_name: str,
        on_connect: Optional[Any] = None,
        send_pidfd: bool = True,
    ) -> None:
        self.socket_path = socket_path
        self.client_name = client_name
        self.send_pidfd = send_pidfd
        self._on_connect = on_connect
        self._lock = FifoLock()
        self._sock: Optional[socket.socket] = None
        self._buffer = bytearray()
        # Stream position of `_buffer[0]`, and fds read but not yet handed to a frame,
        # each with the stream position of the last byte of the read that carried it.
        self._buffer_start = 0
        self._pending_fds: List[Tuple[int, int]] = []
        self._next_id = 1
        self._closed = False
        self.hello: Optional[HelloInfo] = None
        self.connects = 0

    # -- public ---------------------------------------------------------------------

    def request(
        self,
        op: str,
        args: Sequence[Any],
        timeout: float,
        fds: Sequence[int] = (),
    ) -> Tuple[Any, List[int]]:
        """Sends one request and waits for its reply: ``(value, fds)``.

        Raises the typed :class:`~kvwarden.errors.ServerError` for an error reply,
        :class:`~kvwarden.errors.RequestTimeout` when no reply came within ``timeout``
        seconds (including the wait for our turn), :class:`ConnectionLost` when the
        socket could not be connected or broke. The caller owns the returned fds.
        """
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout):
            raise RequestTimeout(
                f"`{op}` could not be sent within {timeout:g} s: another request on this "
                f"worker's connection was still waiting for the server"
            )
        try:
            if self._closed:
                raise ConnectionLost(f"`{op}`: the connection was closed by shutdown()")
            sock = self._ensure_connected(deadline)
            request_id = self._take_id()
            self._send(sock, encode_frame(request_id, op, args), fds, deadline, op)
            reply = self._read_reply(sock, request_id, deadline, op)
        finally:
            self._lock.release()
        if not reply.ok:
            for fd in reply.fds:
                _close_quietly(fd)
            code, message = _error_fields(reply.value)
            raise server_error(code, message)
        return reply.value, reply.fds

    def close(self) -> None:
        """Closes the socket; later requests raise :class:`ConnectionLost`."""
        acquired = self._lock.acquire(5.0)
        if not acquired:
            # A request still waits on a silent server; closing the socket under it
            # makes its read fail at once, which is what a shutdown wants.
            log.warning("kvwarden: closing the connection while a request is still running")
        try:
            self._closed = True
            self._drop("closed by the worker")
        finally:
            if acquired:
                self._lock.release()

    def is_connected(self) -> bool:
        """Whether a socket is open now (it may still turn out to be broken)."""
        return self._sock is not None

    def drop(self, why: str) -> None:
        """Forgets the socket so the next request reconnects. Takes the lock."""
        if not self._lock.acquire(5.0):
            return
        try:
            self._drop(why)
        finally:
            self._lock.release()

    # -- internals (called with the lock held) ---------------------------------------

    def _take_id(self) -> int:
        request_id = self._next_id
        self._next_id = (self._next_id + 1) & ((1 << 63) - 1) or 1
        return request_id

    def _ensure_connected(self, deadline: float) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(self.socket_path)
        except OSError as error:
            sock.close()
            raise ConnectionLost(
                f"cannot connect to the kvwarden socket {self.socket_path!r}: {error}; "
                f"is `kvwarden serve --socket {self.socket_path}` running and is the path "
                f"right?"
            ) from error
        self._sock = sock
        self._buffer.clear()
        self._buffer_start = 0
        self._pending_fds.clear()
        self.connects += 1
        try:
            reply = None
            pidfd = own_pidfd() if self.send_pidfd else None
            if pidfd is not None:
                try:
                    reply = self._hello(sock, [{"pidfd_index": 0}], [pidfd], deadline)
                finally:
                    _close_quietly(pidfd)
                if not reply.ok:
                    # An older server (two arguments only) or one that cannot check
                    # pidfds; the connection is still good.
                    _, message = _error_fields(reply.value)
                    log.warning(
                        "kvwarden: the server refused this worker's pidfd (%s); carrying on "
                        "without it: its death is then noticed by pid where the server can "
                        "see it, else only by the reap timeout",
                        message,
                    )
                    reply = None
            if reply is None:
                reply = self._hello(sock, [], [], deadline)
        except KvwardenError:
            self._drop("hello failed")
            raise
        if not reply.ok:
            self._drop("hello refused")
            code, message = _error_fields(reply.value)
            raise server_error(code, f"hello refused: {message}")
        if not isinstance(reply.value, dict):
            self._drop("hello reply is not a map")
            raise ProtocolViolation(f"hello reply must be a map, got {reply.value!r}")
        self.hello = HelloInfo(reply.value)
        if self.hello.protocol != PROTOCOL_VERSION:
            log.error(
                "kvwarden: server %r speaks protocol %s, this client speaks %s; upgrade "
                "the older side",
                self.hello.server,
                self.hello.protocol,
                PROTOCOL_VERSION,
            )
        if self._on_connect is not None:
            try:
                self._on_connect(self.hello)
            except Exception:  # a logging hook must never break the connection
                log.exception("kvwarden: the on_connect hook failed")
        return sock

    def _hello(
        self, sock: socket.socket, options: List[Any], fds: Sequence[int], deadline: float
    ) -> _Reply:
        request_id = self._take_id()
        args = [PROTOCOL_VERSION, self.client_name, *options]
        self._send(sock, encode_frame(request_id, "hello", args), fds, deadline, "hello")
        return self._read_reply(sock, request_id, deadline, "hello")

    def _drop(self, why: str) -> None:
        if self._sock is not None:
            log.debug("kvwarden: dropping connection to %s: %s", self.socket_path, why)
            try:
                # shutdown() first: it wakes a thread blocked reading this socket,
                # which close() alone does not.
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self._sock = None
        self._buffer.clear()
        self._buffer_start = 0
        for _, fd in self._pending_fds:
            _close_quietly(fd)
        self._pending_fds.clear()

    def _send(
        self, sock: socket.socket, frame: bytes, fds: Sequence[int], deadline: float, op: str
    ) -> None:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            view = memoryview(frame)
            if fds:
                sent = socket.send_fds(sock, [view], list(fds))
                view = view[sent:]
            if len(view):
                sock.sendall(view)
        except socket.timeout as error:
            # Part of a frame may be on the wire: the stream can no longer be trusted.
            self._drop(f"send of `{op}` timed out")
            raise RequestTimeout(
                f"`{op}`: the server did not accept the request in time"
            ) from error
        except OSError as error:
            self._drop(f"send of `{op}` failed: {error}")
            raise ConnectionLost(
                f"`{op}`: the connection to {self.socket_path!r} broke: {error}"
            ) from error

    def _read_reply(self, sock: socket.socket, request_id: int, deadline: float, op: str) -> _Reply:
        while True:
            reply = self._next_frame()
            if reply is not None:
                if reply.request_id == request_id:
                    return reply
                # The late reply of a request that timed out: nobody waits for it.
                log.debug("kvwarden: discarding the late reply to request %d", reply.request_id)
                for fd in reply.fds:
                    _close_quietly(fd)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"`{op}`: no reply from the server in time")
            try:
                sock.settimeout(remaining)
                data, fds, flags, _ = socket.recv_fds(sock, RECV_CHUNK_BYTES, MAX_FDS_PER_READ)
            except socket.timeout as error:
                # The stream stays in sync (partial data is kept in the buffer).
                raise RequestTimeout(f"`{op}`: no reply from the server in time") from error
            except OSError as error:
                self._drop(f"read failed: {error}")
                raise ConnectionLost(
                    f"`{op}`: the connection to {self.socket_path!r} broke: {error}"
                ) from error
            if flags & getattr(socket, "MSG_CTRUNC", 0):
                log.error(
                    "kvwarden: the server sent more fds than %d on one read; some were lost",
                    MAX_FDS_PER_READ,
                )
            if not data:
                for fd in fds:
                    _close_quietly(fd)
                self._drop("the server closed the connection")
                raise ConnectionLost(
                    f"`{op}`: the server closed the connection (it restarted, or it "
                    f"rejected the stream)"
                )
            # The kernel ends a read right after the segment that carried fds, and the
            # server sends them with a frame's first byte: so they belong to the frame
            # that holds the last byte of this read. Positions are absolute in the stream.
            self._buffer.extend(data)
            last_byte = self._buffer_start + len(self._buffer) - 1
            for fd in fds:
                self._pending_fds.append((last_byte, fd))

    def _next_frame(self) -> Optional[_Reply]:
        if len(self._buffer) < LENGTH_PREFIX.size:
            return None
        (length,) = LENGTH_PREFIX.unpack_from(self._buffer)
        if length == 0 or length > MAX_REPLY_BYTES:
            self._drop(f"bad frame length {length}")
            raise ProtocolViolation(
                f"the server sent a frame of length {length}; expected 1..{MAX_REPLY_BYTES}"
            )
        end = LENGTH_PREFIX.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[LENGTH_PREFIX.size : end])
        del self._buffer[:end]
        frame_end = self._buffer_start + end
        self._buffer_start = frame_end
        mine = [fd for last_byte, fd in self._pending_fds if last_byte < frame_end]
        self._pending_fds = [(b, fd) for b, fd in self._pending_fds if b >= frame_end]
        try:
            message = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as error:  # msgpack raises several unrelated types
            for fd in mine:
                _close_quietly(fd)
            self._drop("undecodable reply")
            raise ProtocolViolation(
                f"the server sent a reply that is not MessagePack: {error}"
            ) from error
        if (
            not isinstance(message, list)
            or len(message) != 3
            or not isinstance(message[0], int)
            or not isinstance(message[1], bool)
        ):
            for fd in mine:
                _close_quietly(fd)
            self._drop("malformed reply")
            raise ProtocolViolation(
                f"a reply must be [request_id: uint, ok: bool, value], got {message!r:.200}"
            )
        return _Reply(message[0], message[1], message[2], mine)


def own_pidfd() -> Optional[int]:
    """A pidfd of this process, or None where there is none to be had (not Linux,
    Python < 3.9, a kernel before 5.3, or a sandbox that forbids ``pidfd_open``)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(os.getpid())
    except OSError as error:
        log.debug("kvwarden: pidfd_open(getpid()) failed (%s); hello goes without a pidfd", error)
        return None


def _error_fields(value: Any) -> Tuple[str, str]:
    if isinstance(value, dict):
        return str(value.get("code", "internal")), str(value.get("message", ""))
    return "internal", f"error reply without a code: {value!r:.200}"


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
