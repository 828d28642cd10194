"""The inference-engine worker's client: registrations, transfers and the heartbeat.

One :class:`Worker` per engine process (per GPU rank). Its instance id is drawn from a
fresh UUID, so a restarted process can never bind to a dead one's state on the server,
together with a 32-byte secret (``secrets.token_bytes``): the worker ``attach``-es the
pair on every connection before naming the instance, so only the holder of the secret
can act as that instance (since protocol 2). An id another process bound first (a squatter)
is answered ``forbidden``: the worker then draws a fresh id and secret, counts it
(:attr:`Worker.identity_changes`) and re-registers under the new id.

Threads: the engine calls the worker from its own thread(s); a daemon heartbeat thread,
started on the first store/retrieve, pings the server every ``interval`` and runs the
recovery. Both share one :class:`~kvwarden.wire.Connection` whose FIFO lock serializes
round trips, so the server sees this worker's requests in issue order (see ``wire.py``).
A ping waits for its turn at most ``interval``; that wait counts in its timeout.

Health (``Worker.healthy``, a ``threading.Event``) follows the core's heartbeat rules
exactly (``heartbeat.py``). While it is clear, stores are skipped and retrieves report a
miss at once: the engine recomputes instead of waiting on a server that may not hold
this worker's buffers any more.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

from . import __version__
from .buffers import (
    FD_BUFFERS,
    Buffer,
    CudaIpcBuffer,
    CudaVmmBuffer,
    EnginePool,
    MemfdBuffer,
    Slot,
)
from .errors import (
    BadArgs,
    ConnectionLost,
    Forbidden,
    Internal,
    KvwardenError,
    NotReady,
    NotRegistered,
    Overloaded,
    ProtocolViolation,
    RequestTimeout,
    UnknownOp,
)
from .heartbeat import (
    DEFAULT_INTERVAL_SECONDS,
    Heartbeat,
    HeartbeatAction,
    PingReply,
    reap_timeout_floor_warning,
    validate_interval,
)
from .outage import Outage
from .wire import PROTOCOL_VERSION, Args, Call, Connection, HelloInfo

log = logging.getLogger("kvwarden")

T = TypeVar("T")

#: Errors after which a transfer reports failure and the engine carries on (recomputes);
#: anything else (bad_args, forbidden, unavailable) is a bug or a misconfiguration and
#: is raised.
_TRANSIENT = (ConnectionLost, RequestTimeout, NotReady, Overloaded, Internal, ProtocolViolation)

INSTANCE_ID_MAX = (1 << 63) - 1

#: The most items one ``store_batch`` / ``retrieve_batch`` carries (the server's limit).
MAX_BATCH_ITEMS = 1024

#: Bytes of the secret drawn with each instance id (the server accepts 16..=64).
SECRET_BYTES = 32

#: Fresh ids tried in a row when ``attach`` keeps answering ``forbidden``: one squatted
#: id is an accident or an attack; a fresh random 63-bit id refused again means the
#: server refuses this caller whatever the id.
MAX_ATTACH_ATTEMPTS = 3


def default_socket_path() -> str:
    """The server's default socket: ``$XDG_RUNTIME_DIR/kvwarden.sock``, else
    ``/tmp/kvwarden-<uid>/kvwarden.sock`` (the same rule as ``kvwarden serve``, which
    creates that directory with mode 0700)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "kvwarden.sock")
    return f"/tmp/kvwarden-{os.getuid()}/kvwarden.sock"


def new_instance_id() -> int:
    """The low 63 bits of a fresh UUID4: OS entropy, never a PID (PIDs get reused)."""
    return uuid.uuid4().int & INSTANCE_ID_MAX


class KvEvents(NamedTuple):
    """A page of ``kv_events``: what entered (``True``) and left (``False``) a tier
    (``"l1"`` or ``"l2"``) in the worker's tenant, in order, as ``(stored, key, tier,
    meta)``: ``meta`` is the key's description (``describe_keys``) or None.
    With ``resync``, withdraw everything announced before applying ``events`` (they
    begin with every key L1 holds now). Pass ``cursor`` to the next call; call again at
    once while ``more``."""

    cursor: bytes
    resync: bool
    events: List[Tuple[bool, bytes, str, Optional[bytes]]]
    more: bool


class Identity(NamedTuple):
    """Who a worker is to the server: an instance id and the secret that proves it."""

    instance_id: int
    secret: bytes

    @classmethod
    def fresh(cls) -> "Identity":
        """A new id and a new secret, both from OS entropy."""
        return cls(new_instance_id(), secrets.token_bytes(SECRET_BYTES))

    def __repr__(self) -> str:  # never print the secret
        return f"Identity(instance_id={self.instance_id}, secret=<{len(self.secret)} bytes>)"


class Worker:
    """A worker's registrations on one kvwarden server, kept alive by a heartbeat.

    Typical life: construct at engine start-up, ``register_kv_cache`` (or
    ``register_engine_driven``), then ``store``/``retrieve`` per request, and
    ``shutdown()`` at exit. Nothing is sent until the first call.

    ``heartbeat_interval_seconds`` is the delay between a reply and the next ping and a
    ping's timeout; keep 3 × interval within the server's reap timeout.
    ``request_timeout_seconds`` bounds every other request. ``socket_path`` defaults
    to the server's default (:func:`default_socket_path`).

    ``send_pidfd`` (default True): each connection's ``hello`` carries a pidfd of this
    process, so the server frees this worker's state within milliseconds of its death
    even where it cannot see its pid (a server in another container without
    ``hostPID``). False behaves as clients before it did: the death is proven by pid
    where the server sees it, else noticed only at the reap timeout.

    ``trusted_server_uids``: over the Unix socket the worker checks the server's uid
    (``SO_PEERCRED``) before it sends anything, its fds above all; uid 0 and this
    process's own uid are trusted, and so are these (None: the comma-separated
    ``$KVWARDEN_TRUSTED_SERVER_UIDS``). Another uid raises
    :class:`~kvwarden.errors.UntrustedServer`.

    ``tcp_address`` (``"host:port"`` or a pair): talk to the server's ``--tcp``
    listener instead of the Unix socket (no memfd buffers, no engine-driven mode, no
    process-exit proof). ``tcp_token_file`` (None: ``$KVWARDEN_TCP_TOKEN_FILE``) holds
    the token of the server's ``--tcp-token-file`` (surrounding whitespace stripped);
    the token itself never travels: on every connect the server proves it holds it
    (``auth``, a challenge on a fresh nonce), then the worker proves it in its
    ``hello``. A server that cannot prove it is sent nothing more:
    :class:`~kvwarden.errors.UntrustedServer`, naming the file.
    """

    def __init__(
        self,
        socket_path: Optional[str] = None,
        *,
        heartbeat_interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        request_timeout_seconds: float = 30.0,
        client_name: Optional[str] = None,
        send_pidfd: bool = True,
        trusted_server_uids: Optional[Iterable[int]] = None,
        tcp_address: Optional[Union[str, Tuple[str, int]]] = None,
        tcp_token_file: Optional[str] = None,
    ) -> None:
        if tcp_address is not None:
            if socket_path is not None:
                raise ValueError(
                    f"Worker: give socket_path ({socket_path!r}) or tcp_address "
                    f"({tcp_address!r}), not both"
                )
            self.socket_path: Optional[str] = None
        else:
            self.socket_path = default_socket_path() if socket_path is None else str(socket_path)
        # A Worker copied into a forked child would share this id and this socket with
        # its parent: exactly the aliasing uuid-derived ids exist to prevent.
        self._pid = os.getpid()
        self._identity = Identity.fresh()
        #: How many times ``attach`` found this worker's id bound to another secret and
        #: the worker moved to a fresh id (for tests and metrics; each one is a WARNING).
        self.identity_changes = 0
        self.interval = validate_interval(heartbeat_interval_seconds)
        if not request_timeout_seconds > 0:
            raise ValueError(
                f"request_timeout_seconds must be > 0, got {request_timeout_seconds!r}"
            )
        self.request_timeout = float(request_timeout_seconds)
        #: Set while the worker may trust its registrations; see the module docs.
        self.healthy = threading.Event()
        self.healthy.set()

        self._conn = Connection(
            self.socket_path,
            client_name or f"kvwarden-python/{__version__}",
            on_connect=self._on_connect,
            send_pidfd=send_pidfd,
            tcp_address=tcp_address,
            tcp_token_file=tcp_token_file,
            trusted_server_uids=trusted_server_uids,
            on_attach=self._attach,
            wait_seconds=self.request_timeout,
        )
        # The heartbeat's own connection (attached like the worker's; no pidfd, no
        # fds): a ping never waits behind a transfer the server holds, e.g. a retrieve
        # reading through a slow L2 (failure mode 61).
        self._ping_conn = Connection(
            self.socket_path,
            client_name or f"kvwarden-python/{__version__}",
            send_pidfd=False,
            tcp_address=tcp_address,
            tcp_token_file=tcp_token_file,
            trusted_server_uids=trusted_server_uids,
            on_attach=self._attach,
        )
        #: Where the server is: the socket path, or ``tcp:HOST:PORT``.
        self.endpoint = self._conn.endpoint
        #: Whether the server answers: one WARNING when it stops, one when it is back.
        self.outage = Outage(self.endpoint)
        self._hb = Heartbeat(self.interval)
        self._hb_lock = threading.Lock()  # guards _hb, _thread and the health edge
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._shut_down = False
        self._warned_boot_ids: set = set()
        self._bad_args_logged = False
        #: How many recoveries ran, and how many succeeded (for tests and metrics).
        self.recoveries = 0
        self.recoveries_ok = 0

        # What recovery re-registers, in this order.
        self._kv: Optional[Tuple[List[Buffer], str, int]] = None
        self._engine: Optional[Tuple[str, int]] = None
        self._blend: Optional[Dict[str, Any]] = None
        self._pool: Optional[EnginePool] = None
        self._reg_lock = threading.Lock()  # registrations vs. recovery

        log.info(
            "kvwarden worker created: instance_id=%d socket=%s heartbeat_interval=%gs",
            self.instance_id,
            self.endpoint,
            self.interval,
        )
        warning = reap_timeout_floor_warning(self.interval)
        if warning is not None:
            log.warning("kvwarden: %s", warning)

    @property
    def instance_id(self) -> int:
        """The id this worker acts as. It changes only when ``attach`` finds it bound to
        another secret (:attr:`identity_changes`); log it, never derive state from it."""
        return self._identity.instance_id

    # -- registrations --------------------------------------------------------------

    def register_kv_cache(
        self, buffers: Sequence[Buffer], model_name: str, world_size: int = 1
    ) -> str:
        """Registers the buffers the server copies KV data into and out of.

        ``buffers`` are :class:`MemfdBuffer` (host memory), :class:`CudaIpcBuffer`
        (``cudaMalloc`` memory) and/or :class:`CudaVmmBuffer` (``cuMemCreate`` memory);
        the fds of memfd and VMM buffers go along as ``SCM_RIGHTS``, so those need the
        Unix socket. The worker keeps the buffers (and their fds) to register them again
        after the server lost them. Returns the outcome, ``"created"`` or
        ``"refreshed"``. Raises a typed :class:`KvwardenError` (an engine should not
        start serving with its cache unregistered).
        """
        buffers = list(buffers)
        if not buffers:
            raise ValueError("register_kv_cache needs at least one buffer, got none")
        for position, buffer in enumerate(buffers):
            if not isinstance(buffer, (MemfdBuffer, CudaIpcBuffer, CudaVmmBuffer)):
                raise TypeError(
                    f"buffers[{position}] must be a MemfdBuffer, a CudaIpcBuffer or a "
                    f"CudaVmmBuffer, got {type(buffer).__name__}"
                )
            if isinstance(buffer, FD_BUFFERS) and self._conn.tcp_address is not None:
                raise ValueError(
                    f"buffers[{position}] is a {type(buffer).__name__}, whose fd cannot "
                    f"travel over TCP ({self.endpoint}); connect over the Unix socket "
                    f"(socket_path=...) or register CudaIpcBuffers"
                )
        with self._reg_lock:
            if self._kv is not None:
                raise KvwardenError(
                    "register_kv_cache: this worker already registered its KV cache; the "
                    'server would keep the first buffers ("refreshed"). Call '
                    "unregister_kv_cache() first to register different ones",
                    code="already_registered",
                )
            outcome = self._send_kv_registration(buffers, model_name, world_size)
            self._kv = (buffers, model_name, world_size)
        return outcome

    def unregister_kv_cache(self) -> bool:
        """Frees the KV-cache registration now; False when the server did not hold it."""
        with self._reg_lock:
            self._kv = None
            value, _ = self._request("unregister_kv_cache", self._named())
        return bool(value)

    def register_engine_driven(self, model_name: str, world_size: int = 1) -> EnginePool:
        """Registers for engine-driven transfers and maps the server's L1 pool.

        The reply carries the pool's memfd; the worker then copies KV data in and out of
        slots itself (``prepare_store``/``commit_store``, ``prepare_retrieve``/
        ``commit_retrieve``). Returns the mapped pool.
        """
        with self._reg_lock:
            pool = self._send_engine_registration(model_name, world_size)
            self._engine = (model_name, world_size)
        return pool

    def unregister_engine_driven(self) -> bool:
        """Frees the engine-driven registration; False when the server did not hold it."""
        with self._reg_lock:
            self._engine = None
            value, _ = self._request("unregister_engine_driven", self._named())
        return bool(value)

    def register_blend(self, rotary_dim: int, max_positions: int, base: float) -> bool:
        """Registers CacheBlend rope parameters (dropped by the server with the instance's
        last registration, and re-sent by recovery)."""
        rope = {
            "rotary_dim": int(rotary_dim),
            "max_positions": int(max_positions),
            "base": float(base),
        }
        with self._reg_lock:
            value, _ = self._request("register_blend", self._named(rope))
            self._blend = rope
        return bool(value)

    @property
    def pool(self) -> Optional[EnginePool]:
        """The mapped L1 pool (engine-driven), replaced when a recovery maps a new one."""
        return self._pool

    # -- server-driven transfers ----------------------------------------------------

    def store(
        self, key: bytes, buffer: int = 0, offset: int = 0, nbytes: Optional[int] = None
    ) -> bool:
        """Asks the server to copy ``[offset, offset + nbytes)`` of buffer ``buffer``
        into L1 under ``key``. True when stored. False when skipped (unhealthy), when L1
        is full of pinned data, or on a transient failure: the engine just goes on.
        ``nbytes`` defaults to the rest of the buffer."""
        if self._shut_down:
            return False
        kv = self._require_kv("store")
        if not 0 <= buffer < len(kv[0]):
            raise IndexError(
                f"store: buffer index {buffer} out of range; {len(kv[0])} buffers are registered"
            )
        if nbytes is None:
            nbytes = kv[0][buffer].nbytes - offset
        args = self._named(bytes(key), buffer, offset, nbytes)
        return bool(self._transfer("store", args, False, start=True))

    def retrieve(
        self, key: bytes, buffer: int = 0, offset: int = 0, *, nbytes: int
    ) -> Optional[int]:
        """Asks the server to copy L1's bytes for ``key`` into ``[offset, offset +
        nbytes)`` of buffer ``buffer``. ``nbytes`` (required) is the destination block's
        length: a value stored with another length is a miss and nothing is written.
        Returns ``nbytes`` when copied, or None on a miss, while unhealthy or on a
        transient failure (the engine recomputes)."""
        if self._shut_down:
            return None
        kv = self._require_kv("retrieve")
        if not 0 <= buffer < len(kv[0]):
            raise IndexError(
                f"retrieve: buffer index {buffer} out of range; {len(kv[0])} buffers are registered"
            )
        _check_nbytes("retrieve", nbytes)
        value = self._transfer(
            "retrieve", self._named(bytes(key), buffer, offset, nbytes), None, start=True
        )
        return None if value is None else int(value)

    def store_batch(self, items: Sequence[Tuple[bytes, int, int, Optional[int]]]) -> List[bool]:
        """Many :meth:`store` calls in one request (at most :data:`MAX_BATCH_ITEMS`):
        each item is ``(key, buffer, offset, nbytes)`` (``nbytes`` None: the rest of the
        buffer), each answer what ``store`` would have answered. All False when skipped
        (unhealthy) or on a transient failure. A bad item (a buffer bound, ``nbytes`` above
        a slot) is :class:`~kvwarden.errors.BadArgs` naming its index; nothing is copied."""
        if self._shut_down:
            return [False] * len(items)
        kv = self._require_kv("store_batch")
        wire: List[List[Any]] = []
        for index, (key, buffer, offset, nbytes) in enumerate(items):
            if not 0 <= buffer < len(kv[0]):
                raise IndexError(
                    f"store_batch: items[{index}]: buffer index {buffer} out of range; "
                    f"{len(kv[0])} buffers are registered"
                )
            if nbytes is None:
                nbytes = kv[0][buffer].nbytes - offset
            wire.append([bytes(key), buffer, offset, nbytes])
        _check_batch_size("store_batch", len(wire))
        failure = [False] * len(wire)
        value = self._transfer("store_batch", self._named(wire), failure, start=True)
        if value is failure:
            return failure
        return [bool(answer) for answer in _batch_answers("store_batch", value, len(wire))]

    def retrieve_batch(self, items: Sequence[Tuple[bytes, int, int, int]]) -> List[Optional[int]]:
        """Many :meth:`retrieve` calls in one request (at most :data:`MAX_BATCH_ITEMS`):
        each item is ``(key, buffer, offset, nbytes)``, each answer ``nbytes`` when
        copied or None on a miss (a value stored with another length is a miss). All
        None while unhealthy or on a transient failure (the engine recomputes). A bad
        item is :class:`~kvwarden.errors.BadArgs` naming its index; nothing is copied."""
        if self._shut_down:
            return [None] * len(items)
        kv = self._require_kv("retrieve_batch")
        wire: List[List[Any]] = []
        for index, item in enumerate(items):
            if len(item) != 4:
                raise TypeError(
                    f"retrieve_batch: items[{index}] = {tuple(item)!r:.120} has {len(item)} "
                    f"fields; each item is (key, buffer, offset, nbytes): nbytes, the "
                    f"destination's length, is required since protocol 2"
                )
            key, buffer, offset, nbytes = item
            if not 0 <= buffer < len(kv[0]):
                raise IndexError(
                    f"retrieve_batch: items[{index}]: buffer index {buffer} out of range; "
                    f"{len(kv[0])} buffers are registered"
                )
            _check_nbytes(f"retrieve_batch: items[{index}]", nbytes)
            wire.append([bytes(key), buffer, offset, nbytes])
        _check_batch_size("retrieve_batch", len(wire))
        failure: List[Optional[int]] = [None] * len(wire)
        value = self._transfer("retrieve_batch", self._named(wire), failure, start=True)
        if value is failure:
            return failure
        return [
            None if answer is None else int(answer)
            for answer in _batch_answers("retrieve_batch", value, len(wire))
        ]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` L1 holds; 0 while unhealthy or on a transient failure
        (a retrieve would not be attempted anyway)."""
        if self._shut_down or not self.healthy.is_set():
            return 0
        try:
            value, _ = self._request("lookup", [[bytes(k) for k in keys]])
        except _TRANSIENT as error:
            self.outage.failed("lookup (reporting 0 hits)", error)
            return 0
        self.outage.answered()
        return int(value)

    def kv_events(self, cursor: bytes = b"", max_events: int = 1024) -> KvEvents:
        """What entered and left L1 in this worker's tenant since ``cursor`` (empty: a
        new reader, which starts with a resync): see ``kv_events`` in docs/protocol.md.
        Raises on a transient failure: a reader keeps its cursor and asks again."""
        value, _ = self._request("kv_events", [bytes(cursor), int(max_events)])
        self.outage.answered()
        return KvEvents(
            cursor=bytes(value["cursor"]),
            resync=bool(value["resync"]),
            events=[
                (bool(stored), bytes(key), str(tier), None if meta is None else bytes(meta))
                for stored, key, tier, meta in value["events"]
            ],
            more=bool(value["more"]),
        )

    def describe_keys(self, items: Sequence[Tuple[bytes, bytes]]) -> List[bool]:
        """Attaches a description (at most 2048 bytes) to each key L1 holds in this
        worker's tenant; ``kv_events`` readers get it with the key. One answer per item:
        False where L1 does not hold the key."""
        wire = [[bytes(key), bytes(meta)] for key, meta in items]
        value, _ = self._request("describe_keys", [wire])
        self.outage.answered()
        return [bool(answer) for answer in value]

    # -- engine-driven transfers ----------------------------------------------------

    def prepare_store(self, key: bytes) -> Optional[Slot]:
        """Reserves a pool slot for ``key``: write the KV bytes into ``slot.view``, then
        ``commit_store``. None when there is nothing to write: already stored, skipped
        while unhealthy, or a transient failure."""
        return self._prepare("prepare_store", key)

    def _prepare(self, op: str, key: bytes) -> Optional[Slot]:
        """``prepare_store`` / ``prepare_retrieve``: the slot the server reserved or
        pinned, or None (nothing to do, unhealthy, or a transient failure)."""
        if self._shut_down:
            return None
        pool = self._require_pool(op)
        value = self._transfer(op, self._named(bytes(key)), None, start=True)
        if value is None:
            return None
        return Slot(
            self._pool or pool,
            bytes(key),
            int(value["offset"]),
            int(value["nbytes"]),
            value.get("slot"),
        )

    def commit_store(self, key: bytes, nbytes: int) -> bool:
        """Publishes the reservation of ``key`` with ``nbytes`` bytes written. Sent even
        while unhealthy: it ends a store begun while healthy, and a freed instance's
        reservation is discarded by the server anyway."""
        if self._shut_down:
            return False
        self._require_pool("commit_store")
        value = self._transfer(
            "commit_store",
            self._named(bytes(key), int(nbytes)),
            False,
            start=True,
            gate=False,
        )
        return bool(value)

    def prepare_retrieve(self, key: bytes) -> Optional[Slot]:
        """Pins the slot holding ``key``: read ``slot.view``, then ``commit_retrieve``.
        None on a miss, while unhealthy, or on a transient failure."""
        return self._prepare("prepare_retrieve", key)

    def commit_retrieve(self, key: bytes) -> bool:
        """Unpins the slot of ``key``. Sent even while unhealthy, so pins never linger."""
        if self._shut_down:
            return False
        self._require_pool("commit_retrieve")
        value = self._transfer(
            "commit_retrieve", self._named(bytes(key)), False, start=True, gate=False
        )
        return bool(value)

    # -- misc -----------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """The server's status map (the same as HTTP ``/status``)."""
        value, _ = self._request("status", [])
        return value

    def ping(self) -> bool:
        """One ping outside the heartbeat (does not touch health): is this instance
        registered on the server?"""
        value, _ = self._request("ping", self._named(), timeout=self.interval)
        return bool(value)

    @property
    def server(self) -> Optional[HelloInfo]:
        """What the server said in ``hello`` on the current connection."""
        return self._conn.hello

    @property
    def server_uid(self) -> Optional[int]:
        """The server's uid as ``SO_PEERCRED`` showed it on the last Unix-socket connect
        (None before one, and over TCP)."""
        return self._conn.server_uid

    def is_healthy(self) -> bool:
        """Whether stores and retrieves are attempted now."""
        return self.healthy.is_set()

    def heartbeat_started(self) -> bool:
        """Whether the heartbeat thread was started (by the first store/retrieve)."""
        with self._hb_lock:
            return self._thread is not None

    def shutdown(self) -> None:
        """Clean exit: stop the heartbeat, then unregister, then close. Idempotent.

        The heartbeat is stopped and joined first, so a cycle still running cannot
        recover (re-register) after the unregister, nor change health: no ghost
        context is ever re-created on the server.
        """
        with self._hb_lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._hb.stop()
            thread = self._thread
        self._wake.set()
        if thread is not None:
            # A running cycle ends within one request timeout; it checks stop before
            # every step, and the FIFO connection orders its last request before ours.
            thread.join(self.interval + self.request_timeout + 1.0)
            if thread.is_alive():
                log.warning(
                    "kvwarden: the heartbeat thread of instance %d did not stop in time; "
                    "unregistering anyway",
                    self.instance_id,
                )
        with self._reg_lock:
            for op, held in (
                ("unregister_kv_cache", self._kv is not None),
                ("unregister_engine_driven", self._engine is not None),
            ):
                if not held:
                    continue
                try:
                    self._request(op, self._named())
                except KvwardenError as error:
                    log.warning(
                        "kvwarden: %s of instance %d failed at shutdown: %s",
                        op,
                        self.instance_id,
                        error,
                    )
            self._kv = None
            self._engine = None
            self._blend = None
            if self._pool is not None:
                self._pool.close()
                self._pool = None
        self._conn.close()
        self._ping_conn.close()
        log.info("kvwarden worker %d shut down", self.instance_id)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ------------------------------------------------------------------

    def _named(self, *rest: Any) -> Callable[[], List[Any]]:
        """The arguments of an op naming this instance: ``[instance_id, *rest]``, the id
        read when the request is sent, i.e. after the connection attached it (an
        ``attach`` answered ``forbidden`` on a reconnect changes it)."""
        return lambda: [self._identity.instance_id, *rest]

    def _request(
        self,
        op: str,
        args: Args,
        fds: Sequence[int] = (),
        timeout: Optional[float] = None,
        conn: Optional[Connection] = None,
    ) -> Tuple[Any, List[int]]:
        """One round trip (on the worker's connection, or ``conn``). A ``forbidden``
        that says to attach (the server does not count this connection as attached) is
        answered by attaching again on this connection and retrying once; any other
        ``forbidden`` is raised."""
        self._check_process(op)
        limit = self.request_timeout if timeout is None else timeout
        conn = self._conn if conn is None else conn
        try:
            return conn.request(op, args, limit, fds)
        except Forbidden as error:
            # Not one the attach itself got (that one has been dealt with already).
            if "attach" not in error.message or getattr(error, "during_attach", False):
                raise
            log.warning(
                "kvwarden: `%s` of instance %d was answered forbidden (%s); attaching again "
                "and retrying once",
                op,
                self.instance_id,
                error.message,
            )
        conn.reattach(limit)
        return conn.request(op, args, limit, fds)

    def _attach(self, call: Call) -> None:
        """The ``on_attach`` hook: ``attach [instance_id, secret]`` on a new connection,
        before anything names the instance. ``forbidden`` (the id is bound to another
        secret or tenant) → a fresh id and secret, a WARNING, :attr:`identity_changes`
        counted, attach again; the registrations are then replayed under the new id by
        the recovery (:meth:`_identity_changed`)."""
        for _ in range(MAX_ATTACH_ATTEMPTS):
            identity = self._identity
            try:
                value = call("attach", [identity.instance_id, identity.secret])
            except Forbidden as error:
                fresh = Identity.fresh()
                self._identity = fresh
                self.identity_changes += 1
                log.warning(
                    "kvwarden: the server refused instance id %d to this worker (%s): another "
                    "process holds that id with another secret. Carrying on as instance %d "
                    "(identity change #%d)%s",
                    identity.instance_id,
                    error.message,
                    fresh.instance_id,
                    self.identity_changes,
                    "; re-registering under it" if self._holds_registrations() else "",
                )
                self._identity_changed()
                continue
            except UnknownOp as error:
                server = self.server.server if self.server is not None else "?"
                raise UnknownOp(
                    f"the server {server!r} at {self.endpoint} does not know `attach` "
                    f"({error.message}): it speaks protocol 1 and this client protocol "
                    f"{PROTOCOL_VERSION}; "
                    f"upgrade the server"
                ) from error
            outcome = _outcome(value, "attach")
            if outcome not in ("claimed", "proven"):
                raise ProtocolViolation(
                    f'attach: expected outcome "claimed" or "proven", got {outcome!r:.100}'
                )
            log.debug("kvwarden: instance %d attached: %s", identity.instance_id, outcome)
            return
        raise Forbidden(
            f"attach: {MAX_ATTACH_ATTEMPTS} fresh instance ids in a row were refused by the "
            f"server at {self.endpoint}; it refuses this worker whatever the id (see the "
            f"server's log)"
        )

    def _holds_registrations(self) -> bool:
        return self._kv is not None or self._engine is not None or self._blend is not None

    def _identity_changed(self) -> None:
        """The instance id changed (called on the connection being set up, under its
        lock): what this worker registered was under the old id, so it is not held any
        more. Health clears and the heartbeat recovers at once, exactly as after a
        transfer answered ``not_registered``; the recovery re-registers under the new
        id (requests read the id when sent)."""
        if not self._holds_registrations():
            return
        self._start_heartbeat()
        with self._hb_lock:
            if self._hb.is_stopped():
                return
            self._hb.on_not_registered(time.monotonic())
            self._sync_health_locked()
        self._wake.set()

    def _check_process(self, op: str) -> None:
        if os.getpid() != self._pid:
            raise KvwardenError(
                f"{op}: this Worker (instance {self.instance_id}) was created in process "
                f"{self._pid} and is used in process {os.getpid()} after a fork; create "
                f"one Worker in each worker process, after the fork",
                code="forked",
            )

    def _require_kv(self, op: str) -> Tuple[List[Buffer], str, int]:
        kv = self._kv
        if kv is None:
            raise KvwardenError(
                f"{op}: no KV cache registered on this worker; call register_kv_cache() at "
                f"start-up first",
                code="not_registered_locally",
            )
        return kv

    def _require_pool(self, op: str) -> EnginePool:
        pool = self._pool
        if pool is None or self._engine is None:
            raise KvwardenError(
                f"{op}: this worker is not registered engine-driven; call "
                f"register_engine_driven() at start-up first",
                code="not_registered_locally",
            )
        return pool

    def _transfer(
        self, op: str, args: List[Any], failure: T, *, start: bool, gate: bool = True
    ) -> Any:
        """One transfer with the health rules: skipped while unhealthy (``gate``), and a
        ``not_registered`` answer triggers the recovery. Transient failures → ``failure``."""
        if self._shut_down:
            log.warning("kvwarden: %s after shutdown() is skipped", op)
            return failure
        self._check_process(op)
        if start:
            self._start_heartbeat()
        if gate and not self.healthy.is_set():
            log.debug("kvwarden: %s skipped: worker %d is unhealthy", op, self.instance_id)
            return failure
        try:
            value, fds = self._request(op, args)
        except NotRegistered as error:
            log.warning(
                "kvwarden: %s answered not_registered for instance %d (%s); re-registering",
                op,
                self.instance_id,
                error.message,
            )
            with self._hb_lock:
                self._hb.on_not_registered(time.monotonic())
                self._sync_health_locked()
            self._wake.set()
            return failure
        except _TRANSIENT as error:
            self.outage.failed(op, error)
            return failure
        self.outage.answered()
        for fd in fds:  # no transfer reply carries fds; never leak one
            _close_fd(fd)
        return value

    def _send_kv_registration(self, buffers: List[Buffer], model_name: str, world_size: int) -> str:
        wire: List[Dict[str, Any]] = []
        fds: List[int] = []
        for buffer in buffers:
            if isinstance(buffer, FD_BUFFERS):  # the fd goes with the frame (SCM_RIGHTS)
                if buffer.fd < 0:
                    raise ValueError(f"{buffer!r} was closed; a registered buffer must stay open")
                wire.append(buffer.wire(len(fds)))
                fds.append(buffer.fd)
            else:
                wire.append(buffer.wire())
        value, extra = self._request(
            "register_kv_cache", self._named(wire, str(model_name), int(world_size)), fds
        )
        for fd in extra:
            _close_fd(fd)
        return _outcome(value, "register_kv_cache")

    def _send_engine_registration(self, model_name: str, world_size: int) -> EnginePool:
        value, fds = self._request(
            "register_engine_driven", self._named(str(model_name), int(world_size))
        )
        try:
            if not isinstance(value, dict):
                raise ProtocolViolation(
                    f"register_engine_driven: expected a map, got {value!r:.200}"
                )
            index = int(value.get("pool_fd_index", 0))
            if not 0 <= index < len(fds):
                raise ProtocolViolation(
                    f"register_engine_driven: the reply names pool fd #{index} but carried "
                    f"{len(fds)} fds"
                )
            fd = fds.pop(index)
        finally:
            for other in fds:
                _close_fd(other)
        pool = EnginePool(fd, int(value["slot_bytes"]), int(value["num_slots"]))
        old, self._pool = self._pool, pool
        if old is not None:
            old.close()
        return pool

    # -- heartbeat ------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        with self._hb_lock:
            if self._thread is not None or self._hb.is_stopped():
                return
            self._hb.start(time.monotonic())
            self._thread = threading.Thread(
                target=self._heartbeat_loop,
                name=f"kvwarden-heartbeat-{self.instance_id}",
                daemon=True,
            )
            self._thread.start()

    def _sync_health_locked(self) -> None:
        """Mirrors the machine's health into the Event (called with ``_hb_lock``)."""
        if self._hb.is_healthy():
            if not self.healthy.is_set():
                self.healthy.set()
                log.info("kvwarden worker %d is healthy again", self.instance_id)
        elif self.healthy.is_set():
            self.healthy.clear()
            log.warning(
                "kvwarden worker %d is unhealthy: stores are skipped and retrieves miss until "
                "the server answers and the registrations are restored",
                self.instance_id,
            )

    def _heartbeat_loop(self) -> None:
        """The fixed-delay cycle: wait until due, ping, act on the reply, repeat."""
        try:
            while True:
                with self._hb_lock:
                    if self._hb.is_stopped():
                        return
                    due = self._hb.poll_timeout()
                delay = self.interval if due is None else due - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                self._wake.clear()
                with self._hb_lock:
                    if self._hb.is_stopped():
                        return
                    action = self._hb.handle_timeout(time.monotonic())
                if action is HeartbeatAction.SEND_PING:
                    reply = self._send_ping()
                    with self._hb_lock:
                        if self._hb.is_stopped():
                            return
                        action = self._hb.on_ping_reply(time.monotonic(), reply)
                        self._sync_health_locked()
                if action is HeartbeatAction.RECOVER:
                    ok = self._recover()
                    with self._hb_lock:
                        if self._hb.is_stopped():
                            return
                        self._hb.on_recover_done(time.monotonic(), ok)
                        self._sync_health_locked()
        except Exception:  # a bug here must not die silently: health would freeze
            log.exception("kvwarden: the heartbeat thread of instance %d crashed", self.instance_id)
            with self._hb_lock:
                if not self._hb.is_stopped():
                    self.healthy.clear()

    def _send_ping(self) -> PingReply:
        try:
            value, fds = self._request(
                "ping", self._named(), timeout=self.interval, conn=self._ping_conn
            )
        except BadArgs as error:
            # A server of another protocol version: loud, and the worker stays unhealthy.
            log.error(
                "kvwarden: the server rejected this worker's ping as bad_args: %s. The worker "
                "and the server speak different protocol versions; upgrade the older side. "
                "Instance %d stays unhealthy (stores skipped, retrieves miss) until then",
                error.message,
                self.instance_id,
            )
            return PingReply.FAILED
        except KvwardenError as error:
            self.outage.failed(f"ping of instance {self.instance_id}", error)
            return PingReply.FAILED
        self.outage.answered()
        for fd in fds:
            _close_fd(fd)
        if value is True:
            return PingReply.KNOWN
        if value is False:
            log.warning(
                "kvwarden: the server does not hold instance %d (reaped, or restarted); "
                "re-registering",
                self.instance_id,
            )
            return PingReply.UNKNOWN
        log.error("kvwarden: ping answered %r, expected a bool; counting it as failed", value)
        return PingReply.FAILED

    def _recover(self) -> bool:
        """Re-registers everything under the same instance id (a new one only after
        ``attach`` was refused the old one). Never raises: a failure is logged and
        reported as False, and the heartbeat asks again after its next good ping. Stops
        between steps once shutdown() stopped the heartbeat."""
        self.recoveries += 1
        sent_as: Optional[Identity] = None  # the id the first step went out under
        try:
            with self._reg_lock:
                steps: List[Tuple[str, Callable[[], Any]]] = []
                kv, engine, blend = self._kv, self._engine, self._blend
                if kv is not None:
                    steps.append(("register_kv_cache", lambda: self._send_kv_registration(*kv)))
                if engine is not None:
                    steps.append(
                        (
                            "register_engine_driven",
                            lambda: self._send_engine_registration(*engine).nbytes,
                        )
                    )
                if blend is not None:
                    steps.append(
                        (
                            "register_blend",
                            lambda: self._request("register_blend", self._named(blend))[0],
                        )
                    )
                for name, step in steps:
                    with self._hb_lock:
                        if self._hb.is_stopped():
                            return False
                    result = step()
                    if sent_as is None:
                        # An id change happens on a (re)connect, before the request
                        # that connected is sent: so the first step went out as this.
                        sent_as = self._identity
                    log.info(
                        "kvwarden: recovery of instance %d: %s → %r", self.instance_id, name, result
                    )
            if sent_as is not None and self._identity != sent_as:
                # A reconnect between two steps moved this worker to a fresh id: the
                # earlier steps went to the old one. Not done; the next cycle redoes all.
                log.warning(
                    "kvwarden: the instance id changed from %d to %d during the recovery; "
                    "recovering again under the new id",
                    sent_as.instance_id,
                    self.instance_id,
                )
                return False
            self.recoveries_ok += 1
            return True
        except Exception as error:  # the contract: recovery never raises
            log.warning(
                "kvwarden: recovery of instance %d failed, will retry after the next good ping: %s",
                self.instance_id,
                error,
            )
            return False

    def _on_connect(self, hello: HelloInfo) -> None:
        """Warns once per server boot when its reap timeout is too tight for our interval."""
        if hello.boot_id in self._warned_boot_ids:
            return
        self._warned_boot_ids.add(hello.boot_id)
        reap = hello.reap_timeout_seconds
        if reap > 0 and 3 * self.interval > reap:
            log.warning(
                "kvwarden: server %s reaps after %g s of silence but this worker pings every "
                "%g s (3 × interval = %g s); a live worker could be reaped. Lower "
                "heartbeat_interval_seconds to at most %g s",
                hello.server,
                reap,
                self.interval,
                3 * self.interval,
                reap / 3,
            )


def _check_batch_size(op: str, count: int) -> None:
    if count > MAX_BATCH_ITEMS:
        raise ValueError(f"{op}: {count} items; a batch holds at most {MAX_BATCH_ITEMS}; split it")


def _check_nbytes(op: str, nbytes: Any) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise TypeError(
            f"{op}: nbytes must be the destination's length, an int >= 0, got {nbytes!r}"
        )


def _batch_answers(op: str, value: Any, sent: int) -> List[Any]:
    if not isinstance(value, list) or len(value) != sent:
        raise ProtocolViolation(f"{op}: expected a list of {sent} answers, got {value!r:.200}")
    return value


def _outcome(value: Any, op: str) -> str:
    if isinstance(value, dict) and isinstance(value.get("outcome"), str):
        return value["outcome"]
    raise ProtocolViolation(f'{op}: expected {{"outcome": str}}, got {value!r:.200}')


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
