"""An in-process stand-in for the kvwarden server, for rules that need precise control.

It speaks the same framing and fd passing as the real server (protocol 3), keeps a
small model of its state (which instances are registered, what L1 holds, which secret
each instance id is bound to and which connection attached which id) and lets a test
decide how each op is answered: drop pings (timeouts), answer ``bad_args``, block a
register until the test releases it, forget an instance (a reap), cut every connection
and forget everything (a restart), bind an id to a squatter's secret, forget a
connection's attachments. It can also listen on TCP, with a token it proves it holds
(or, scripted, an impostor that cannot). Every request is recorded with the time it
arrived.

The rules it enforces, as the real server does: every op naming an
instance needs the connection to have ``attach``-ed it (``forbidden`` naming
``attach`` otherwise; ``ping [nil]`` needs nothing); ``attach`` of an id bound to
another secret is ``forbidden``; a binding lives while the instance is registered or
a connection attached it; ``retrieve`` carries ``nbytes`` and a value of another
length is a miss that writes nothing; over TCP (protocol 3) nothing but ``auth`` (once
a connection: ``{"nonce", "proof"}`` for the token of the key id it names, the proof
computed from the fake's own token) and then a ``hello`` whose ``proof`` answers it is
answered until that ``hello`` came; a ``hello`` carrying ``token`` is ``forbidden``.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import msgpack

LENGTH = struct.Struct(">I")


#: Ops whose first argument names an instance (``ping`` only when it is not nil).
NAMING_OPS = {
    "ping",
    "register_kv_cache",
    "unregister_kv_cache",
    "store",
    "retrieve",
    "store_batch",
    "retrieve_batch",
    "register_engine_driven",
    "unregister_engine_driven",
    "prepare_store",
    "commit_store",
    "prepare_retrieve",
    "commit_retrieve",
    "register_blend",
}

#: The secret a squatter bound an id to (never one a worker draws: 32 random bytes).
SQUATTER_SECRET = b"squatter-secret-" * 2


class Recorded:
    """One request as the fake server saw it."""

    def __init__(
        self, op: str, args: List[Any], nfds: int, at: float, conn: int, kind: str = "unix"
    ) -> None:
        self.op = op
        self.args = args
        self.nfds = nfds
        self.at = at
        self.conn = conn
        self.kind = kind
        #: How the fake answered: (ok, value) once answered; None while held or dropped.
        self.answer: Optional[Tuple[bool, Any]] = None

    def __repr__(self) -> str:
        return (
            f"Recorded({self.op}, {self.args!r:.80}, nfds={self.nfds}, conn={self.conn}, "
            f"answer={self.answer!r:.80})"
        )


class FakeServer:
    """A threaded Unix-socket server with scriptable answers."""

    SLOT_BYTES = 4096
    NUM_SLOTS = 8

    def __init__(self, path: str, tcp_token: Optional[str] = None) -> None:
        self.path = path
        #: The token a TCP peer must prove it holds (None: TCP hellos need nothing).
        self.tcp_token = tcp_token
        #: Scripted impostors over TCP: ``"any_id"`` answers ``auth`` whatever the key id
        #: with the proof of its own token (a server holding another token that does not
        #: look the id up); ``"wrong_proof"`` answers with random bytes as the proof;
        #: ``"protocol_2"`` answers ``unknown_op``, as a server before ``auth`` did.
        self.auth_mode = "normal"
        self.tcp_port: Optional[int] = None
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.requests: List[Recorded] = []
        self.registered: Set[int] = set()
        self.engine_registered: Set[int] = set()
        self.contexts_built = 0
        self.l1: Dict[bytes, bytes] = {}
        self.memfds: Dict[int, List[mmap.mmap]] = {}
        # Scripting knobs.
        self.ping_mode = "normal"  # normal | drop | bad_args | false
        self.register_fails = 0  # answer the next N register_kv_cache with `internal`
        self.register_gate: Optional[threading.Event] = None  # block registers until set
        self.ping_gate: Optional[threading.Event] = None  # block pings until set
        self.transfer_not_registered = False
        self.hook: Optional[Callable[[Recorded], None]] = None
        self.boot_id = 1
        self.reap_timeout_seconds = 30.0
        # 2: answer a `hello` with an options map `bad_args`, as servers before the
        # pidfd did. `hello_pidfd_pids`: the pid each hello's pidfd named (its fdinfo).
        self.hello_max_args = 3
        self.hello_pidfd_pids: List[int] = []
        # Protocol 2: instance id -> the secret it is bound to; connection -> the ids it
        # attached; ids a squatter holds (alive without any connection of ours).
        self.bindings: Dict[int, bytes] = {}
        self.attached: Dict[int, Set[int]] = {}
        self.squatted: Set[int] = set()
        #: Ops answered ``forbidden`` with this message (a reason other than attach).
        self.forbid: Dict[str, str] = {}
        #: Ops before which the connection's attachments are forgotten (as if it never
        #: attached): the op is answered ``forbidden`` naming attach.
        self.detach_before: Set[str] = set()
        self._good_hello: Set[int] = set()  # TCP connections that proved the token
        #: TCP connection -> (client nonce, server nonce) of its `auth`.
        self._challenges: Dict[int, Tuple[bytes, bytes]] = {}
        self._listener: Optional[socket.socket] = None
        self._tcp_listener: Optional[socket.socket] = None
        self._conns: List[socket.socket] = []
        self._conn_serial = 0
        self._stopped = False
        pool_fd = os.memfd_create("fake-pool", os.MFD_CLOEXEC)
        os.ftruncate(pool_fd, self.SLOT_BYTES * self.NUM_SLOTS)
        self.pool_fd = pool_fd
        self.pool = mmap.mmap(pool_fd, self.SLOT_BYTES * self.NUM_SLOTS)
        self.slots: Dict[bytes, Tuple[int, int]] = {}  # key -> (slot, nbytes)
        self.next_slot = 0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "FakeServer":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(16)
        self._listener = listener
        self._stopped = False
        threading.Thread(target=self._accept_loop, args=(listener, "unix"), daemon=True).start()
        return self

    def start_tcp(self) -> int:
        """Also listens on TCP (127.0.0.1, a free port); returns the port."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.tcp_port or 0))
        listener.listen(16)
        self._tcp_listener = listener
        self.tcp_port = listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, args=(listener, "tcp"), daemon=True).start()
        return self.tcp_port

    def stop(self) -> None:
        """Closes the listener and every connection (pending requests get no reply)."""
        self._stopped = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._tcp_listener is not None:
            self._tcp_listener.close()
            self._tcp_listener = None
        with self.lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
            self._conns.clear()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def restart(self, squat: Sequence[int] = ()) -> None:
        """A server restart: every connection cut and all state forgotten. ``squat``:
        ids another process binds to its own secret before any worker reconnects."""
        self.stop()
        with self.lock:
            self.registered.clear()
            self.engine_registered.clear()
            self.l1.clear()
            self.slots.clear()
            self.bindings.clear()
            self.attached.clear()
            self.squatted.clear()
            self._good_hello.clear()
            self._challenges.clear()
            self.boot_id += 1
            for instance in squat:
                self.squat(instance)
        self.start()
        if self.tcp_port is not None:
            self.start_tcp()

    def squat(self, instance: int) -> None:
        """Another process claims ``instance`` with its own secret (and keeps it)."""
        with self.lock:
            self.bindings[instance] = SQUATTER_SECRET
            self.squatted.add(instance)

    def detach(self, conn: Optional[int] = None) -> None:
        """Forgets which ids connection ``conn`` (every one: None) attached."""
        with self.lock:
            for serial, ids in self.attached.items():
                if conn is None or serial == conn:
                    ids.clear()

    # -- queries for tests -------------------------------------------------------------

    def ops(self, op: str, heartbeat: bool = False) -> List[Recorded]:
        """The requests of ``op``. A ``hello`` or ``attach`` on the heartbeat's own
        connection (whose ``hello`` says no ``wait_ms``: it writes into nothing) is left
        out unless ``heartbeat``, so that the tests of the worker's connection count the
        set-ups they did before pings had a connection of their own."""
        with self.lock:
            pinging = self._heartbeat_conns() if op in ("hello", "attach") else set()
            return [r for r in self.requests if r.op == op and (heartbeat or r.conn not in pinging)]

    def _heartbeat_conns(self) -> set:
        """Connections whose ``hello`` carried no ``wait_ms`` (call under the lock)."""
        hellos: dict = {}
        for r in self.requests:
            if r.op != "hello":
                continue
            options = r.args[2] if len(r.args) > 2 and isinstance(r.args[2], dict) else {}
            worker = "wait_ms" in options or "pidfd_index" in options
            hellos[r.conn] = hellos.get(r.conn, False) or worker
        return {conn for conn, worker in hellos.items() if not worker}

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Waits until ``predicate()`` (evaluated under the lock) holds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.05))
            return True

    def forget(self, instance: int) -> None:
        """The server reaped the instance."""
        with self.lock:
            self.registered.discard(instance)
            self.engine_registered.discard(instance)
            self._release_binding(instance)

    def attaches(self, outcome: Optional[str] = None) -> List[Recorded]:  # worker's conns
        """The ``attach`` requests, optionally only those answered ``outcome``
        (``claimed``, ``proven``, or ``forbidden``)."""
        out = []
        for record in self.ops("attach"):
            if outcome is None or _outcome_of(record) == outcome:
                out.append(record)
        return out

    def _release_binding(self, instance: int) -> None:
        """Frees the binding once nothing holds it (called with the lock)."""
        if (
            instance in self.registered
            or instance in self.engine_registered
            or instance in self.squatted
            or any(instance in ids for ids in self.attached.values())
        ):
            return
        self.bindings.pop(instance, None)

    # -- serving ------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket, kind: str) -> None:
        while not self._stopped:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self.lock:
                self._conn_serial += 1
                serial = self._conn_serial
                self._conns.append(conn)
                self.attached[serial] = set()
            threading.Thread(target=self._serve, args=(conn, serial, kind), daemon=True).start()

    def _serve(self, conn: socket.socket, serial: int, kind: str) -> None:
        try:
            self._serve_frames(conn, serial, kind)
        finally:
            with self.lock:  # a closed connection holds no binding any more
                ids = self.attached.pop(serial, set())
                for instance in ids:
                    self._release_binding(instance)

    def _serve_frames(self, conn: socket.socket, serial: int, kind: str) -> None:
        buffer = bytearray()
        fds: List[int] = []
        try:
            while True:
                data, new_fds, _, _ = socket.recv_fds(conn, 65536, 16)
                if not data:
                    return
                buffer.extend(data)
                fds.extend(new_fds)
                while len(buffer) >= 4:
                    (length,) = LENGTH.unpack_from(buffer)
                    if len(buffer) < 4 + length:
                        break
                    body = bytes(buffer[4 : 4 + length])
                    del buffer[: 4 + length]
                    request_id, op, args = msgpack.unpackb(body, raw=False)
                    frame_fds, fds = fds, []
                    record = Recorded(op, args, len(frame_fds), time.monotonic(), serial, kind)
                    with self.cond:
                        self.requests.append(record)
                        self.cond.notify_all()
                    if self.hook is not None:
                        self.hook(record)
                    answer = self._checked_answer(conn, serial, kind, op, args, frame_fds)
                    for fd in frame_fds:
                        os.close(fd)
                    if answer is None:
                        continue  # dropped: the client times out
                    ok, value, reply_fds = answer
                    with self.cond:
                        record.answer = (ok, value)
                        self.cond.notify_all()
                    frame = msgpack.packb([request_id, ok, value], use_bin_type=True)
                    frame = LENGTH.pack(len(frame)) + frame
                    if reply_fds:
                        sent = socket.send_fds(conn, [frame], reply_fds)
                        frame = frame[sent:]
                    if frame:
                        conn.sendall(frame)
        except OSError:
            return

    def _checked_answer(
        self, conn: socket.socket, serial: int, kind: str, op: str, args: List[Any], fds: List[int]
    ) -> Optional[Tuple[bool, Any, List[int]]]:
        """The gates (TCP authentication, attach), then :meth:`_answer`."""
        tcp_gate = kind == "tcp" and self.tcp_token is not None
        if op == "auth":
            return self._auth(serial, kind, args)
        if op == "hello":
            options = args[2] if len(args) > 2 and isinstance(args[2], dict) else {}
            if "token" in options:
                return _error(
                    "forbidden",
                    "`hello` takes no token since protocol 3 (the token never travels): "
                    "prove it with `auth`, then `hello` with `proof`",
                )
            if tcp_gate:
                with self.lock:
                    challenge = self._challenges.get(serial)
                if challenge is None:
                    return _error(
                        "forbidden",
                        "`hello` over TCP needs `auth` first, then the proof in `hello`",
                    )
                proof = options.get("proof")
                expected = _tcp_proofs(self.tcp_token.encode(), *challenge)[1]
                if not isinstance(proof, bytes) or not hmac.compare_digest(proof, expected):
                    return _error("forbidden", "`hello`: the proof of the token is wrong")
                with self.lock:
                    self._good_hello.add(serial)
            if kind == "unix":
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                tenant = "uid-%d" % struct.unpack("3i", creds)[1]
            else:
                tenant = "tcp"
            answer = self._answer(op, args, fds)
            if answer is not None and answer[0]:
                answer[1]["tenant"] = tenant
            return answer
        if tcp_gate and serial not in self._good_hello:
            return _error("forbidden", f"`{op}`: authenticate (`auth`, `hello`) first")
        if op == "attach":
            if op in self.forbid:
                return _error("forbidden", self.forbid[op])
            return self._attach(serial, args)
        if op in NAMING_OPS and not (op == "ping" and args and args[0] is None):
            with self.lock:
                if op in self.detach_before:
                    self.attached.get(serial, set()).clear()
                if op in self.forbid:
                    return _error("forbidden", self.forbid[op])
                instance = args[0] if args else None
                if instance not in self.attached.get(serial, set()):
                    return _error(
                        "forbidden",
                        f"`{op}`: this connection has not attached instance {instance}; "
                        f"send `attach [instance_id, secret]` first",
                    )
        return self._answer(op, args, fds)

    def _auth(self, serial: int, kind: str, args: List[Any]) -> Tuple[bool, Any, List[int]]:
        """``auth [{"id", "nonce"}]``: TCP only, once a connection."""
        if self.auth_mode == "protocol_2":
            return _error("unknown_op", "unknown op `auth`")
        if kind != "tcp":
            return _error("bad_args", "`auth` is for TCP connections only")
        arg = args[0] if len(args) == 1 and isinstance(args[0], dict) else {}
        key_id, nonce = arg.get("id"), arg.get("nonce")
        if not (isinstance(key_id, bytes) and len(key_id) == 16) or not (
            isinstance(nonce, bytes) and len(nonce) == 32
        ):
            return _error(
                "bad_args", f"`auth` expects [{{id: bin 16, nonce: bin 32}}], got {args!r}"
            )
        with self.lock:
            if serial in self._challenges:
                return _error("forbidden", "`auth`: this connection made its challenge already")
            if self.tcp_token is None:
                return _error("forbidden", "`auth`: this server has no token")
            token = self.tcp_token.encode()
            if self.auth_mode != "any_id" and key_id != _tcp_key(token)[1]:
                return _error("forbidden", "`auth`: no token of this server has this key id")
            server_nonce = secrets.token_bytes(32)
            self._challenges[serial] = (nonce, server_nonce)
        proof = _tcp_proofs(token, nonce, server_nonce)[0]
        if self.auth_mode == "wrong_proof":
            proof = secrets.token_bytes(32)
        return True, {"nonce": server_nonce, "proof": proof}, []

    def _attach(self, serial: int, args: List[Any]) -> Tuple[bool, Any, List[int]]:
        if len(args) != 2 or not isinstance(args[0], int) or not isinstance(args[1], bytes):
            return _error("bad_args", f"`attach` expects [instance_id, secret: bin], got {args!r}")
        instance, secret = args
        if not 16 <= len(secret) <= 64:
            return _error("bad_args", f"`attach`: a secret of {len(secret)} bytes; 16..=64")
        with self.lock:
            bound = self.bindings.get(instance)
            if bound is not None and bound != secret:
                return _error(
                    "forbidden", f"`attach`: instance {instance} is bound to another secret"
                )
            self.bindings[instance] = secret
            self.attached.setdefault(serial, set()).add(instance)
        return True, {"outcome": "claimed" if bound is None else "proven"}, []

    def _answer(
        self, op: str, args: List[Any], fds: List[int]
    ) -> Optional[Tuple[bool, Any, List[int]]]:
        error = _error

        if op == "hello":
            if len(args) > self.hello_max_args:
                return error(
                    "bad_args",
                    f"bad arguments for `hello`: {len(args)} arguments instead of 2",
                )
            if len(args) == 3 and fds:
                index = args[2].get("pidfd_index", 0)
                with open(f"/proc/self/fdinfo/{fds[index]}") as info:
                    pid = [line.split()[1] for line in info if line.startswith("Pid:")]
                self.hello_pidfd_pids.append(int(pid[0]) if pid else -100)
            return (
                True,
                {
                    "protocol": 3,
                    "server": "fake",
                    "boot_id": self.boot_id,
                    "reap_timeout_seconds": self.reap_timeout_seconds,
                    "registration_grace_seconds": 3600.0,
                },
                [],
            )
        if op == "ping":
            if self.ping_gate is not None:
                self.ping_gate.wait(30)
            if self.ping_mode == "drop":
                return None
            if self.ping_mode == "bad_args":
                return error("bad_args", "bad arguments for `ping`: fake mismatch")
            if self.ping_mode == "false":
                return True, False, []
            with self.lock:
                if args[0] is None:  # an untracked prober
                    return True, True, []
                return True, args[0] in self.registered or args[0] in self.engine_registered, []
        if op == "register_kv_cache":
            if self.register_gate is not None:
                self.register_gate.wait(30)
            with self.lock:
                if self.register_fails > 0:
                    self.register_fails -= 1
                    return error("internal", "fake register failure")
                instance = args[0]
                for buffer in args[1]:
                    if buffer["kind"] == "memfd" and buffer["fd_index"] >= len(fds):
                        return error("bad_args", "fd_index without an fd")
                if instance in self.registered:
                    return True, {"outcome": "refreshed"}, []
                self.registered.add(instance)
                self.contexts_built += 1
                self.memfds[instance] = [
                    mmap.mmap(fds[b["fd_index"]], b["nbytes"]) if b["kind"] == "memfd" else None
                    for b in args[1]
                ]
                return True, {"outcome": "created"}, []
        if op == "unregister_kv_cache":
            with self.lock:
                was = args[0] in self.registered
                self.registered.discard(args[0])
                self._release_binding(args[0])
                return True, was, []
        if op in ("store", "retrieve", "store_batch", "retrieve_batch"):
            with self.lock:
                if self.transfer_not_registered or args[0] not in self.registered:
                    return error("not_registered", f"instance {args[0]} is not registered")
                if op == "store":
                    if len(args) != 5:
                        return error("bad_args", f"`store` expects 5 arguments, got {args!r}")
                    return self._copy_in(args[0], args[1:], "`store`") or (True, True, [])
                if op == "retrieve":
                    if len(args) != 5:
                        return error(
                            "bad_args",
                            f"`retrieve` expects [instance_id, key, buffer, offset, nbytes], "
                            f"got {len(args)} arguments",
                        )
                    problem = self._check_bounds(args[0], args[1:], "`retrieve`")
                    if problem is not None:
                        return problem
                    return True, self._copy_out(args[0], args[1:]), []
                items = args[1]
                for index, item in enumerate(items):
                    where = f"`{op}` items[{index}]"
                    if len(item) != 4:
                        return error("bad_args", f"{where}: expects [key, buffer, offset, nbytes]")
                    problem = self._check_bounds(args[0], item, where)
                    if problem is not None:
                        return problem
                if op == "store_batch":
                    for item in items:
                        self._copy_in(args[0], item, op)
                    return True, [True] * len(items), []
                return True, [self._copy_out(args[0], item) for item in items], []
        if op == "lookup":
            with self.lock:
                count = 0
                for key in args[0]:
                    if bytes(key) not in self.l1:
                        break
                    count += 1
                return True, count, []
        if op == "register_engine_driven":
            with self.lock:
                outcome = "refreshed" if args[0] in self.engine_registered else "created"
                if outcome == "created":
                    self.contexts_built += 1
                self.engine_registered.add(args[0])
            return (
                True,
                {
                    "outcome": outcome,
                    "slot_bytes": self.SLOT_BYTES,
                    "num_slots": self.NUM_SLOTS,
                    "pool_fd_index": 0,
                },
                [self.pool_fd],
            )
        if op == "unregister_engine_driven":
            with self.lock:
                was = args[0] in self.engine_registered
                self.engine_registered.discard(args[0])
                self._release_binding(args[0])
                return True, was, []
        if op in ("prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve"):
            with self.lock:
                if args[0] not in self.engine_registered:
                    return error("not_registered", f"instance {args[0]} is not registered")
                key = bytes(args[1])
                if op == "prepare_store":
                    if key in self.slots:
                        return True, None, []
                    slot = self.next_slot % self.NUM_SLOTS
                    self.next_slot += 1
                    self.slots[key] = (slot, 0)
                    return (
                        True,
                        {"slot": slot, "offset": slot * self.SLOT_BYTES, "nbytes": self.SLOT_BYTES},
                        [],
                    )
                if op == "commit_store":
                    slot, _ = self.slots[key]
                    self.slots[key] = (slot, args[2])
                    return True, True, []
                if op == "prepare_retrieve":
                    if key not in self.slots:
                        return True, None, []
                    slot, nbytes = self.slots[key]
                    return True, {"offset": slot * self.SLOT_BYTES, "nbytes": nbytes}, []
                return True, True, []
        if op == "register_blend":
            return True, True, []
        if op == "status":
            with self.lock:
                return True, {"worker_liveness": {"tracked_instances": len(self.registered)}}, []
        return error("unknown_op", f"unknown op {op}")

    # -- copies (called with the lock) ---------------------------------------------------

    def _check_bounds(
        self, instance: int, item: Sequence[Any], where: str
    ) -> Optional[Tuple[bool, Any, List[int]]]:
        _key, buffer, offset, nbytes = item
        mappings = self.memfds[instance]
        if not 0 <= buffer < len(mappings) or mappings[buffer] is None:
            return _error("bad_args", f"{where}: buffer index {buffer} is not a memfd buffer")
        if offset + nbytes > len(mappings[buffer]):
            return _error(
                "bad_args",
                f"{where}: offset {offset} + nbytes {nbytes} past the buffer's "
                f"{len(mappings[buffer])} bytes",
            )
        return None

    def _copy_in(
        self, instance: int, item: Sequence[Any], where: str
    ) -> Optional[Tuple[bool, Any, List[int]]]:
        problem = self._check_bounds(instance, item, where)
        if problem is not None:
            return problem
        key, buffer, offset, nbytes = item
        self.l1[bytes(key)] = bytes(self.memfds[instance][buffer][offset : offset + nbytes])
        return None

    def _copy_out(self, instance: int, item: Sequence[Any]) -> Optional[int]:
        """Protocol 2: a value of another length than ``nbytes`` is a miss, and nothing
        is written."""
        key, buffer, offset, nbytes = item
        data = self.l1.get(bytes(key))
        if data is None or len(data) != nbytes:
            return None
        self.memfds[instance][buffer][offset : offset + nbytes] = data
        return nbytes


def _tcp_key(token: bytes) -> Tuple[bytes, bytes]:
    """(key, key id) of a TCP token: the fake's own HMAC code, not the client's."""
    key = hmac.new(token, b"kvwarden tcp auth key v3", hashlib.sha256).digest()
    return key, hmac.new(key, b"kvwarden tcp key id", hashlib.sha256).digest()[:16]


def _tcp_proofs(token: bytes, client_nonce: bytes, server_nonce: bytes) -> Tuple[bytes, bytes]:
    """(server proof, client proof) of a TCP token for these nonces."""
    key, key_id = _tcp_key(token)
    tail = key_id + client_nonce + server_nonce
    return (
        hmac.new(key, b"kvwarden tcp server proof" + tail, hashlib.sha256).digest(),
        hmac.new(key, b"kvwarden tcp client proof" + tail, hashlib.sha256).digest(),
    )


def _error(code: str, message: str) -> Tuple[bool, Any, List[int]]:
    return False, {"code": code, "message": message}, []


def _outcome_of(record: Recorded) -> Optional[str]:
    if record.answer is None:
        return None
    ok, value = record.answer
    if not ok:
        return str(value.get("code"))
    return str(value.get("outcome"))
