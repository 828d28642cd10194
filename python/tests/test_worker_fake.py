"""Every heartbeat rule of the Worker, against an in-process fake server we control.

The fake lets a test hold a ping or a register at the server, drop replies, answer
``bad_args`` and forget an instance, so that rules about ordering ("recovery before
health", "a stopped cycle does nothing") can be checked exactly. The same rules are
then exercised end to end against the real binary in ``test_real_server.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import List

import pytest
from conftest import wait_until
from fake_server import FakeServer

from kvwarden import (
    BadArgs,
    CudaIpcBuffer,
    Forbidden,
    KvwardenError,
    MemfdBuffer,
    NotRegistered,
    Worker,
)
from kvwarden.errors import server_error

INTERVAL = 0.2


@pytest.fixture
def buffer() -> MemfdBuffer:
    buf = MemfdBuffer.create(8192, "test-kv")
    yield buf
    buf.close()


def make_worker(fake: FakeServer, buffer: MemfdBuffer, interval: float = INTERVAL) -> Worker:
    worker = Worker(fake.path, heartbeat_interval_seconds=interval, request_timeout_seconds=2.0)
    assert worker.register_kv_cache([buffer], "test-model") == "created"
    return worker


def registers(fake: FakeServer) -> List:
    return fake.ops("register_kv_cache")


def test_instance_id_is_63_bit_uuid_derived_and_logged_at_info(
    fake: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvwarden"):
        a = Worker(fake.path)
        b = Worker(fake.path)
    assert 0 <= a.instance_id < (1 << 63) and 0 <= b.instance_id < (1 << 63)
    assert a.instance_id != b.instance_id
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert any(str(a.instance_id) in r.getMessage() for r in infos)
    assert any(str(b.instance_id) in r.getMessage() for r in infos)
    a.shutdown()
    b.shutdown()


def test_health_is_set_at_construction_and_heartbeat_starts_on_first_store(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    assert worker.healthy.is_set()
    time.sleep(3 * INTERVAL)  # a window in which an eager heartbeat would have pinged
    assert not fake.ops("ping"), "no ping before the first store/retrieve"
    assert not worker.heartbeat_started()
    assert worker.store(b"k1")
    assert worker.heartbeat_started()
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 3, 5), "pings once started"
    assert worker.healthy.is_set()
    worker.shutdown()


def test_heartbeat_also_starts_on_first_retrieve(fake: FakeServer, buffer: MemfdBuffer) -> None:
    worker = make_worker(fake, buffer)
    assert worker.retrieve(b"absent", nbytes=4) is None
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    worker.shutdown()


def test_fixed_delay_cycle_pings_one_interval_after_each_reply(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 5, 10)
    times = [r.at for r in fake.ops("ping")[:5]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(gap >= INTERVAL * 0.95 for gap in gaps), gaps  # never early
    assert all(gap < INTERVAL * 3 for gap in gaps), gaps  # and not starved
    worker.shutdown()


def test_one_unanswered_ping_clears_health_after_one_interval(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.ping_mode = "drop"
    dropped_at = None

    def first_dropped() -> bool:
        return len(fake.ops("ping")) >= 2

    assert fake.wait_for(first_dropped, 5)
    dropped_at = fake.ops("ping")[1].at
    assert worker.healthy.is_set(), "a ping in flight is not a failure yet"
    assert worker.healthy.wait(0) is True
    wait_until(lambda: not worker.healthy.is_set(), 5, "health cleared by the timed-out ping")
    cleared_after = time.monotonic() - dropped_at
    assert cleared_after >= INTERVAL * 0.9, "the ping's timeout is one interval"
    worker.shutdown()


def test_good_ping_after_failure_recovers_with_same_id_before_health_is_set(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    health_at_register: List[bool] = []

    def on_request(record) -> None:  # runs in the server, before it answers
        if record.op == "register_kv_cache":
            health_at_register.append(worker.healthy.is_set())

    fake.hook = on_request
    worker.store(b"k")
    fake.ping_mode = "drop"
    wait_until(lambda: not worker.healthy.is_set(), 5, "unhealthy after a dropped ping")
    assert len(registers(fake)) == 1, "a failed ping alone never re-registers"
    fake.ping_mode = "normal"
    wait_until(worker.healthy.is_set, 5, "healthy after the recovery")
    regs = registers(fake)
    assert len(regs) == 2
    assert regs[1].args[0] == worker.instance_id, "recovery keeps the instance id"
    assert regs[1].nfds == 1, "the memfd is sent again"
    assert health_at_register == [False], "recovery ran while health was still clear"
    assert fake.contexts_built == 1, "the server still held it: refreshed, nothing built"
    worker.shutdown()


def test_ping_answered_false_recovers_with_exactly_one_new_context(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.forget(worker.instance_id)  # a reap
    assert fake.wait_for(lambda: len(registers(fake)) == 2, 5), "re-registered"
    wait_until(worker.healthy.is_set, 5, "healthy after recovery")
    assert registers(fake)[1].args[0] == worker.instance_id
    assert fake.contexts_built == 2
    assert worker.instance_id in fake.registered
    time.sleep(3 * INTERVAL)
    assert len(registers(fake)) == 2, "no further recovery once the server holds it"
    worker.shutdown()


def test_failed_recovery_never_raises_and_is_retried_after_the_next_good_ping(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.register_fails = 1
    fake.forget(worker.instance_id)
    assert fake.wait_for(lambda: len(registers(fake)) >= 3, 10), "a second recovery"
    regs = registers(fake)
    pings_between = [p for p in fake.ops("ping") if regs[1].at < p.at < regs[2].at]
    assert pings_between, "the retry waits for the next good ping"
    assert regs[2].at - regs[1].at >= INTERVAL * 0.9
    wait_until(worker.healthy.is_set, 5, "healthy after the retried recovery")
    assert worker._thread is not None and worker._thread.is_alive()
    assert worker.recoveries >= 2 and worker.recoveries_ok >= 1
    worker.shutdown()


def test_transfer_answered_not_registered_triggers_the_same_recovery(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer, interval=2.0)  # long: the ping alone would be slow
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.forget(worker.instance_id)
    started = time.monotonic()
    assert worker.store(b"k2") is False, "the store reports failure"
    assert not worker.healthy.is_set()
    assert fake.wait_for(lambda: len(registers(fake)) == 2, 5)
    assert time.monotonic() - started < 1.5, "recovery does not wait for the next interval"
    wait_until(worker.healthy.is_set, 5, "healthy again")
    assert registers(fake)[1].args[0] == worker.instance_id
    assert worker.store(b"k3") is True
    worker.shutdown()


def test_reaped_worker_keeps_its_binding_and_recovers_with_one_context_and_no_new_attach(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.forget(worker.instance_id)  # a reap: the attached connection still holds the id
    assert worker.instance_id in fake.bindings
    assert fake.wait_for(lambda: len(registers(fake)) == 2, 5), "re-registered"
    wait_until(worker.healthy.is_set, 5, "healthy after recovery")
    assert len(fake.attaches()) == 1, "same connection: no second attach needed"
    assert fake.contexts_built == 2 and worker.identity_changes == 0
    worker.shutdown()


def test_unhealthy_worker_skips_stores_and_misses_retrieves_without_blocking(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    buffer.view[:4] = b"abcd"
    assert worker.store(b"k", nbytes=4)
    fake.ping_mode = "drop"
    wait_until(lambda: not worker.healthy.is_set(), 5, "unhealthy")
    before = len(fake.requests)
    started = time.monotonic()
    assert worker.store(b"k2") is False
    assert worker.retrieve(b"k", nbytes=4) is None, "held by the server, but reported as a miss"
    assert worker.lookup([b"k"]) == 0
    assert time.monotonic() - started < 0.1, "no blocking while unhealthy"
    transfers = [r for r in fake.requests[before:] if r.op in ("store", "retrieve", "lookup")]
    assert transfers == [], "nothing was sent"
    fake.ping_mode = "normal"
    wait_until(worker.healthy.is_set, 5, "healthy")
    assert worker.retrieve(b"k", nbytes=4) == 4, "and retrieves work again once healthy"
    worker.shutdown()


def test_bad_args_ping_is_logged_loudly_and_leaves_the_worker_unhealthy(
    fake: FakeServer, buffer: MemfdBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.ping_mode = "bad_args"
    worker = make_worker(fake, buffer)
    with caplog.at_level(logging.ERROR, logger="kvwarden"):
        worker.store(b"k")
        wait_until(lambda: not worker.healthy.is_set(), 5, "unhealthy on bad_args")
        assert fake.wait_for(lambda: len(fake.ops("ping")) >= 4, 5)
    assert not worker.healthy.is_set(), "stays unhealthy"
    assert len(registers(fake)) == 1, "bad_args is not a reason to re-register"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "bad_args" in errors[0].getMessage()
    assert "protocol versions" in errors[0].getMessage()
    worker.shutdown()


def test_warning_when_three_intervals_exceed_the_servers_30s_floor(
    fake: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        Worker(fake.path, heartbeat_interval_seconds=10.0).shutdown()
    assert not [r for r in caplog.records if "floor" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        Worker(fake.path, heartbeat_interval_seconds=10.5).shutdown()
    warnings = [r for r in caplog.records if "floor" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "31.5" in warnings[0].getMessage()


def test_shutdown_stops_heartbeat_then_unregisters_then_closes(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 2, 5)
    worker.shutdown()
    unregs = fake.ops("unregister_kv_cache")
    assert len(unregs) == 1 and unregs[0].args == [worker.instance_id]
    assert fake.requests[-1].op == "unregister_kv_cache", "nothing after the unregister"
    count = len(fake.requests)
    time.sleep(3 * INTERVAL)
    assert len(fake.requests) == count, "the heartbeat is stopped"
    assert worker.instance_id not in fake.registered
    assert not worker._conn.is_connected()
    assert worker.store(b"k") is False, "transfers after shutdown are skipped"
    worker.shutdown()  # idempotent


def test_cycle_running_at_shutdown_neither_recovers_nor_touches_health(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    gate = threading.Event()
    fake.ping_gate = gate
    count = len(fake.ops("ping"))
    assert fake.wait_for(lambda: len(fake.ops("ping")) > count, 5), "a ping is held at the server"
    fake.forget(worker.instance_id)  # its reply will be `false`: a recovery, if not stopped
    closer = threading.Thread(target=worker.shutdown)
    closer.start()
    wait_until(worker._hb.is_stopped, 5, "heartbeat stopped by shutdown")
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert len(registers(fake)) == 1, "no recovery after stop: no ghost context"
    assert worker.healthy.is_set(), "health untouched by the stopped cycle"
    assert worker.instance_id not in fake.registered


def test_shutdown_during_recovery_leaves_no_ghost_registration(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    gate = threading.Event()
    fake.register_gate = gate
    fake.forget(worker.instance_id)
    assert fake.wait_for(lambda: len(registers(fake)) == 2, 5), "recovery's register is held"
    closer = threading.Thread(target=worker.shutdown)
    closer.start()
    wait_until(worker._hb.is_stopped, 5, "heartbeat stopped")
    gate.set()
    closer.join(10)
    ops = [r.op for r in fake.requests]
    assert ops.index("unregister_kv_cache") > len(ops) - 2, "unregister is the last request"
    assert worker.instance_id not in fake.registered, "the unregister came after the register"
    assert not worker.healthy.is_set(), "the interrupted recovery did not set health"


def test_server_restart_reconnects_and_reregisters_same_id_once(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    worker.store(b"k")
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.restart()
    wait_until(lambda: len(registers(fake)) == 2 and worker.healthy.is_set(), 10, "re-registered")
    regs = registers(fake)
    assert regs[1].args[0] == worker.instance_id and regs[1].nfds == 1
    assert regs[1].conn != regs[0].conn, "on a new connection"
    assert fake.contexts_built == 2 and fake.registered == {worker.instance_id}
    assert len(fake.ops("hello")) == 2
    # One claim per server life, by whichever connection of the worker attached first.
    claimed = (True, {"outcome": "claimed"})
    claims = [a for a in fake.ops("attach", heartbeat=True) if a.answer == claimed]
    assert len(claims) == 2
    assert worker.identity_changes == 0, "the restarted server had no binding: claimed again"
    time.sleep(3 * INTERVAL)
    assert len(registers(fake)) == 2
    worker.shutdown()


def test_memfd_store_retrieve_lookup_round_trip(fake: FakeServer, buffer: MemfdBuffer) -> None:
    worker = make_worker(fake, buffer)
    buffer.view[0:5] = b"hello"
    assert worker.store(b"key-a", buffer=0, offset=0, nbytes=5)
    assert worker.lookup([b"key-a", b"key-b"]) == 1
    buffer.view[100:105] = b"xxxxx"
    assert worker.retrieve(b"key-a", buffer=0, offset=100, nbytes=5) == 5
    assert bytes(buffer.view[100:105]) == b"hello"
    [retrieve] = fake.ops("retrieve")
    assert retrieve.args == [worker.instance_id, b"key-a", 0, 100, 5], "nbytes on the wire"
    assert worker.retrieve(b"key-b", nbytes=5) is None
    with pytest.raises(IndexError, match="buffer index 3"):
        worker.store(b"k", buffer=3)
    worker.shutdown()


def test_retrieve_of_another_length_is_a_miss_that_writes_nothing(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    buffer.view[0:8] = b"8-bytes!"
    assert worker.store(b"k8", nbytes=8)
    buffer.view[200:210] = b"untouched!"
    assert worker.retrieve(b"k8", offset=200, nbytes=4) is None, "stored 8, asked 4: a miss"
    assert worker.retrieve(b"k8", offset=200, nbytes=10) is None, "asked 10: a miss"
    assert bytes(buffer.view[200:210]) == b"untouched!", "nothing written on a miss"
    assert worker.retrieve(b"k8", offset=200, nbytes=8) == 8
    assert bytes(buffer.view[200:210]) == b"8-bytes!d!"
    worker.shutdown()


def test_retrieve_needs_nbytes_and_batch_items_carry_it(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    with pytest.raises(TypeError, match="nbytes"):
        worker.retrieve(b"k", 0, 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="nbytes must be the destination's length"):
        worker.retrieve(b"k", nbytes="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"items\[1\].*\(key, buffer, offset, nbytes\)"):
        worker.retrieve_batch([(b"a", 0, 0, 4), (b"b", 0, 4)])  # type: ignore[list-item]
    assert fake.ops("retrieve") == [] and fake.ops("retrieve_batch") == [], "nothing sent"
    buffer.view[0:8] = b"aaaabbbb"
    assert worker.store_batch([(b"a", 0, 0, 4), (b"b", 0, 4, 4)]) == [True, True]
    buffer.view[1000:1012] = b"\0" * 12
    answers = worker.retrieve_batch([(b"a", 0, 1000, 4), (b"b", 0, 1004, 3), (b"b", 0, 1008, 4)])
    assert answers == [4, None, 4], "b asked with 3 of its 4 bytes is a miss"
    assert bytes(buffer.view[1000:1012]) == b"aaaa\0\0\0\0bbbb"
    [batch] = fake.ops("retrieve_batch")
    assert batch.args[1] == [[b"a", 0, 1000, 4], [b"b", 0, 1004, 3], [b"b", 0, 1008, 4]]
    worker.shutdown()


def test_engine_driven_maps_the_pool_and_round_trips(fake: FakeServer) -> None:
    worker = Worker(fake.path, heartbeat_interval_seconds=INTERVAL)
    pool = worker.register_engine_driven("test-model")
    assert pool.nbytes == FakeServer.SLOT_BYTES * FakeServer.NUM_SLOTS
    slot = worker.prepare_store(b"key")
    assert slot is not None
    slot.view[:3] = b"abc"
    assert worker.commit_store(b"key", 3)
    assert fake.pool[slot.offset : slot.offset + 3] == b"abc", "shared with the server"
    assert worker.prepare_store(b"key") is None, "already stored"
    got = worker.prepare_retrieve(b"key")
    assert got is not None and bytes(got.view) == b"abc"
    assert worker.commit_retrieve(b"key")
    assert worker.prepare_retrieve(b"other") is None
    worker.shutdown()
    assert fake.ops("unregister_engine_driven")


def test_busy_engine_thread_does_not_starve_the_heartbeat(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    interval = 0.5  # the ping's timeout: generous, the point is fairness, not speed
    worker = make_worker(fake, buffer, interval=interval)
    stop = threading.Event()
    unhealthy_seen = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            worker.store(b"hot", nbytes=64)
            if not worker.healthy.is_set():
                unhealthy_seen.set()

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        pinged = fake.wait_for(lambda: len(fake.ops("ping")) >= 5, 6 * interval + 5)
    finally:
        stop.set()
        thread.join()
    assert pinged, "five pings while the engine stores back to back"
    assert len(fake.ops("store")) > 50, "the engine really was busy"
    assert len(fake.ops("ping")) >= 5, "pings got their turn"
    assert worker.healthy.is_set()
    assert not unhealthy_seen.is_set()
    worker.shutdown()


def test_typed_errors_carry_the_servers_code_and_message() -> None:
    error = server_error("forbidden", "instance 7 belongs to uid 1000")
    assert isinstance(error, Forbidden) and isinstance(error, KvwardenError)
    assert error.code == "forbidden" and error.message == "instance 7 belongs to uid 1000"
    assert isinstance(server_error("not_registered", "x"), NotRegistered)
    assert isinstance(server_error("bad_args", "x"), BadArgs)
    novel = server_error("from_the_future", "y")
    assert type(novel).__name__ == "ServerError" and novel.code == "from_the_future"


def test_cuda_ipc_buffer_validates_the_handle() -> None:
    with pytest.raises(ValueError, match="64 bytes, got 10"):
        CudaIpcBuffer(b"x" * 10, device=0, offset=0, nbytes=4)
    wire = CudaIpcBuffer(b"h" * 64, device=1, offset=256, nbytes=4096).wire()
    assert wire == {
        "kind": "cuda_ipc",
        "device": 1,
        "handle": b"h" * 64,
        "offset": 256,
        "nbytes": 4096,
    }


def test_register_kv_cache_with_cuda_ipc_sends_no_fds(fake: FakeServer) -> None:
    worker = Worker(fake.path)
    worker.register_kv_cache([CudaIpcBuffer(b"h" * 64, 0, 0, 1024)], "m", world_size=2)
    reg = registers(fake)[0]
    assert reg.nfds == 0 and reg.args[1][0]["kind"] == "cuda_ipc" and reg.args[3] == 2
    worker.shutdown()


def test_worker_used_after_fork_refuses_loudly(fake: FakeServer, buffer: MemfdBuffer) -> None:
    worker = make_worker(fake, buffer)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: must not act as the parent's instance
        try:
            worker.store(b"k")
            os.write(write_end, b"no error")
        except KvwardenError as error:
            os.write(write_end, error.code.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    answer = os.read(read_end, 100)
    os.waitpid(pid, 0)
    os.close(read_end)
    assert answer == b"forked"
    assert fake.ops("store") == [], "nothing was sent under the parent's id"
    assert worker.store(b"k") is True, "the parent carries on"
    worker.shutdown()


# -- the pidfd in hello (rows 1 and 2: the server's proof of this worker's death) --------


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="os.pidfd_open needs Linux 5.3+")
def test_row_01_hello_carries_a_pidfd_of_this_process_by_default(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    hellos = fake.ops("hello")
    assert len(hellos) == 1
    assert hellos[0].args[2:] == [{"pidfd_index": 0, "wait_ms": 2000}]
    assert hellos[0].nfds == 1
    # The fd is a pidfd, and of this very process.
    assert fake.hello_pidfd_pids == [os.getpid()]
    worker.shutdown()


def test_row_02_send_pidfd_false_sends_no_pidfd_and_only_the_wait(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = Worker(
        fake.path,
        heartbeat_interval_seconds=INTERVAL,
        send_pidfd=False,
        request_timeout_seconds=7.5,
    )
    assert worker.register_kv_cache([buffer], "test-model") == "created"
    hellos = fake.ops("hello")
    assert [(h.args[2:], h.nfds) for h in hellos] == [([{"wait_ms": 7500}], 0)]
    assert fake.hello_pidfd_pids == []
    worker.shutdown()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="os.pidfd_open needs Linux 5.3+")
def test_row_13_a_server_that_refuses_the_pidfd_gets_the_plain_hello_on_the_same_connection(
    fake: FakeServer, buffer: MemfdBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.hello_max_args = 2  # a server from before the pidfd
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        worker = make_worker(fake, buffer)
    hellos = fake.ops("hello")
    assert [(len(h.args), h.nfds) for h in hellos] == [(3, 1), (2, 0)]
    assert hellos[0].conn == hellos[1].conn
    assert any("refused this worker's pidfd" in r.getMessage() for r in caplog.records)
    assert worker.server is not None and worker.server.exit_proof is None
    worker.shutdown()


def test_row_61_a_retrieve_the_server_holds_never_holds_the_heartbeat(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    """The server holds this worker's retrieve for 2 s (a slow L2, a busy pool): the
    heartbeat pings on a connection of its own, so pings go on being answered (about ten
    at 0.2 s; at least five) and the worker stays healthy throughout. Before, the ping
    waited for the worker's connection past its timeout and the worker marked itself
    unhealthy."""
    worker = Worker(fake.path, heartbeat_interval_seconds=0.2, request_timeout_seconds=10.0)
    assert worker.register_kv_cache([buffer], "test-model") == "created"
    assert worker.store(b"held", nbytes=64)
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    fake.hook = lambda record: time.sleep(2.0) if record.op == "retrieve" else None
    before = len(fake.ops("ping"))
    unhealthy_seen = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if not worker.healthy.is_set():
                unhealthy_seen.set()
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        worker.retrieve(b"held", nbytes=64)
    finally:
        done.set()
        watcher.join()
        fake.hook = None
    pinged = len(fake.ops("ping")) - before
    assert pinged >= 5, f"{pinged} pings answered while the retrieve was held"
    assert not unhealthy_seen.is_set(), "healthy while its own retrieve was held"
    worker.shutdown()
