"""The wire protocol (version 3) over a Unix socket or TCP: framing, fds, request/reply
matching, and who is who (the server's credentials, the TCP challenge, ``attach``).

A frame is a 4-byte big-endian length and a MessagePack body. Requests are
``[request_id, op, args]``; replies ``[request_id, ok, value]``. File descriptors travel
as ``SCM_RIGHTS`` on the ``sendmsg`` that carries a frame's first byte (Unix socket
only).

Every new connection, before anything else: over the Unix socket the server's uid is
read (``SO_PEERCRED``) and checked against the uids this client trusts, before any byte
(and so any fd) is sent; over TCP the two sides prove to each other that they hold the
token (``auth``, then a ``hello`` carrying the client's proof; the token itself never
travels, see :class:`TcpKey`), the server first: one that cannot prove it is sent
nothing more. Then ``hello`` (with this process's pidfd over the Unix socket); then the
``on_attach`` hook, which sends ``attach`` for the instance the worker acts as, before
any request that names it.

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
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import msgpack

from .errors import (
    ConnectionLost,
    KvwardenError,
    ProtocolViolation,
    RequestTimeout,
    UntrustedServer,
    server_error,
)

log = logging.getLogger("kvwarden")

PROTOCOL_VERSION = 3
#: Environment variables read when the constructor argument is not given.
TRUSTED_SERVER_UIDS_ENV = "KVWARDEN_TRUSTED_SERVER_UIDS"
TCP_TOKEN_FILE_ENV = "KVWARDEN_TCP_TOKEN_FILE"
LENGTH_PREFIX = struct.Struct(">I")
#: The largest reply this client accepts; the server's request limit defaults to 1 MiB
#: and a status map of many instances can be larger, so allow generously.
MAX_REPLY_BYTES = 64 * 1024 * 1024
#: fds accepted on one read; only ``register_engine_driven`` replies carry one.
MAX_FDS_PER_READ = 16
RECV_CHUNK_BYTES = 64 * 1024


#: A request's arguments, or a function that builds them once the connection is up
#: (and attached): how a request names the instance id current at send time.
Args = Union[Sequence[Any], Callable[[], Sequence[Any]]]

#: ``call(op, args, fds=())`` on a connection being set up: one round trip, the value
#: or the typed error. Handed to the ``on_attach`` hook.
Call = Callable[..., Any]


def encode_frame(request_id: int, op: str, args: Sequence[Any]) -> bytes:
    """A framed request ``[request_id, op, args]``."""
    body = msgpack.packb([request_id, op, list(args)], use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


#: Ops that write into the worker's own memory: after one timed out, the client waits
#: (up to :data:`WRITE_DRAIN_SECONDS`) for its answer before the destination is used
#: again (failure mode 60).
WRITES_WORKER_MEMORY = frozenset({"retrieve", "retrieve_batch"})
#: See :data:`WRITES_WORKER_MEMORY`.
WRITE_DRAIN_SECONDS = 1.0


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
        #: The tenant the server put this connection in (``"uid-<uid>"`` by default for
        #: a Unix peer): its keys live in that tenant's keyspace. None before protocol 2.
        tenant = value.get("tenant")
        self.tenant: Optional[str] = None if tenant is None else str(tenant)
        #: Whether the server still reads fds on this connection; None from an older one.
        self.sends_fds: Optional[bool] = value.get("sends_fds")

    def __repr__(self) -> str:
        return (
            f"HelloInfo(server={self.server!r}, protocol={self.protocol}, boot_id={self.boot_id}, "
            f"tenant={self.tenant!r}, reap_timeout_seconds={self.reap_timeout_seconds}, "
            f"exit_proof={self.exit_proof!r})"
        )


def parse_trusted_server_uids(value: str, source: str = TRUSTED_SERVER_UIDS_ENV) -> FrozenSet[int]:
    """``"1000,1001"`` → ``{1000, 1001}``; blanks are ignored. Raises ValueError naming
    the bad entry and ``source``."""
    uids = set()
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            uid = int(entry, 10)
        except ValueError:
            uid = -1
        if uid < 0:
            raise ValueError(
                f"{source}={value!r}: {entry!r} is not a uid; expected a comma-separated "
                f"list of non-negative integers, e.g. {source}=1000,1001"
            )
        uids.add(uid)
    return frozenset(uids)


def resolve_trusted_server_uids(
    uids: Optional[Iterable[int]],
) -> Tuple[FrozenSet[int], str]:
    """The uids to trust beyond 0 and our own, and how they were set (for messages):
    ``uids`` when given, else ``$KVWARDEN_TRUSTED_SERVER_UIDS``, else none."""
    if uids is not None:
        checked = set()
        for uid in uids:
            if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
                raise ValueError(
                    f"trusted_server_uids must hold non-negative integer uids, got {uid!r}"
                )
            checked.add(uid)
        return frozenset(checked), f"trusted_server_uids={sorted(checked)}"
    env = os.environ.get(TRUSTED_SERVER_UIDS_ENV)
    if env is None:
        return frozenset(), f"trusted_server_uids not given and {TRUSTED_SERVER_UIDS_ENV} unset"
    return parse_trusted_server_uids(env), f"{TRUSTED_SERVER_UIDS_ENV}={env!r}"


#: What surrounds a token in its file and is not part of it: ASCII whitespace as the
#: server reads it (Rust's ``trim_ascii``: no vertical tab).
TOKEN_WHITESPACE = b" \t\n\x0c\r"


def read_token_file(path: str, source: str = "tcp_token_file") -> bytes:
    """The TCP token: the file's bytes with surrounding ASCII whitespace stripped. Raises
    ValueError naming the file and ``source`` when it cannot be read or is empty."""
    try:
        with open(path, "rb") as f:
            token = f.read().strip(TOKEN_WHITESPACE)
    except OSError as error:
        raise ValueError(
            f"{source}={path!r}: cannot read the TCP token: {error}; the file must hold "
            f"the token of the server's --tcp-token-file"
        ) from error
    if not token:
        raise ValueError(
            f"{source}={path!r} is empty (or only whitespace); it must hold the token of "
            f"the server's --tcp-token-file"
        )
    return token


#: Bytes of each side's nonce in ``auth``.
NONCE_BYTES = 32
#: Bytes of a key id.
KEY_ID_BYTES = 16
#: Bytes of a proof.
PROOF_BYTES = 32


def _mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


class TcpKey:
    """The TCP challenge and response (protocol 3), keyed by the token; the token
    itself never travels.

    1. The client sends ``auth [{"id": key id, "nonce": its nonce}]``; the key id names
       the token without revealing it.
    2. The server answers ``{"nonce": its nonce, "proof": server proof}``; the client
       checks the proof (in constant time) and sends nothing more to a server that
       cannot make it: that one does not hold the token.
    3. The client says ``hello`` with ``{"proof": client proof}``.

    Both proofs cover the key id and both nonces under different labels, so neither
    stands in for the other, and a proof seen on one connection proves nothing on
    another. It authenticates; it does not encrypt.
    """

    KEY_LABEL = b"kvwarden tcp auth key v3"
    ID_LABEL = b"kvwarden tcp key id"
    SERVER_LABEL = b"kvwarden tcp server proof"
    CLIENT_LABEL = b"kvwarden tcp client proof"

    __slots__ = ("_key", "id")

    def __init__(self, token: bytes) -> None:
        self._key = _mac(bytes(token), self.KEY_LABEL)
        #: Names the token without revealing it (16 bytes).
        self.id = _mac(self._key, self.ID_LABEL)[:KEY_ID_BYTES]

    def __repr__(self) -> str:  # the key is as good as the token: never in a log
        return f"TcpKey(id={self.id.hex()})"

    @property
    def key(self) -> bytes:
        """``HMAC-SHA256(token, "kvwarden tcp auth key v3")``: what both sides prove with."""
        return self._key

    def server_proof(self, client_nonce: bytes, server_nonce: bytes) -> bytes:
        """What the server answers ``auth`` with."""
        return _mac(self._key, self.SERVER_LABEL + self.id + client_nonce + server_nonce)

    def client_proof(self, client_nonce: bytes, server_nonce: bytes) -> bytes:
        """What the client says ``hello`` with."""
        return _mac(self._key, self.CLIENT_LABEL + self.id + client_nonce + server_nonce)

    def check_server(self, client_nonce: bytes, server_nonce: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is the server's for these nonces (in constant time)."""
        return hmac.compare_digest(self.server_proof(client_nonce, server_nonce), proof)


def parse_tcp_address(address: Union[str, Tuple[str, int]]) -> Tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``(host, port)`` → ``(host, port)``."""
    if isinstance(address, str):
        host, sep, port_text = address.rpartition(":")
        if not sep or not host:
            raise ValueError(
                f"tcp_address={address!r}: expected HOST:PORT (e.g. 127.0.0.1:7070, "
                f"[::1]:7070), as the server's --tcp"
            )
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            port = int(port_text, 10)
        except ValueError:
            port = -1
    else:
        try:
            host, port = address
        except (TypeError, ValueError):
            raise ValueError(
                f"tcp_address={address!r}: expected 'HOST:PORT' or a (host, port) pair"
            ) from None
        host = str(host)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"tcp_address={address!r}: the port must be 1..65535")
    return host, port


class Connection:
    """A reconnecting connection to the server's Unix socket (or TCP address).

    Connects lazily, says ``hello`` on every new connection, and closes itself on any
    stream error so that the next request starts over on a fresh socket (a restarted
    server is reached this way). ``on_connect`` is called with the hello reply, then
    ``on_attach`` with a ``call(op, args, fds=())`` that makes round trips on the new
    connection (the worker sends ``attach`` there); if it raises, the connection is
    dropped and the request that connected fails with its error.

    Over the Unix socket the server's uid (``SO_PEERCRED``) must be 0, this process's
    own, or one of ``trusted_server_uids`` (None: ``$KVWARDEN_TRUSTED_SERVER_UIDS``);
    otherwise :class:`~kvwarden.errors.UntrustedServer` is raised before anything is
    sent. With ``send_pidfd`` (the default), every ``hello`` carries a pidfd of this
    process (``os.pidfd_open(os.getpid())``, Linux 5.3+), so the server can prove this
    worker's death in any PID namespace; where the platform has none, or the server
    refuses it, hello goes without it.

    With ``tcp_address`` (``"host:port"`` or a pair) it connects over TCP instead: no
    fds, no credential check; on every connect the server proves it holds the token
    read from ``tcp_token_file`` (None: ``$KVWARDEN_TCP_TOKEN_FILE``), then this client
    does in its ``hello`` (``auth``, :class:`TcpKey`): the token itself never travels.
    A server that cannot prove it is sent nothing more and
    :class:`~kvwarden.errors.UntrustedServer` is raised.
    """

    def __init__(
        self,
        socket_path: Optional[str],
        client_name: str,
        on_connect: Optional[Callable[[HelloInfo], None]] = None,
        send_pidfd: bool = True,
        *,
        tcp_address: Optional[Union[str, Tuple[str, int]]] = None,
        tcp_token_file: Optional[str] = None,
        trusted_server_uids: Optional[Iterable[int]] = None,
        on_attach: Optional[Callable[[Call], None]] = None,
        wait_seconds: Optional[float] = None,
    ) -> None:
        if tcp_address is not None and socket_path is not None:
            raise ValueError(
                f"give socket_path ({socket_path!r}) or tcp_address ({tcp_address!r}), not both"
            )
        if tcp_address is None and socket_path is None:
            raise ValueError("a Connection needs a socket_path or a tcp_address")
        self.tcp_address = None if tcp_address is None else parse_tcp_address(tcp_address)
        self.socket_path = socket_path
        if self.tcp_address is not None:
            host, port = self.tcp_address
            self.endpoint = f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"
        else:
            self.endpoint = str(socket_path)
        self.client_name = client_name
        self.send_pidfd = send_pidfd
        #: How long this worker waits for a reply (its request timeout), told to the
        #: server in ``hello`` (``wait_ms``): past it the server starts no copy into
        #: this worker's buffers.
        self.wait_seconds = wait_seconds
        self._on_connect = on_connect
        self._on_attach = on_attach
        self.trusted_server_uids, self._trust_source = resolve_trusted_server_uids(
            trusted_server_uids
        )
        self._token_file: Optional[str] = None
        self._token_source = "tcp_token_file"
        if self.tcp_address is not None:
            if tcp_token_file is not None:
                self._token_file = str(tcp_token_file)
            elif os.environ.get(TCP_TOKEN_FILE_ENV):
                self._token_file = os.environ[TCP_TOKEN_FILE_ENV]
                self._token_source = TCP_TOKEN_FILE_ENV
            if self._token_file is not None:
                read_token_file(self._token_file, self._token_source)  # fail early
        #: The server's uid as ``SO_PEERCRED`` showed it on the current connection.
        self.server_uid: Optional[int] = None
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
        args: Args,
        timeout: float,
        fds: Sequence[int] = (),
    ) -> Tuple[Any, List[int]]:
        """Sends one request and waits for its reply: ``(value, fds)``.

        ``args`` may be a function: it is called once the connection is up and
        attached, so a request names the instance id current at that moment.
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
            if fds and self.tcp_address is not None:
                raise ValueError(f"`{op}` carries fds, which TCP cannot; use the Unix socket")
            payload = args() if callable(args) else args
            request_id = self._take_id()
            self._send(sock, encode_frame(request_id, op, payload), fds, deadline, op)
            try:
                reply = self._read_reply(sock, request_id, deadline, op)
            except RequestTimeout:
                if op in WRITES_WORKER_MEMORY:
                    self._drain_answer(sock, request_id, op)
                raise
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

    def reattach(self, timeout: float) -> None:
        """Runs the ``on_attach`` hook again on the current connection (after a
        ``forbidden`` that says to attach). Without a connection it does nothing: the
        next request connects, and every connect attaches."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout):
            raise RequestTimeout(
                f"`attach` could not be sent within {timeout:g} s: another request on this "
                f"worker's connection was still waiting for the server"
            )
        try:
            if self._sock is None or self._on_attach is None:
                return
            self._attach(self._sock, deadline)
        finally:
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
        sock = self._open_socket(deadline)
        self._sock = sock
        self._buffer.clear()
        self._buffer_start = 0
        self._pending_fds.clear()
        self.connects += 1
        try:
            reply = None
            options: Dict[str, Any] = {}
            if self.wait_seconds is not None:
                options["wait_ms"] = max(int(self.wait_seconds * 1000), 1)
            if self.tcp_address is not None and self._token_file is not None:
                # The server proves it holds the token first; the token never travels.
                options["proof"] = self._auth(sock, deadline)
            pidfd = own_pidfd() if self.send_pidfd and self.tcp_address is None else None
            if pidfd is not None:
                try:
                    reply = self._hello(sock, [{**options, "pidfd_index": 0}], [pidfd], deadline)
                finally:
                    _close_quietly(pidfd)
                if not reply.ok:
                    # A server that cannot check pidfds (or one from before them); the
                    # connection is still good.
                    _, message = _error_fields(reply.value)
                    log.warning(
                        "kvwarden: the server refused this worker's pidfd (%s); carrying on "
                        "without it: its death is then noticed by pid where the server can "
                        "see it, else only by the reap timeout",
                        message,
                    )
                    reply = None
            if reply is None:
                # After a refused pidfd: the hello a server from before the pidfd knows
                # (such a server also predates `wait_ms`). Never over TCP: no pidfd there.
                if pidfd is not None:
                    options.pop("wait_ms", None)
                reply = self._hello(sock, [options] if options else [], [], deadline)
        except BaseException:  # a typed error, or a token file gone unreadable
            self._drop("hello failed")
            raise
        if not reply.ok:
            self._drop("hello refused")
            code, message = _error_fields(reply.value)
            raise server_error(code, f"hello refused: {message}{self._hello_hint(code)}")
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
        if self._on_attach is not None:
            self._attach(sock, deadline)
        return sock

    def _attach(self, sock: socket.socket, deadline: float) -> None:
        """Runs ``on_attach`` on ``sock``; any failure drops the connection (it must
        not be used unattached) and is raised."""
        assert self._on_attach is not None

        def call(op: str, args: Sequence[Any], fds: Sequence[int] = ()) -> Any:
            request_id = self._take_id()
            self._send(sock, encode_frame(request_id, op, args), fds, deadline, op)
            reply = self._read_reply(sock, request_id, deadline, op)
            for fd in reply.fds:
                _close_quietly(fd)
            if not reply.ok:
                code, message = _error_fields(reply.value)
                raise server_error(code, message)
            return reply.value

        try:
            self._on_attach(call)
        except BaseException as error:
            self._drop("attach failed")
            if isinstance(error, KvwardenError):
                error.during_attach = True  # type: ignore[attr-defined]
            raise

    def _open_socket(self, deadline: float) -> socket.socket:
        """A connected socket; over the Unix socket only once the server's uid passed
        :meth:`_check_server_uid` (nothing has been sent yet)."""
        timeout = max(deadline - time.monotonic(), 0.001)
        if self.tcp_address is not None:
            try:
                sock = socket.create_connection(self.tcp_address, timeout)
            except OSError as error:
                raise ConnectionLost(
                    f"cannot connect to the kvwarden server at {self.endpoint}: {error}; is "
                    f"`kvwarden serve --tcp {self.endpoint[4:]}` running and is the address "
                    f"right?"
                ) from error
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.endpoint)
        except OSError as error:
            sock.close()
            raise ConnectionLost(
                f"cannot connect to the kvwarden socket {self.endpoint!r}: {error}; "
                f"is `kvwarden serve --socket {self.endpoint}` running and is the path "
                f"right?"
            ) from error
        try:
            self._check_server_uid(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _check_server_uid(self, sock: socket.socket) -> None:
        """Refuses a server whose uid is not 0, ours, or a trusted one: before any fd
        (our pidfd, memfds) reaches a process that could then act on it."""
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", creds)
        except OSError as error:
            raise UntrustedServer(
                f"cannot read the credentials (SO_PEERCRED) of the server on "
                f"{self.endpoint!r}: {error}; refusing to send it anything",
                socket_path=self.endpoint,
            ) from error
        self.server_uid = uid
        own = os.getuid()
        if uid in (0, own) or uid in self.trusted_server_uids:
            return
        raise UntrustedServer(
            f"refusing the kvwarden server on {self.endpoint!r}: it runs as uid {uid} "
            f"(pid {pid}), and this worker (uid {own}) trusts only uid 0, its own uid and "
            f"the uids it is configured to trust ({self._trust_source}); nothing was sent "
            f"to it. If that server is yours, add {uid} to Worker(trusted_server_uids=[...]) "
            f"or to {TRUSTED_SERVER_UIDS_ENV} (e.g. {TRUSTED_SERVER_UIDS_ENV}={uid}); "
            f"otherwise another user's process is listening on this path: check the "
            f"socket path and the server",
            socket_path=self.endpoint,
            uid=uid,
        )

    def _hello_hint(self, code: str) -> str:
        if code != "forbidden" or self.tcp_address is None:
            return ""
        if self._token_file is None:
            return (
                f"; over TCP the server needs its token: pass tcp_token_file=PATH (or set "
                f"{TCP_TOKEN_FILE_ENV}) to a file holding the token of its --tcp-token-file"
            )
        return (
            f"; the server refused this client's proof of the token read from "
            f"{self._token_file!r} ({self._token_source}), after it proved it holds that "
            f"token itself"
        )

    def _auth(self, sock: socket.socket, deadline: float) -> bytes:
        """``auth`` over TCP: the server proves it holds the token (read from the file
        on every connect: a rotated file is picked up by the next one) for a fresh
        nonce of ours; returns this client's proof for ``hello``. A server that cannot
        prove it gets nothing more: the connection is dropped and
        :class:`~kvwarden.errors.UntrustedServer` raised. The caller drops the
        connection on any error raised here."""
        assert self._token_file is not None
        key = TcpKey(read_token_file(self._token_file, self._token_source))
        nonce = secrets.token_bytes(NONCE_BYTES)
        request_id = self._take_id()
        args = [{"id": key.id, "nonce": nonce}]
        self._send(sock, encode_frame(request_id, "auth", args), (), deadline, "auth")
        reply = self._read_reply(sock, request_id, deadline, "auth")
        for fd in reply.fds:
            _close_quietly(fd)
        if not reply.ok:
            self._drop("auth refused")
            code, message = _error_fields(reply.value)
            raise server_error(code, f"auth refused: {message}{self._auth_hint(code)}")
        value = reply.value
        server_nonce = value.get("nonce") if isinstance(value, dict) else None
        proof = value.get("proof") if isinstance(value, dict) else None
        if not (
            isinstance(server_nonce, bytes)
            and len(server_nonce) == NONCE_BYTES
            and isinstance(proof, bytes)
            and len(proof) == PROOF_BYTES
        ):
            why = f"`auth` answered {value!r:.200}, not {{nonce: bin 32, proof: bin 32}}"
        elif not key.check_server(nonce, server_nonce, proof):
            why = "its proof is wrong"
        else:
            return key.client_proof(nonce, server_nonce)
        self._drop("the server could not prove it holds the token")
        raise UntrustedServer(
            f"refusing the server at {self.endpoint}: it could not prove it holds the token "
            f"read from {self._token_file!r} ({self._token_source}) ({why}), so it is not "
            f"the kvwarden server configured with that token: another process may be "
            f"listening on this port. The token was not sent, nor anything after `auth`. "
            f"Check the address, and that the server's --tcp-token-file holds the same "
            f"token",
            socket_path=self.endpoint,
        )

    def _auth_hint(self, code: str) -> str:
        if code == "forbidden":
            return (
                f"; the token read from {self._token_file!r} ({self._token_source}) is not "
                f"one the server accepts"
            )
        if code == "unknown_op":
            return (
                f"; the server is older than this client (protocol {PROTOCOL_VERSION}): "
                f"protocol 2 takes the token in `hello`, which this client no longer sends "
                f"(it proves it holds the token with `auth`); upgrade the server"
            )
        return ""

    def _hello(
        self, sock: socket.socket, options: List[Any], fds: Sequence[int], deadline: float
    ) -> _Reply:
        request_id = self._take_id()
        args = [PROTOCOL_VERSION, self.client_name, *options]
        self._send(sock, encode_frame(request_id, "hello", args), fds, deadline, "hello")
        return self._read_reply(sock, request_id, deadline, "hello")

    def _drain_answer(self, sock: socket.socket, request_id: int, op: str) -> None:
        """After a timed-out request that writes into the worker's memory: waits up to
        :data:`WRITE_DRAIN_SECONDS` more for its answer. The server starts no copy into
        the destination past this connection's ``wait_ms``, and answers once a copy
        already running has ended: once the answer came (or the connection is gone),
        the destination is the worker's again. Without it, the connection is dropped,
        which ends it too."""
        try:
            reply = self._read_reply(sock, request_id, time.monotonic() + WRITE_DRAIN_SECONDS, op)
        except RequestTimeout:
            self._drop(f"`{op}` timed out and its answer did not come")
            return
        except KvwardenError:
            return
        for fd in reply.fds:
            _close_quietly(fd)

    def _drop(self, why: str) -> None:
        if self._sock is not None:
            log.debug("kvwarden: dropping connection to %s: %s", self.endpoint, why)
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
                f"`{op}`: the connection to {self.endpoint!r} broke: {error}"
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
                    f"`{op}`: the connection to {self.endpoint!r} broke: {error}"
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
