"""The connection layer: FIFO turns, reply matching by request id, fd attribution."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import List

import msgpack
import pytest
from fake_server import FakeServer

from kvwarden import ConnectionLost, RequestTimeout, Worker
from kvwarden.wire import LENGTH_PREFIX, Connection, FifoLock


def test_fifo_lock_grants_turns_in_request_order() -> None:
    lock = FifoLock()
    assert lock.acquire()
    order: List[int] = []
    threads = []
    for index in range(5):

        def take(index: int = index) -> None:
            assert lock.acquire(5.0)
            order.append(index)
            lock.release()

        thread = threading.Thread(target=take)
        thread.start()
        threads.append(thread)
        time.sleep(0.02)  # let each waiter queue before the next one
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_fifo_lock_timeout_leaves_the_queue_for_the_next_waiter() -> None:
    lock = FifoLock()
    assert lock.acquire()
    assert lock.acquire(0.05) is False
    got = threading.Event()
    thread = threading.Thread(target=lambda: lock.acquire(5.0) and got.set())
    thread.start()
    time.sleep(0.05)
    lock.release()
    thread.join(5)
    assert got.is_set(), "the timed-out waiter does not block the queue"


def test_late_reply_of_a_timed_out_request_is_discarded(fake: FakeServer) -> None:
    conn = Connection(fake.path, "test")
    gate = threading.Event()
    fake.ping_gate = gate
    with pytest.raises(RequestTimeout):
        conn.request("ping", [None], timeout=0.2)
    gate.set()
    value, _ = conn.request("status", [], timeout=5.0)
    assert isinstance(value, dict), "the ping's late `true` was not taken for status"
    assert conn.request("ping", [None], timeout=5.0)[0] is True
    assert conn.connects == 1, "a read timeout keeps the connection"
    conn.close()


def test_fds_go_to_the_frame_whose_read_carried_them() -> None:
    client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = Connection("/unused", "test")
    conn._sock = client
    memfd = os.memfd_create("attribution")
    os.ftruncate(memfd, 12345)

    def frame(request_id: int, value: object) -> bytes:
        body = msgpack.packb([request_id, True, value], use_bin_type=True)
        return LENGTH_PREFIX.pack(len(body)) + body

    server.sendall(frame(7, "stale"))  # the late reply of a timed-out request
    socket.send_fds(server, [frame(8, {"pool_fd_index": 0})], [memfd])
    server.sendall(frame(9, "next"))
    reply = conn._read_reply(client, 8, time.monotonic() + 5, "test")
    assert reply.value == {"pool_fd_index": 0}
    assert len(reply.fds) == 1 and os.fstat(reply.fds[0]).st_size == 12345
    os.close(reply.fds[0])
    follow = conn._read_reply(client, 9, time.monotonic() + 5, "test")
    assert follow.value == "next" and follow.fds == []
    os.close(memfd)
    client.close()
    server.close()


def test_connect_failure_names_the_socket_and_the_fix(short_tmp: str) -> None:
    conn = Connection(os.path.join(short_tmp, "absent.sock"), "test")
    with pytest.raises(ConnectionLost) as caught:
        conn.request("status", [], timeout=1.0)
    assert "absent.sock" in caught.value.message and "kvwarden serve" in caught.value.message


def test_worker_warns_when_the_servers_reap_timeout_is_below_three_intervals(
    fake: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.reap_timeout_seconds = 1.0
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        worker = Worker(fake.path, heartbeat_interval_seconds=0.5)
        worker.status()
    warnings = [r.getMessage() for r in caplog.records if "reaps after" in r.getMessage()]
    assert len(warnings) == 1 and "1 s" in warnings[0] and "0.333" in warnings[0]
    worker.shutdown()
    fake.reap_timeout_seconds = 30.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        worker = Worker(fake.path, heartbeat_interval_seconds=0.5)
        worker.status()
    assert not [r for r in caplog.records if "reaps after" in r.getMessage()]
    worker.shutdown()


def test_on_attach_runs_after_hello_and_a_failure_drops_the_connection(fake: FakeServer) -> None:
    seen: List[List[str]] = []

    def on_attach(call) -> None:  # type: ignore[no-untyped-def]
        seen.append([r.op for r in fake.requests])
        if len(seen) == 1:
            raise ConnectionLost("test: the attach failed")
        assert call("ping", [None]) is True, "round trips on the new connection"

    conn = Connection(fake.path, "test", on_attach=on_attach)
    with pytest.raises(ConnectionLost, match="the attach failed"):
        conn.request("status", [], timeout=5.0)
    assert seen == [["hello"]], "called right after hello"
    assert not conn.is_connected(), "an unattached connection is never used"
    assert fake.ops("status") == []
    value, _ = conn.request("status", [], timeout=5.0)
    assert isinstance(value, dict) and conn.connects == 2
    assert [r.op for r in fake.requests] == ["hello", "hello", "ping", "status"]
    assert fake.requests[2].conn == fake.requests[3].conn == fake.requests[1].conn
    conn.close()


def test_callable_args_are_built_after_the_connection_attached(fake: FakeServer) -> None:
    order: List[str] = []
    conn = Connection(fake.path, "test", on_attach=lambda call: order.append("attach"))
    conn.request("ping", lambda: order.append("args") or [None], timeout=5.0)
    assert order == ["attach", "args"]
    conn.reattach(5.0)
    assert order == ["attach", "args", "attach"], "reattach runs the hook on this connection"
    conn.close()
    idle = Connection(fake.path, "test", on_attach=lambda call: order.append("idle"))
    idle.reattach(5.0)
    assert "idle" not in order, "no connection: nothing to attach (the connect will)"
