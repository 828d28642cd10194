"""End to end against the real ``kvwarden`` binary, with short timeouts.

Each test starts its own server (``--allow-short-timeouts``: reap timeout 2 s,
registration grace 4 s, resolution 0.1 s unless said otherwise) on a private socket.
Workers run in this process, or as child processes (``worker_child.py``) when the test
must SIGKILL or SIGSTOP them. Status is read over a probe connection that never pings,
so probing cannot keep anyone alive.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List

import pytest
from conftest import wait_until
from real_server import RealServer, find_binary

from kvwarden import BadArgs, Forbidden, Identity, MemfdBuffer, Worker
from kvwarden.wire import Connection

pytestmark = pytest.mark.real_server

HERE = os.path.dirname(os.path.abspath(__file__))
INTERVAL = 0.5


@pytest.fixture(scope="session")
def kvwarden_bin() -> str:
    path = find_binary()
    if path is None:
        pytest.skip(
            "no kvwarden binary: set KVWARDEN_BIN, or build target/debug/kvwarden with "
            "`cargo build -p kvwarden-cli` (python/ci.sh does both)"
        )
    return path


@pytest.fixture
def start_server(kvwarden_bin: str, short_tmp: str) -> Iterator[Callable[..., RealServer]]:
    servers: List[RealServer] = []

    def start(**kwargs: Any) -> RealServer:
        server = RealServer(
            kvwarden_bin,
            os.path.join(short_tmp, "kvwarden.sock"),
            os.path.join(short_tmp, "server.log"),
            **kwargs,
        ).start()
        servers.append(server)
        return server

    yield start
    try:
        for server in servers:
            server.check_no_ping_answered_false()
    finally:
        for server in servers:
            server.stop()
            print(f"--- server log ({server.log_path}) ---\n{server.log_tail(60)}")


class Child:
    """A worker in its own process, driven over stdin/stdout."""

    def __init__(self, socket_path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "worker_child.py"), socket_path, str(INTERVAL)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        self.instance_id: int = hello["instance_id"]
        assert hello["stored"] is True

    def _read(self) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker child exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, command: str) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def children() -> Iterator[List[Child]]:
    spawned: List[Child] = []
    yield spawned
    for child in spawned:
        child.kill()


def make_worker(server: RealServer, buffers: List[MemfdBuffer]) -> Worker:
    buffer = MemfdBuffer.create(1 << 16, "real-kv")
    buffers.append(buffer)
    worker = Worker(
        server.socket_path, heartbeat_interval_seconds=INTERVAL, request_timeout_seconds=5.0
    )
    assert worker.register_kv_cache([buffer], "real-model") == "created"
    return worker


@pytest.fixture
def buffers() -> Iterator[List[MemfdBuffer]]:
    made: List[MemfdBuffer] = []
    yield made
    for buffer in made:
        try:
            buffer.close()
        except BufferError:
            pass


def liveness(server: RealServer) -> Dict[str, Any]:
    return server.status()["worker_liveness"]


# ---------------------------------------------------------------------------------


def test_real_memfd_store_retrieve_lookup_round_trip(start_server, buffers) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    view = buffers[0].view
    view[0:11] = b"kv-bytes-01"
    assert worker.store(b"block-1", nbytes=11) is True
    assert worker.lookup([b"block-1", b"block-2"]) == 1
    view[1000:1011] = b"\0" * 11
    assert worker.retrieve(b"block-1", offset=1000, nbytes=11) == 11
    assert bytes(view[1000:1011]) == b"kv-bytes-01"
    assert worker.retrieve(b"block-2", nbytes=11) is None, "a miss is None"
    view[2000:2012] = b"untouched!!!"
    assert worker.retrieve(b"block-1", offset=2000, nbytes=10) is None, "another length: a miss"
    assert worker.retrieve(b"block-1", offset=2000, nbytes=12) is None, "another length: a miss"
    assert bytes(view[2000:2012]) == b"untouched!!!", "and nothing was written"
    assert [e["module"] for e in server.entries(worker.instance_id)] == ["server_driven"]
    worker.shutdown()


def test_real_kv_events_start_with_what_is_held_then_follow_the_stores(
    start_server, buffers
) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    buffers[0].view[0:4] = b"abcd"
    assert worker.store(b"held-1", nbytes=4) is True
    page = worker.kv_events()
    assert page.resync, "a new reader starts over"
    assert page.events == [(True, b"held-1", "l1", None)]
    assert not page.more
    assert worker.store(b"held-2", nbytes=4) is True
    page = worker.kv_events(page.cursor)
    assert (page.resync, page.events, page.more) == (
        False,
        [(True, b"held-2", "l1", None)],
        False,
    )
    # Caught up: nothing new, the same cursor works again.
    assert worker.kv_events(page.cursor).events == []
    # A description travels with the key: told again, with it.
    assert worker.describe_keys([(b"held-2", b"what it is"), (b"never", b"x")]) == [True, False]
    page = worker.kv_events(page.cursor)
    assert page.events == [(True, b"held-2", "l1", b"what it is")]
    worker.shutdown()


def test_real_store_batch_then_retrieve_batch_moves_every_block(start_server, buffers) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    view = buffers[0].view
    block = 256
    for i in range(16):
        view[i * block : (i + 1) * block] = bytes([i]) * block
    stores = [(b"blk-%d" % i, 0, i * block, block) for i in range(16)]
    assert worker.store_batch(stores) == [True] * 16
    assert worker.lookup([key for key, _, _, _ in stores]) == 16
    view[32768 : 32768 + 16 * block] = b"\0" * (16 * block)
    retrieves = [(b"blk-%d" % i, 0, 32768 + i * block, block) for i in range(16)]
    retrieves[5] = (b"absent", 0, 32768 + 5 * block, block)
    retrieves[9] = (b"blk-9", 0, 32768 + 9 * block, block - 1)  # another length: a miss
    answers = worker.retrieve_batch(retrieves)
    assert answers[5] is None and answers[9] is None, "a miss is None"
    assert answers[:5] + answers[6:9] + answers[10:] == [block] * 14
    for i in range(16):
        want = b"\0" * block if i in (5, 9) else bytes([i]) * block
        got = bytes(view[32768 + i * block : 32768 + (i + 1) * block])
        assert got == want, f"block {i}"
    assert worker.store_batch([]) == [] and worker.retrieve_batch([]) == []
    worker.shutdown()


def test_real_batch_with_a_bad_item_is_bad_args_naming_it_and_copies_nothing(
    start_server, buffers
) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    with pytest.raises(BadArgs, match=r"items\[1\]: offset 65000"):
        worker.store_batch([(b"good", 0, 0, 8), (b"bad", 0, 65000, 1000)])
    assert worker.lookup([b"good"]) == 0, "nothing stored"
    assert worker.store_batch([(b"good", 0, 0, 8)]) == [True]
    with pytest.raises(BadArgs, match=r"items\[1\].*65535"):
        worker.retrieve_batch([(b"good", 0, 100, 8), (b"good", 0, 65535, 8)])
    with pytest.raises(IndexError, match=r"items\[0\]: buffer index 3"):
        worker.retrieve_batch([(b"good", 3, 0, 8)])
    worker.shutdown()


def test_real_shutdown_unregisters_and_frees_the_context(start_server, buffers) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    worker.store(b"k", nbytes=4)
    wait_until(lambda: server.entries(worker.instance_id)[0]["proven"], 10, "a ping arrived")
    worker.shutdown()
    assert server.entries(worker.instance_id) == []
    status = server.status()
    assert status["contexts"]["freed_total"]["unregistered"] == 1
    assert status["worker_liveness"]["tracked_instances"] == 0


def test_real_old_ping_payload_is_bad_args_naming_the_mismatch(start_server) -> None:
    server = start_server()
    with pytest.raises(BadArgs) as caught:
        server.request("ping", [])
    assert caught.value.code == "bad_args"
    assert "ping" in caught.value.message and "version" in caught.value.message
    assert server.request("ping", [None]) is True, "the connection stays usable"


def test_real_mixed_version_ping_is_logged_loudly_and_leaves_the_worker_unhealthy(
    start_server, buffers, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that pings with the pre-liveness payload ``ping []`` (an old client, or
    a server of another protocol): the real server answers bad_args, and the worker
    says so at ERROR and stays unhealthy instead of carrying on silently."""
    server = start_server()
    worker = make_worker(server, buffers)
    send = worker._request

    def old_ping(op: str, args: List[Any], fds=(), timeout=None, conn=None):
        return send(op, [] if op == "ping" else args, fds, timeout, conn)

    monkeypatch.setattr(worker, "_request", old_ping)
    with caplog.at_level(logging.ERROR, logger="kvwarden"):
        worker.store(b"k", nbytes=4)
        wait_until(lambda: not worker.healthy.is_set(), 10, "unhealthy after a bad_args ping")
        time.sleep(3 * INTERVAL)
    assert not worker.healthy.is_set(), "stays unhealthy"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "bad_args" in errors[0] and "version" in errors[0]
    assert worker.store(b"k2", nbytes=4) is False, "stores are skipped"
    assert worker.recoveries == 0, "a version mismatch is not a reason to re-register"
    worker.shutdown()


def test_real_live_worker_with_heartbeat_is_never_reaped(start_server, buffers) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    worker.store(b"k", nbytes=4)
    deadline = time.monotonic() + 3 * 2.0  # three reap timeouts
    while time.monotonic() < deadline:
        assert len(server.entries(worker.instance_id)) == 1
        assert worker.healthy.is_set()
        time.sleep(0.2)
    assert liveness(server)["reaped_total"] == 0
    assert server.status()["contexts"]["built_total"] == 1
    worker.shutdown()


def test_real_sigkilled_worker_is_freed_by_process_exit(start_server, buffers, children) -> None:
    # A long reap timeout: only the process-exit proof can free it this fast.
    server = start_server(
        reap_timeout_seconds=60.0, registration_grace_seconds=120.0, resolution_seconds=1.0
    )
    sibling = make_worker(server, buffers)
    sibling.store(b"s", nbytes=4)
    child = Child(server.socket_path)
    children.append(child)
    wait_until(
        lambda: (
            bool(server.entries(child.instance_id))
            and server.entries(child.instance_id)[0]["proven"]
        ),
        10,
        "child pinged",
    )
    assert server.entries(child.instance_id)[0]["watched_pid"] == child.proc.pid
    assert server.entries(child.instance_id)[0]["death_noticed_by"] == "pidfd_from_peer"
    child.proc.kill()
    child.proc.wait()
    killed_at = time.monotonic()
    wait_until(lambda: server.entries(child.instance_id) == [], 5, "freed after SIGKILL")
    assert time.monotonic() - killed_at < 5.0  # far below the 60 s reap timeout
    status = server.status()
    assert status["contexts"]["freed_total"]["process_exited"] == 1
    assert status["worker_liveness"]["reaped_total"] == 0
    assert len(server.entries(sibling.instance_id)) == 1, "the live sibling is untouched"
    assert sibling.healthy.is_set()
    sibling.shutdown()


def test_real_frozen_worker_recovers_on_thaw_with_exactly_one_context(
    start_server, children
) -> None:
    server = start_server()
    server.pings_answered_false_expected = "the frozen worker is reaped; its first ping on thaw"
    child = Child(server.socket_path)
    children.append(child)
    wait_until(lambda: bool(server.entries(child.instance_id)), 10, "child registered")
    built_before = server.status()["contexts"]["built_total"]
    child.proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: server.entries(child.instance_id) == [], 10, "frozen worker reaped")
    assert liveness(server)["reaped_total"] == 1
    assert child.proc.poll() is None, "still alive, only stopped"
    child.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: len(server.entries(child.instance_id)) == 1, 10, "re-registered on thaw")
    wait_until(lambda: child.ask("state")["healthy"], 10, "child healthy again")
    state = child.ask("state")
    assert state["recoveries_ok"] >= 1
    assert len(server.entries(child.instance_id)) == 1, "exactly one context"
    assert server.status()["contexts"]["built_total"] == built_before + 1
    assert child.ask("store again")["stored"] is True
    assert child.ask("exit") == {"bye": True}
    assert server.entries(child.instance_id) == []


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_real_server_restart_under_live_workers_each_end_with_one_context(
    start_server, buffers, how: str
) -> None:
    server = start_server()
    server.pings_answered_false_expected = "a restarted server holds nothing"
    workers = [make_worker(server, buffers) for _ in range(2)]
    for index, worker in enumerate(workers):
        buffers[index].view[:4] = f"w{index}!!".encode()
        assert worker.store(b"before-%d" % index, nbytes=4)
    server.restart(getattr(signal, how))
    for worker in workers:
        wait_until(lambda w=worker: len(server.entries(w.instance_id)) == 1, 15, "re-registered")
    for worker in workers:
        wait_until(worker.healthy.is_set, 10, "healthy after the restart")
    status = server.status()
    assert status["worker_liveness"]["tracked_instances"] == 2
    assert status["contexts"]["built_total"] == 2, "exactly one context each"
    for index, worker in enumerate(workers):
        assert worker.retrieve(b"before-%d" % index, nbytes=4) is None, "the new L1 is empty"
        assert worker.store(b"after-%d" % index, nbytes=4) is True
        assert worker.retrieve(b"after-%d" % index, offset=8, nbytes=4) == 4
    time.sleep(3 * INTERVAL)
    assert server.status()["contexts"]["built_total"] == 2, "no duplicate registration later"
    for worker in workers:
        worker.shutdown()


def test_real_server_pause_shorter_than_timeout_recovers_by_refresh(start_server, buffers) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    worker.store(b"k", nbytes=4)
    wait_until(lambda: server.entries(worker.instance_id)[0]["proven"], 10, "a ping arrived")
    server.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: not worker.healthy.is_set(), 5, "unhealthy while the server is paused")
        assert worker.store(b"k2") is False, "stores are skipped while unhealthy"
    finally:
        server.signal(signal.SIGCONT)
    wait_until(worker.healthy.is_set, 10, "healthy after the pause")
    assert worker.recoveries_ok >= 1, "health came back through a recovery"
    status = server.status()
    assert status["contexts"]["built_total"] == 1, "the recovery refreshed: zero contexts built"
    assert status["worker_liveness"]["reaped_total"] == 0
    worker.shutdown()


def test_real_idle_worker_reaped_at_grace_rejoins_through_not_registered(
    start_server, buffers
) -> None:
    server = start_server()
    server.pings_answered_false_expected = "the idle worker is reaped at the registration grace"
    worker = make_worker(server, buffers)
    assert not worker.heartbeat_started()
    wait_until(
        lambda: server.entries(worker.instance_id) == [], 10, "reaped at the registration grace"
    )
    assert worker.healthy.is_set(), "the worker cannot know yet"
    assert worker.store(b"k", nbytes=4) is False, "answered not_registered"
    wait_until(lambda: len(server.entries(worker.instance_id)) == 1, 10, "re-registered, same id")
    wait_until(worker.healthy.is_set, 10, "healthy")
    assert worker.store(b"k", nbytes=4) is True
    assert server.status()["contexts"]["built_total"] == 2
    worker.shutdown()


def test_real_engine_driven_store_retrieve_round_trip(start_server) -> None:
    server = start_server()
    worker = Worker(server.socket_path, heartbeat_interval_seconds=INTERVAL)
    try:
        pool = worker.register_engine_driven("real-model")
        assert pool.nbytes > 0
        slot = worker.prepare_store(b"ed-key")
        assert slot is not None
        slot.view[:6] = b"engine"
        assert worker.commit_store(b"ed-key", 6)
        got = worker.prepare_retrieve(b"ed-key")
        assert got is not None and bytes(got.view[:6]) == b"engine"
        assert worker.commit_retrieve(b"ed-key")
        assert worker.prepare_retrieve(b"absent") is None
        assert [e["module"] for e in server.entries(worker.instance_id)] == ["engine_driven"]
    finally:
        worker.shutdown()
    assert server.entries(worker.instance_id) == []


def test_real_register_blend(start_server, buffers) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    try:
        assert worker.register_blend(128, 4096, 10000.0) is True
    finally:
        worker.shutdown()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="os.pidfd_open needs Linux 5.3+")
def test_real_row_01_worker_sends_its_pidfd_and_row_02_send_pidfd_false_falls_back_to_the_pid(
    start_server, buffers
) -> None:
    """Rows 1 and 2: by default the server notices this worker's death through the
    pidfd it sent (which works in any PID namespace); with ``send_pidfd=False`` only
    through the pid it can see (none in another namespace)."""
    server = start_server()
    sends = make_worker(server, buffers)
    buffer = MemfdBuffer.create(1 << 16, "real-kv-old")
    buffers.append(buffer)
    old = Worker(server.socket_path, heartbeat_interval_seconds=INTERVAL, send_pidfd=False)
    assert old.register_kv_cache([buffer], "real-model") == "created"
    assert sends.server is not None and sends.server.exit_proof == "pidfd_from_peer"
    assert old.server is not None and old.server.exit_proof == "pidfd_by_pid"
    [entry] = server.entries(sends.instance_id)
    assert entry["death_noticed_by"] == "pidfd_from_peer"
    assert entry["watched_pid"] == os.getpid()
    [entry] = server.entries(old.instance_id)
    assert entry["death_noticed_by"] == "pidfd_by_pid"
    counts = server.status()["instances_by_death_notice"]
    assert counts == {"pidfd_from_peer": 1, "pidfd_by_pid": 1, "timeout_only": 0}
    sends.shutdown()
    old.shutdown()


# -- protocol 2: who is who ------------------------------------------------------------


def test_real_hello_says_protocol_3_with_the_tenant_and_attach_claims_then_proves(
    start_server, buffers
) -> None:
    server = start_server()
    worker = make_worker(server, buffers)
    assert worker.server is not None and worker.server.protocol == 3
    assert worker.server.tenant == f"uid-{os.getuid()}"
    # The probe connection has not attached the worker's id: forbidden, naming attach.
    with pytest.raises(Forbidden, match="attach"):
        server.request("ping", [worker.instance_id])
    assert server.request("ping", [None]) is True, "ping [nil] needs no attach"
    # Another secret for a bound id: forbidden; the worker's own: proven.
    with pytest.raises(Forbidden):
        server.request("attach", [worker.instance_id, b"x" * 32])
    secret = worker._identity.secret
    assert server.request("attach", [worker.instance_id, secret]) == {"outcome": "proven"}
    assert server.request("ping", [worker.instance_id]) is True, "attached now"
    with pytest.raises(BadArgs):
        server.request("attach", [worker.instance_id, b"short"])
    # A fresh id: claimed.
    assert server.request("attach", [12345, b"y" * 16]) == {"outcome": "claimed"}
    assert worker.store(b"k", nbytes=4) is True
    assert worker.identity_changes == 0
    worker.shutdown()


def test_real_forbidden_naming_attach_is_answered_by_attaching_and_one_retry(
    start_server, buffers
) -> None:
    """The worker skips its attach on the first connection (as a buggy client would):
    the real server answers the register forbidden with a message naming attach, and
    the worker attaches on that same connection and retries once, successfully."""
    server = start_server()
    buffer = MemfdBuffer.create(1 << 16, "real-kv")
    buffers.append(buffer)
    worker = Worker(server.socket_path, heartbeat_interval_seconds=INTERVAL)
    real_attach = worker._conn._on_attach
    skipped: List[int] = []

    def attach_from_the_second_call(call) -> None:  # type: ignore[no-untyped-def]
        if not skipped:
            skipped.append(1)
            return
        real_attach(call)

    worker._conn._on_attach = attach_from_the_second_call
    assert worker.register_kv_cache([buffer], "real-model") == "created"
    assert skipped == [1] and worker._conn.connects == 1, "the same connection"
    assert len(server.entries(worker.instance_id)) == 1
    worker.shutdown()


def test_real_squatted_id_is_traded_for_a_fresh_one_and_registered_there(
    start_server, buffers
) -> None:
    server = start_server()
    squatter = Connection(server.socket_path, "squatter")
    squatted = 0x5EED
    try:
        squatter.request("attach", [squatted, b"s" * 32], 5.0)  # holds it while connected
        buffer = MemfdBuffer.create(1 << 16, "real-kv")
        buffers.append(buffer)
        worker = Worker(server.socket_path, heartbeat_interval_seconds=INTERVAL)
        worker._identity = Identity(squatted, b"w" * 32)  # a victim that drew that id
        assert worker.register_kv_cache([buffer], "real-model") == "created"
        assert worker.identity_changes == 1 and worker.instance_id != squatted
        assert len(server.entries(worker.instance_id)) == 1
        assert server.entries(squatted) == []
        assert worker.store(b"k", nbytes=4) is True
        worker.shutdown()
    finally:
        squatter.close()


def test_real_id_squatted_across_a_server_restart_recovers_under_a_fresh_id_with_one_context(
    start_server, buffers
) -> None:
    server = start_server()
    server.pings_answered_false_expected = "a restarted server holds nothing"
    worker = make_worker(server, buffers)
    assert worker.store(b"k", nbytes=4) is True
    old_id = worker.instance_id
    squatter = None
    # Keep the worker off its connection while the server restarts and the squatter
    # claims its id: its ping waits for the lock, times out, and the worker is unhealthy.
    assert worker._conn._lock.acquire(5.0)
    try:
        server.restart()
        squatter = Connection(server.socket_path, "squatter")
        claimed = squatter.request("attach", [old_id, b"s" * 32], 5.0)[0]
        assert claimed == {"outcome": "claimed"}
    finally:
        worker._conn._lock.release()
    try:
        wait_until(lambda: worker.identity_changes == 1, 10, "the worker moved to a fresh id")
        new_id = worker.instance_id
        wait_until(lambda: len(server.entries(new_id)) == 1, 10, "re-registered, fresh id")
        wait_until(worker.healthy.is_set, 10, "healthy")
        assert server.entries(old_id) == []
        assert server.status()["contexts"]["built_total"] == 1, "exactly one context"
        assert worker.store(b"k2", nbytes=4) is True
        time.sleep(3 * INTERVAL)
        assert server.status()["contexts"]["built_total"] == 1
        worker.shutdown()
    finally:
        squatter.close()


def _free_tcp_port() -> int:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def test_real_tcp_needs_the_token_from_the_file_and_is_a_tenant_of_its_own(
    start_server, buffers, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWARDEN_TCP_TOKEN_FILE", raising=False)
    token = os.path.join(short_tmp, "token")
    with open(token, "w") as f:
        f.write("  real-tcp-token-of-32-bytes-long\n")  # the server wants >= 16
    os.chmod(token, 0o600)
    port = _free_tcp_port()
    server = start_server(extra_args=["--tcp", f"127.0.0.1:{port}", "--tcp-token-file", token])
    server.pings_answered_false_expected = "the TCP worker pings an id it never registered"
    local = make_worker(server, buffers)  # over the Unix socket: tenant uid-<uid>
    assert local.store(b"tenant-key", nbytes=4) is True
    assert local.lookup([b"tenant-key"]) == 1
    worker = Worker(tcp_address=f"127.0.0.1:{port}", tcp_token_file=token)
    try:
        assert worker.ping() is False, "attached, not registered"
        assert worker.server is not None and worker.server.protocol == 3
        assert worker.server.tenant == "tcp" and worker.server_uid is None
        assert worker.lookup([b"tenant-key"]) == 0, "another tenant's key is not ours"
    finally:
        worker.shutdown()
        local.shutdown()
    with pytest.raises(Forbidden, match="tcp_token_file"):
        Worker(tcp_address=f"127.0.0.1:{port}").ping()
    wrong = os.path.join(short_tmp, "wrong")
    with open(wrong, "w") as f:
        f.write("not-the-token-but-as-long-as-one")
    with pytest.raises(Forbidden):
        Worker(tcp_address=f"127.0.0.1:{port}", tcp_token_file=wrong).ping()
    assert server.request("ping", [None]) is True
