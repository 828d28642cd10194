"""An in-process stand-in for the kvwarden server, for rules that need precise control.

It speaks the same framing and fd passing as the real server, keeps a small model of
its state (which instances are registered, what L1 holds) and lets a test decide how
each op is answered: drop pings (timeouts), answer ``bad_args``, block a register until
the test releases it, forget an instance (a reap), or cut every connection and forget
everything (a restart). Every request is recorded with the time it arrived.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import msgpack

LENGTH = struct.Struct(">I")


class Recorded:
    """One request as the fake server saw it."""

    def __init__(self, op: str, args: List[Any], nfds: int, at: float, conn: int) -> None:
        self.op = op
        self.args = args
        self.nfds = nfds
        self.at = at
        self.conn = conn

    def __repr__(self) -> str:
        return f"Recorded({self.op}, {self.args!r:.80}, nfds={self.nfds}, conn={self.conn})"


class FakeServer:
    """A threaded Unix-socket server with scriptable answers."""

    SLOT_BYTES = 4096
    NUM_SLOTS = 8

    def __init__(self, path: str) -> None:
        self.path = path
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
        self._listener: Optional[socket.socket] = None
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
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Closes the listener and every connection (pending requests get no reply)."""
        self._stopped = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
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

    def restart(self) -> None:
        """A server restart: every connection cut and all state forgotten."""
        self.stop()
        with self.lock:
            self.registered.clear()
            self.engine_registered.clear()
            self.l1.clear()
            self.slots.clear()
            self.boot_id += 1
        self.start()

    # -- queries for tests -------------------------------------------------------------

    def ops(self, op: str) -> List[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.op == op]

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

    # -- serving ------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopped:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self.lock:
                self._conn_serial += 1
                serial = self._conn_serial
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, serial), daemon=True).start()

    def _serve(self, conn: socket.socket, serial: int) -> None:
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
                    record = Recorded(op, args, len(frame_fds), time.monotonic(), serial)
                    with self.cond:
                        self.requests.append(record)
                        self.cond.notify_all()
                    if self.hook is not None:
                        self.hook(record)
                    answer = self._answer(op, args, frame_fds)
                    for fd in frame_fds:
                        os.close(fd)
                    if answer is None:
                        continue  # dropped: the client times out
                    ok, value, reply_fds = answer
                    frame = msgpack.packb([request_id, ok, value], use_bin_type=True)
                    frame = LENGTH.pack(len(frame)) + frame
                    if reply_fds:
                        sent = socket.send_fds(conn, [frame], reply_fds)
                        frame = frame[sent:]
                    if frame:
                        conn.sendall(frame)
        except OSError:
            return

    def _answer(
        self, op: str, args: List[Any], fds: List[int]
    ) -> Optional[Tuple[bool, Any, List[int]]]:
        def error(code: str, message: str) -> Tuple[bool, Any, List[int]]:
            return False, {"code": code, "message": message}, []

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
                    "protocol": 1,
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
                return True, was, []
        if op in ("store", "retrieve"):
            with self.lock:
                if self.transfer_not_registered or args[0] not in self.registered:
                    return error("not_registered", f"instance {args[0]} is not registered")
                mapping = self.memfds[args[0]][args[2]]
                if op == "store":
                    self.l1[bytes(args[1])] = bytes(mapping[args[3] : args[3] + args[4]])
                    return True, True, []
                data = self.l1.get(bytes(args[1]))
                if data is None:
                    return True, None, []
                mapping[args[3] : args[3] + len(data)] = data
                return True, len(data), []
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
