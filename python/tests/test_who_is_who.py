"""Who is who, against the fake server: ``attach`` on every connection, a squatted id
traded for a fresh one (counted, registrations replayed), ``forbidden`` naming attach
answered by attaching again, the server's uid checked before any fd is sent, TCP's
mutual challenge on the token (protocol 3: the token never travels, a server that
cannot prove it holds the token is sent nothing more), the default socket path and
``hello``'s protocol and tenant.

The fake enforces what the real server does (``fake_server.py``): an op naming an
instance from a connection that did not attach it is ``forbidden``, so every test
here that registers or transfers also fails if the worker does not attach.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from typing import Dict, Iterator, List, Optional, Tuple

import msgpack
import pytest
from conftest import wait_until
from fake_server import NAMING_OPS, SQUATTER_SECRET, FakeServer, _tcp_key, _tcp_proofs

from kvwarden import (
    ConnectionLost,
    CudaIpcBuffer,
    Forbidden,
    MemfdBuffer,
    UnknownOp,
    UntrustedServer,
    Worker,
    default_socket_path,
)
from kvwarden.wire import Connection, TcpKey
from kvwarden.worker import MAX_ATTACH_ATTEMPTS, SECRET_BYTES

INTERVAL = 0.2
NOBODY = 65534


@pytest.fixture
def buffer() -> Iterator[MemfdBuffer]:
    buf = MemfdBuffer.create(8192, "test-kv")
    yield buf
    buf.close()


def make_worker(fake: FakeServer, buffer: MemfdBuffer, **kwargs) -> Worker:
    worker = Worker(
        fake.path, heartbeat_interval_seconds=INTERVAL, request_timeout_seconds=2.0, **kwargs
    )
    assert worker.register_kv_cache([buffer], "test-model") == "created"
    return worker


def by_connection(fake: FakeServer) -> List[List[Tuple[str, object]]]:
    """Per connection, in order: (op, the instance named or the attach's id)."""
    conns: dict = {}
    for record in fake.requests:
        if record.conn in fake._heartbeat_conns():
            continue
        named = record.args[0] if record.op in NAMING_OPS or record.op == "attach" else None
        conns.setdefault(record.conn, []).append((record.op, named))
    return [conns[serial] for serial in sorted(conns)]


def assert_attached_before_naming(fake: FakeServer) -> None:
    """On every connection: hello first, then attach, and every op naming an instance
    names one this connection attached earlier."""
    for ops in by_connection(fake):
        assert ops[0][0] == "hello", ops
        attached = set()
        for op, named in ops[1:]:
            if op == "attach":
                attached.add(named)
            elif named is not None:
                assert named in attached, f"{op} named {named} before attaching it: {ops}"


# -- attach --------------------------------------------------------------------------


def test_attach_follows_hello_on_every_connection_with_a_32_byte_secret(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    ops = by_connection(fake)
    assert [op for op, _ in ops[0]] == ["hello", "attach", "register_kv_cache"]
    [attach] = fake.attaches()
    instance, secret = attach.args
    assert instance == worker.instance_id
    assert isinstance(secret, bytes) and len(secret) == SECRET_BYTES == 32
    assert fake.attaches("claimed") == [attach], "a new id: claimed"
    # A reconnect to the same server (the registration holds the binding): proven.
    worker._conn.drop("test: a broken connection")
    assert worker.store(b"k", nbytes=4) is True
    assert [a.conn for a in fake.attaches("proven")] == [fake.ops("store")[0].conn]
    assert fake.attaches()[1].args == [worker.instance_id, secret], "same id, same secret"
    # A restarted server (nothing bound): claimed again, same secret.
    restarted_at = time.monotonic()
    fake.restart()
    wait_until(lambda: len(fake.ops("register_kv_cache")) == 2, 10, "re-registered")
    wait_until(worker.healthy.is_set, 10, "healthy after the restart")
    third = fake.attaches()[2]
    assert third.args == [worker.instance_id, secret]
    # The restarted server knew nothing: one attach since claimed the id, and every
    # other one (the other connection's, or a recovery's whose connection broke
    # mid-restart) either proved it or, once no connection held it, claimed it again:
    # always the same id and secret, never refused, and bound to that secret now.
    since = [a for a in fake.ops("attach", heartbeat=True) if a.at >= restarted_at]
    outcomes = [_outcome(a) for a in since]
    assert len(since) >= 2 and "claimed" in outcomes, since
    assert set(outcomes) <= {"claimed", "proven"}, since
    assert all(a.args == [worker.instance_id, secret] for a in since), since
    assert fake.bindings[worker.instance_id] == secret
    assert_attached_before_naming(fake)
    assert worker.identity_changes == 0
    assert fake.contexts_built == 2, "exactly one context after the restart"
    worker.shutdown()


def test_two_workers_draw_different_ids_and_secrets(fake: FakeServer) -> None:
    a, b = Worker(fake.path), Worker(fake.path)
    assert a.ping() is False and b.ping() is False  # each connects and attaches
    (ida, seca), (idb, secb) = [r.args for r in fake.attaches()]
    assert ida != idb and seca != secb
    assert a._identity.secret == seca and repr(seca) not in repr(a._identity), "never logged"
    a.shutdown()
    b.shutdown()


def test_an_id_squatted_at_first_connect_is_traded_before_registering(
    fake: FakeServer, buffer: MemfdBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker(fake.path, heartbeat_interval_seconds=INTERVAL)
    squatted = worker.instance_id
    fake.squat(squatted)
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        assert worker.register_kv_cache([buffer], "test-model") == "created"
    assert worker.instance_id != squatted and worker.identity_changes == 1
    assert [_outcome(a) for a in fake.attaches()] == ["forbidden", "claimed"]
    assert fake.attaches()[1].args[0] == worker.instance_id
    [reg] = fake.ops("register_kv_cache")
    assert reg.args[0] == worker.instance_id, "registered under the fresh id only"
    assert fake.bindings[squatted] == SQUATTER_SECRET, "the squatter's binding untouched"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(squatted) in w and str(worker.instance_id) in w for w in warnings), warnings
    assert worker.recoveries == 0, "nothing was registered yet: nothing to replay"
    worker.shutdown()


def test_an_id_squatted_across_a_restart_moves_the_worker_and_replays_its_registrations(
    fake: FakeServer, buffer: MemfdBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    worker = make_worker(fake, buffer)
    assert worker.register_blend(64, 128, 10000.0) is True
    worker.store(b"k", nbytes=4)
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    old_id, old_secret = worker.instance_id, fake.attaches()[0].args[1]
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        fake.restart(squat=[old_id])  # another process got there first
        wait_until(
            lambda: worker.instance_id in fake.registered and worker.healthy.is_set(),
            10,
            "re-registered under a fresh id and healthy",
        )
    new_id = worker.instance_id
    assert new_id != old_id and worker.identity_changes == 1
    regs = fake.ops("register_kv_cache")
    assert [r.args[0] for r in regs] == [old_id, new_id], "replayed once, under the new id"
    assert regs[1].nfds == 1, "with its memfd"
    assert [r.args[0] for r in fake.ops("register_blend")] == [old_id, new_id]
    assert fake.registered == {new_id} and fake.contexts_built == 2
    # After the restart the first connection to attach (the worker's or its heartbeat's)
    # is refused the old id and claims a fresh one on the same connection.
    everyone = fake.ops("attach", heartbeat=True)
    forbidden = next(a for a in everyone if _outcome(a) == "forbidden")
    claimed = next(a for a in everyone if a.at > forbidden.at and a.conn == forbidden.conn)
    assert forbidden.args == [old_id, old_secret] and _outcome(forbidden) == "forbidden"
    assert claimed.args[0] == new_id and claimed.args[1] != old_secret
    assert _outcome(claimed) == "claimed" and claimed.conn == forbidden.conn
    after = [r for r in fake.requests if r.at > forbidden.at and r.op in NAMING_OPS]
    assert after and all(r.args[0] == new_id for r in after), "never the old id again"
    assert any("identity change #1" in r.getMessage() for r in caplog.records)
    assert_attached_before_naming(fake)
    time.sleep(3 * INTERVAL)
    assert len(fake.ops("register_kv_cache")) == 2, "no further recovery"
    assert worker.store(b"k2", nbytes=4) is True
    worker.shutdown()
    assert fake.ops("unregister_kv_cache")[0].args == [new_id]


def test_a_squat_found_before_the_heartbeat_started_still_replays_the_registration(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = make_worker(fake, buffer)
    assert not worker.heartbeat_started()
    old_id = worker.instance_id
    fake.restart(squat=[old_id])
    with pytest.raises(ConnectionLost):
        worker.status()  # the old connection was cut
    worker.status()  # reconnects: the attach is refused, the id changes
    assert worker.identity_changes == 1 and worker.instance_id != old_id
    assert worker.heartbeat_started(), "a registration to replay starts the heartbeat"
    wait_until(
        lambda: worker.instance_id in fake.registered and worker.healthy.is_set(),
        10,
        "replayed under the fresh id",
    )
    assert [r.args[0] for r in fake.ops("register_kv_cache")] == [old_id, worker.instance_id]
    worker.shutdown()


def test_an_id_change_between_two_recovery_steps_redoes_the_whole_recovery(
    fake: FakeServer, buffer: MemfdBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recovery's first step (the KV cache) goes out under the old id; then the
    server restarts, a squatter takes the id and the second step (engine-driven)
    reconnects as a fresh id. Reporting that recovery as done would leave the KV cache
    registered under no id the worker still has: it must be redone under the new one."""
    worker = make_worker(fake, buffer)
    worker.register_engine_driven("test-model")
    worker.store(b"k", nbytes=4)
    assert fake.wait_for(lambda: len(fake.ops("ping")) >= 1, 5)
    original = worker._send_kv_registration
    lost: List[int] = []

    def then_the_server_restarts(*args):  # type: ignore[no-untyped-def]
        outcome = original(*args)
        if not lost:
            lost.append(worker.instance_id)
            fake.restart(squat=[worker.instance_id])
            worker._conn.drop("test: an engine thread saw the connection break")
        return outcome

    monkeypatch.setattr(worker, "_send_kv_registration", then_the_server_restarts)
    fake.forget(worker.instance_id)  # a reap: the next ping answers false, recovery
    wait_until(
        lambda: (
            worker.identity_changes == 1
            and worker.instance_id in fake.registered
            and worker.instance_id in fake.engine_registered
            and worker.healthy.is_set()
        ),
        10,
        "both registrations under the fresh id, and healthy",
    )
    assert lost and lost[0] != worker.instance_id
    assert worker.recoveries >= 2 and worker.recoveries - worker.recoveries_ok >= 1
    worker.shutdown()


def test_attach_refused_for_every_fresh_id_gives_up_with_forbidden(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    fake.forbid["attach"] = "`attach`: tenant uid-0 may attach no instance"
    worker = Worker(fake.path)
    with pytest.raises(Forbidden, match=f"{MAX_ATTACH_ATTEMPTS} fresh instance ids"):
        worker.register_kv_cache([buffer], "m")
    assert worker.identity_changes == MAX_ATTACH_ATTEMPTS
    assert len({a.args[0] for a in fake.attaches()}) == MAX_ATTACH_ATTEMPTS
    assert fake.ops("register_kv_cache") == [], "never sent unattached"
    assert not worker._conn.is_connected(), "an unattached connection is not kept"
    worker.shutdown()


def test_a_server_without_attach_is_named_as_protocol_1(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    original = fake._attach
    fake._attach = lambda serial, args: (  # type: ignore[method-assign]
        False,
        {"code": "unknown_op", "message": "unknown op `attach`"},
        [],
    )
    worker = Worker(fake.path)
    with pytest.raises(UnknownOp, match="protocol 1.*upgrade the server"):
        worker.register_kv_cache([buffer], "m")
    fake._attach = original  # type: ignore[method-assign]
    assert worker.register_kv_cache([buffer], "m") == "created", "a fresh connection attaches"
    worker.shutdown()


# -- forbidden naming attach: attach again, retry once ------------------------------


def _quiet_worker(fake: FakeServer, buffer: MemfdBuffer) -> Worker:
    """A registered worker whose heartbeat sent its first ping and sends no other for
    a long while: the test's requests are then the only ones."""
    worker = Worker(fake.path, heartbeat_interval_seconds=30.0, request_timeout_seconds=2.0)
    assert worker.register_kv_cache([buffer], "test-model") == "created"
    assert worker.store(b"warm-up", nbytes=4) is True
    assert fake.wait_for(lambda: any(r.answer for r in fake.ops("ping")), 5)
    fake.requests.clear()
    return worker


def test_forbidden_naming_attach_is_answered_by_attaching_again_and_one_retry(
    fake: FakeServer, buffer: MemfdBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    worker = _quiet_worker(fake, buffer)
    buffer.view[:4] = b"data"
    fake.detach()  # the server no longer counts this connection as attached
    with caplog.at_level(logging.WARNING, logger="kvwarden"):
        assert worker.store(b"k", nbytes=4) is True
    stores = fake.ops("store")
    assert [_outcome(s) for s in stores] == ["forbidden", "True"]
    assert "attach" in stores[0].answer[1]["message"]
    attaches = fake.attaches()
    assert [_outcome(a) for a in attaches] == ["proven"], "attached again: the same binding"
    assert stores[0].at < attaches[0].at < stores[1].at, "attached before the retry"
    assert len({r.conn for r in fake.requests}) == 1 and fake.ops("hello") == []
    assert worker.identity_changes == 0
    assert any("attaching again" in r.getMessage() for r in caplog.records)
    worker.shutdown()


def test_forbidden_naming_attach_twice_in_a_row_is_raised_after_one_retry(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = _quiet_worker(fake, buffer)
    fake.detach_before = {"store"}
    with pytest.raises(Forbidden, match="attach"):
        worker.store(b"k", nbytes=4)
    assert len(fake.ops("store")) == 2, "one retry, not more"
    assert len(fake.attaches()) == 1
    worker.shutdown()


def test_forbidden_for_another_reason_is_raised_without_a_retry(
    fake: FakeServer, buffer: MemfdBuffer
) -> None:
    worker = _quiet_worker(fake, buffer)
    fake.forbid["store"] = "instance 7 belongs to tenant uid-1000, the caller is uid-0"
    with pytest.raises(Forbidden, match="belongs to tenant"):
        worker.store(b"k", nbytes=4)
    assert len(fake.ops("store")) == 1 and fake.attaches() == []
    worker.shutdown()


# -- the server's credentials ------------------------------------------------------


def _peercred_as(monkeypatch: pytest.MonkeyPatch, uid: int) -> List[int]:
    """Makes ``SO_PEERCRED`` on client sockets report ``uid``; returns a list that
    records each call's socket family (the fake server's own sockets are left alone)."""
    calls: List[int] = []
    real = socket.socket.getsockopt

    def getsockopt(self, level, option, *rest):  # type: ignore[no-untyped-def]
        if level == socket.SOL_SOCKET and option == socket.SO_PEERCRED:
            client = self.family != socket.AF_UNIX or not self.getsockname()
            if client:
                calls.append(self.family)
                if self.family == socket.AF_UNIX:
                    return struct.pack("3i", 4321, uid, uid)
        return real(self, level, option, *rest)

    monkeypatch.setattr(socket.socket, "getsockopt", getsockopt)
    return calls


def test_untrusted_server_uid_is_refused_before_anything_is_sent(
    fake: FakeServer, buffer: MemfdBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWARDEN_TRUSTED_SERVER_UIDS", raising=False)
    _peercred_as(monkeypatch, 4242)
    worker = Worker(fake.path)
    with pytest.raises(UntrustedServer) as caught:
        worker.register_kv_cache([buffer], "m")
    message = caught.value.message
    assert fake.path in message and "uid 4242" in message
    assert "trusted_server_uids" in message and "KVWARDEN_TRUSTED_SERVER_UIDS" in message
    assert caught.value.uid == 4242 and caught.value.code == "untrusted_server"
    assert isinstance(caught.value, ConnectionLost), "transfers treat it as a lost server"
    assert fake.requests == [], "not even the hello (and its pidfd) was sent"
    assert worker.store is not None and not worker._conn.is_connected()
    worker.shutdown()


def test_trusted_server_uids_from_the_argument_or_the_environment(
    fake: FakeServer, buffer: MemfdBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _peercred_as(monkeypatch, 4242)
    monkeypatch.setenv("KVWARDEN_TRUSTED_SERVER_UIDS", "1000, 4242")
    from_env = make_worker(fake, buffer)
    assert from_env.server_uid == 4242
    from_env.shutdown()
    with pytest.raises(UntrustedServer, match=r"trusted_server_uids=\[1000\]"):
        Worker(fake.path, trusted_server_uids=[1000]).status()  # the argument wins
    assert Worker(fake.path, trusted_server_uids=[4242]).status() is not None
    monkeypatch.setenv("KVWARDEN_TRUSTED_SERVER_UIDS", "1000,bob")
    with pytest.raises(ValueError, match="KVWARDEN_TRUSTED_SERVER_UIDS=.*'bob' is not a uid"):
        Worker(fake.path)
    with pytest.raises(ValueError, match="trusted_server_uids must hold"):
        Worker(fake.path, trusted_server_uids=[-1])


def test_own_uid_is_trusted_without_configuration(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWARDEN_TRUSTED_SERVER_UIDS", raising=False)
    calls = _peercred_as(monkeypatch, os.getuid())
    worker = Worker(fake.path)
    assert worker.ping() is False
    assert calls == [socket.AF_UNIX], "checked once, on the connect"
    worker.shutdown()


def _nobody_server(directory: str) -> Tuple[str, int, int]:
    """A forked child that drops to uid 65534 and listens on a socket in ``directory``;
    it accepts two connections and reports, for each, the bytes and fds it received
    (one frame at most). Returns (socket path, child pid, report pipe)."""
    os.chown(directory, NOBODY, NOBODY)
    path = os.path.join(directory, "nobody.sock")
    report_r, report_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions out of here
        code = 1
        try:
            _child(path, report_r, report_w, ready_r, ready_w)
            code = 0
        except BaseException as error:
            os.write(ready_w, f"child failed: {error!r}".encode())
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(ready_w)
    ready = os.read(ready_r, 500)
    os.close(ready_r)
    assert ready == b"r", f"the uid-65534 server did not start: {ready!r}"
    return path, pid, report_r


def _child(path: str, report_r: int, report_w: int, ready_r: int, ready_w: int) -> None:
    """The uid-65534 server: drop root, listen, say ready, then record two connections."""
    os.close(report_r)
    os.close(ready_r)
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(20)
    os.write(ready_w, b"r")
    seen = []
    for _ in range(2):
        conn, _ = listener.accept()
        conn.settimeout(5)
        data, nfds = b"", 0
        try:
            while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                chunk, fds, _, _ = socket.recv_fds(conn, 65536, 16)
                nfds += len(fds)
                for fd in fds:
                    os.close(fd)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        seen.append(f"{len(data)}:{nfds}")
        conn.close()
    os.write(report_w, ",".join(seen).encode())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a server as uid 65534")
def test_a_server_running_as_uid_65534_gets_no_fd_unless_trusted(
    short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No monkeypatching of the check: a process that really runs as uid 65534 listens,
    and SO_PEERCRED reports it. Untrusted, it receives zero bytes (no hello, no pidfd);
    trusted by ``trusted_server_uids``, it receives the hello and its pidfd."""
    monkeypatch.delenv("KVWARDEN_TRUSTED_SERVER_UIDS", raising=False)
    os.chmod(short_tmp, 0o711)  # uid 65534 must reach its directory
    directory = os.path.join(short_tmp, "nobody")
    os.mkdir(directory)
    path, pid, report = _nobody_server(directory)
    try:
        with pytest.raises(UntrustedServer) as caught:
            Worker(path).status()
        assert path in caught.value.message and "uid 65534" in caught.value.message
        trusting = Worker(path, trusted_server_uids=[NOBODY])
        with pytest.raises(ConnectionLost) as lost:
            trusting.status()  # the child reads the hello, then hangs up
        assert not isinstance(lost.value, UntrustedServer)
        assert trusting.server_uid == NOBODY
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        seen = os.read(report, 100).decode().split(",")
        untrusted, trusted = [tuple(int(x) for x in s.split(":")) for s in seen]
        assert untrusted == (0, 0), "the untrusted server received nothing at all"
        expect_fds = 1 if hasattr(os, "pidfd_open") else 0
        assert trusted[0] > 4 and trusted[1] == expect_fds, "the trusted one got the hello"
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(report)


# -- TCP: both sides prove they hold the token; the token never travels ------------

TOKEN = "s3cret-token"


def test_tcp_auth_test_vector() -> None:
    """The vector the Rust side checks too (core/src/protocol/tcp_auth.rs); the fake's
    own HMAC code (not the client's) must agree with it."""
    client_nonce, server_nonce = bytes(range(32)), bytes(range(32, 64))
    key = TcpKey(b"0123456789abcdef-token")
    assert key.key.hex() == "dac3034d75cf72240db32dd12705c5bdf4a812f859694d4177771ba4cc819f0d"
    assert key.id.hex() == "0ab3ce57b13c3c1828e03b38245e6e01"
    server = "37f1bf291e8dee8e7ce01336bf75bc67ba930bc74f8be6eadc6cd5a5de3a8f97"
    client = "10ef67157ba29d8daebb01a3f1bbe027bf6d7baefa701b41528db116a84d5fa0"
    assert key.server_proof(client_nonce, server_nonce).hex() == server
    assert key.client_proof(client_nonce, server_nonce).hex() == client
    assert key.check_server(client_nonce, server_nonce, bytes.fromhex(server))
    assert not key.check_server(client_nonce, server_nonce, bytes.fromhex(client))
    assert not key.check_server(server_nonce, client_nonce, bytes.fromhex(server))
    assert "dac3034d" not in repr(key), "the key is never in a repr"
    fake_key, fake_id = _tcp_key(b"0123456789abcdef-token")
    assert (fake_key, fake_id) == (key.key, key.id)
    assert _tcp_proofs(b"0123456789abcdef-token", client_nonce, server_nonce) == (
        bytes.fromhex(server),
        bytes.fromhex(client),
    )


@pytest.fixture
def tcp_fake(short_tmp: str) -> Iterator[FakeServer]:
    server = FakeServer(os.path.join(short_tmp, "tcp-fake.sock"), tcp_token=TOKEN)
    server.start()
    server.start_tcp()
    yield server
    server.stop()


def _token_file(short_tmp: str, content: str, name: str = "token") -> str:
    path = os.path.join(short_tmp, name)
    with open(path, "w") as f:
        f.write(content)
    return path


def _assert_token_never_sent(fake: FakeServer, token: str = TOKEN) -> None:
    """No recorded request carries the token, in its MessagePack bytes or its repr."""
    assert fake.requests, "the test sent something"
    for record in fake.requests:
        packed = msgpack.packb([record.op, record.args], use_bin_type=True)
        assert token.encode() not in packed, record
        assert token not in repr(record.args), record


def _by_conn(fake: FakeServer) -> Dict[int, List[str]]:
    ops: Dict[int, List[str]] = {}
    for record in fake.requests:
        ops.setdefault(record.conn, []).append(record.op)
    return ops


def test_tcp_authenticates_both_ways_and_the_token_never_travels(
    tcp_fake: FakeServer, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker connects, registers and pings over TCP, reconnects and pings again:
    every connection starts with `auth` (a fresh nonce each) and a `hello` carrying the
    client proof of those nonces, and no request ever carries the token (read from a
    file whose surrounding whitespace is stripped)."""
    monkeypatch.delenv("KVWARDEN_TCP_TOKEN_FILE", raising=False)
    calls = _peercred_as(monkeypatch, 4242)  # would be refused, were it checked
    token = _token_file(short_tmp, f"  {TOKEN}\n\n")
    worker = Worker(tcp_address=f"127.0.0.1:{tcp_fake.tcp_port}", tcp_token_file=token)
    assert worker.register_kv_cache([CudaIpcBuffer(b"h" * 64, 0, 0, 1024)], "m") == "created"
    assert worker.ping() is True
    assert list(_by_conn(tcp_fake).values()) == [
        ["auth", "hello", "attach", "register_kv_cache", "ping"]
    ]
    worker._conn.drop("test: a broken connection")
    assert worker.ping() is True
    assert list(_by_conn(tcp_fake).values())[1] == ["auth", "hello", "attach", "ping"]
    key = TcpKey(TOKEN.encode())
    auths, hellos = tcp_fake.ops("auth"), tcp_fake.ops("hello")
    for auth, hello in zip(auths, hellos):
        assert auth.kind == hello.kind == "tcp" and auth.conn == hello.conn
        [arg] = auth.args
        assert set(arg) == {"id", "nonce"} and arg["id"] == key.id
        assert isinstance(arg["nonce"], bytes) and len(arg["nonce"]) == 32
        assert auth.answer is not None and auth.answer[0]
        server_nonce = auth.answer[1]["nonce"]
        assert hello.args[:2] == [3, worker._conn.client_name]
        assert hello.args[2] == {
            "proof": key.client_proof(arg["nonce"], server_nonce),
            "wait_ms": 30000,
        }
        assert hello.nfds == 0, "no pidfd over TCP"
    assert auths[0].args[0]["nonce"] != auths[1].args[0]["nonce"], "a fresh nonce each time"
    assert hellos[0].args[2]["proof"] != hellos[1].args[2]["proof"]
    _assert_token_never_sent(tcp_fake)
    assert worker.server is not None and worker.server.tenant == "tcp"
    assert worker.server.protocol == 3
    assert calls == [], "no SO_PEERCRED check over TCP"
    assert worker.endpoint == f"tcp:127.0.0.1:{tcp_fake.tcp_port}"
    worker.shutdown()
    _assert_token_never_sent(tcp_fake)


def test_tcp_token_file_from_the_environment(
    tcp_fake: FakeServer, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWARDEN_TCP_TOKEN_FILE", _token_file(short_tmp, TOKEN))
    worker = Worker(tcp_address=("127.0.0.1", tcp_fake.tcp_port))
    assert worker.ping() is False
    assert [r.op for r in tcp_fake.requests] == ["auth", "hello", "attach", "ping"]
    assert sorted(tcp_fake.ops("hello")[0].args[2]) == ["proof", "wait_ms"]
    _assert_token_never_sent(tcp_fake)
    worker.shutdown()


def test_tcp_without_a_token_file_is_forbidden_naming_the_setting(
    tcp_fake: FakeServer, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWARDEN_TCP_TOKEN_FILE", raising=False)
    address = f"127.0.0.1:{tcp_fake.tcp_port}"
    control = Worker(tcp_address=address, tcp_token_file=_token_file(short_tmp, TOKEN))
    assert control.ping() is False, "control: with the token file it connects"
    control.shutdown()
    tcp_fake.requests.clear()
    with pytest.raises(Forbidden, match="tcp_token_file=PATH.*KVWARDEN_TCP_TOKEN_FILE"):
        Worker(tcp_address=address).ping()
    assert [r.op for r in tcp_fake.requests] == ["hello"], "no auth without a token"
    assert tcp_fake.ops("hello")[0].args[2:] == [{"wait_ms": 30000}], "no token, no proof"
    with pytest.raises(ValueError, match="is empty"):
        Worker(tcp_address=address, tcp_token_file=_token_file(short_tmp, " \n"))
    with pytest.raises(ValueError, match="cannot read the TCP token"):
        Worker(tcp_address=address, tcp_token_file=os.path.join(short_tmp, "absent"))


def test_tcp_a_wrong_token_is_refused_at_auth_naming_the_file(
    tcp_fake: FakeServer, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server holds the right token; the worker's file holds another: the server
    knows no token of that key id (`forbidden`), and the error names the file."""
    monkeypatch.delenv("KVWARDEN_TCP_TOKEN_FILE", raising=False)
    address = f"127.0.0.1:{tcp_fake.tcp_port}"
    right = Worker(tcp_address=address, tcp_token_file=_token_file(short_tmp, TOKEN))
    assert right.ping() is False, "control: the right token connects"
    right.shutdown()
    tcp_fake.requests.clear()
    wrong = _token_file(short_tmp, "not-it", name="wrong")
    with pytest.raises(Forbidden) as caught:
        Worker(tcp_address=address, tcp_token_file=wrong).ping()
    message = caught.value.message
    assert f"token read from '{wrong}' (tcp_token_file) is not one the server accepts" in message
    assert "auth refused" in message and "key id" in message
    [auth] = tcp_fake.requests
    assert auth.op == "auth" and _outcome(auth) == "forbidden"
    assert auth.args[0]["id"] == TcpKey(b"not-it").id
    assert b"not-it" not in msgpack.packb(auth.args, use_bin_type=True)
    _assert_token_never_sent(tcp_fake)


@pytest.mark.parametrize("impostor", ["wrong_proof", "another_token"])
def test_tcp_a_server_that_cannot_prove_the_token_gets_nothing_more(
    tcp_fake: FakeServer,
    short_tmp: str,
    monkeypatch: pytest.MonkeyPatch,
    impostor: str,
) -> None:
    """A listener on the port that answers `auth` but cannot prove it holds the token
    (a wrong proof; or a server with another token that answers any key id) is refused
    by the worker: it records `auth` and nothing else, the token least of all, and the
    error names the token file and says the token was not sent."""
    monkeypatch.setenv("KVWARDEN_TCP_TOKEN_FILE", _token_file(short_tmp, TOKEN))
    address = f"127.0.0.1:{tcp_fake.tcp_port}"
    control = Worker(tcp_address=address)
    assert control.ping() is False, "control: the server that holds the token is trusted"
    control.shutdown()
    if impostor == "wrong_proof":
        server = tcp_fake
        server.auth_mode = "wrong_proof"
        server.requests.clear()
    else:
        server = FakeServer(os.path.join(short_tmp, "impostor.sock"), tcp_token="other-token")
        server.auth_mode = "any_id"
        server.start()
        server.start_tcp()
        address = f"127.0.0.1:{server.tcp_port}"
    try:
        worker = Worker(tcp_address=address)
        with pytest.raises(UntrustedServer) as caught:
            worker.ping()
        message = caught.value.message
        assert "could not prove it holds the token" in message
        assert "(KVWARDEN_TCP_TOKEN_FILE)" in message
        assert os.environ["KVWARDEN_TCP_TOKEN_FILE"] in message
        assert "not the kvwarden server configured with that token" in message
        assert "another process may be listening" in message
        assert "token was not sent" in message and f"tcp:{address}" in message
        assert isinstance(caught.value, ConnectionLost) and caught.value.uid == -1
        assert not worker._conn.is_connected(), "the connection was dropped"
        time.sleep(0.2)  # anything sent after `auth` would have arrived by now
        [auth] = server.requests
        assert auth.op == "auth" and auth.answer is not None and auth.answer[0]
        _assert_token_never_sent(server)
        with pytest.raises(UntrustedServer):
            worker.ping()  # each connect is refused the same way
        assert [r.op for r in server.requests] == ["auth", "auth"]
        worker.shutdown()
    finally:
        if server is not tcp_fake:
            server.stop()


def test_tcp_a_malformed_auth_answer_is_a_server_that_did_not_prove(
    tcp_fake: FakeServer, short_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = _token_file(short_tmp, TOKEN)
    address = f"127.0.0.1:{tcp_fake.tcp_port}"
    assert Worker(tcp_address=address, tcp_token_file=token).ping() is False, "control"
    tcp_fake.requests.clear()
    monkeypatch.setattr(tcp_fake, "_auth", lambda serial, kind, args: (True, {"nonce": b"n"}, []))
    with pytest.raises(UntrustedServer, match="could not prove.*`auth` answered"):
        Worker(tcp_address=address, tcp_token_file=token).ping()
    assert [r.op for r in tcp_fake.requests] == ["auth"]


def test_tcp_a_server_without_auth_is_named_older_than_the_client(
    tcp_fake: FakeServer, short_tmp: str
) -> None:
    token = _token_file(short_tmp, TOKEN)
    address = f"127.0.0.1:{tcp_fake.tcp_port}"
    assert Worker(tcp_address=address, tcp_token_file=token).ping() is False, "control"
    tcp_fake.requests.clear()
    tcp_fake.auth_mode = "protocol_2"
    with pytest.raises(UnknownOp, match="older than this client.*upgrade the server"):
        Worker(tcp_address=address, tcp_token_file=token).ping()
    assert [r.op for r in tcp_fake.requests] == ["auth"], "no hello, so no token either"
    _assert_token_never_sent(tcp_fake)


def _raw_call(sock: socket.socket, request_id: int, op: str, args: list) -> list:
    body = msgpack.packb([request_id, op, args], use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = sock.recv(65536)
        assert chunk, "the fake closed the connection"
        data += chunk
    return msgpack.unpackb(data[4:], raw=False)


def test_the_fake_enforces_the_server_side_of_tcp_auth(tcp_fake: FakeServer) -> None:
    """What makes the tests above meaningful: the fake refuses what the real server
    refuses (a hello without `auth`, with a token, with a proof from another
    connection, a second `auth`, any op before the hello)."""
    key = TcpKey(TOKEN.encode())
    address = ("127.0.0.1", tcp_fake.tcp_port)

    def handshake(sock: socket.socket) -> Tuple[bytes, bytes]:
        nonce = bytes(32)
        ok, value = _raw_call(sock, 1, "auth", [{"id": key.id, "nonce": nonce}])[1:]
        assert ok and key.check_server(nonce, value["nonce"], value["proof"])
        return nonce, value["nonce"]

    with socket.create_connection(address) as good:
        client, server = handshake(good)
        proof = key.client_proof(client, server)
        assert _raw_call(good, 2, "auth", [{"id": key.id, "nonce": client}])[1:] == [
            False,
            {"code": "forbidden", "message": "`auth`: this connection made its challenge already"},
        ]
        assert _raw_call(good, 3, "hello", [3, "raw", {"proof": proof}])[1] is True, "control"
        assert _raw_call(good, 4, "ping", [None])[1:] == [True, True]
    with socket.create_connection(address) as replay:
        handshake(replay)
        refused = _raw_call(replay, 2, "hello", [3, "raw", {"proof": proof}])
        assert refused[1] is False and refused[2]["code"] == "forbidden", "a replayed proof"
    with socket.create_connection(address) as token:
        refused = _raw_call(token, 1, "hello", [3, "raw", {"token": TOKEN}])
        assert refused[1] is False and "takes no token" in refused[2]["message"]
        refused = _raw_call(token, 2, "ping", [None])
        assert refused[1] is False and refused[2]["code"] == "forbidden"
    with socket.create_connection(address) as no_auth:
        refused = _raw_call(no_auth, 1, "hello", [3, "raw", {}])
        assert refused[1] is False and refused[2]["code"] == "forbidden"


def test_tcp_refuses_memfd_buffers_and_both_endpoints(
    tcp_fake: FakeServer, short_tmp: str, buffer: MemfdBuffer
) -> None:
    token = _token_file(short_tmp, TOKEN)
    worker = Worker(tcp_address=f"127.0.0.1:{tcp_fake.tcp_port}", tcp_token_file=token)
    with pytest.raises(ValueError, match="cannot travel over TCP"):
        worker.register_kv_cache([buffer], "m")
    worker.register_kv_cache([CudaIpcBuffer(b"h" * 64, 0, 0, 1024)], "m")
    assert tcp_fake.ops("register_kv_cache")[0].args[0] == worker.instance_id
    worker.shutdown()
    with pytest.raises(ValueError, match="not both"):
        Worker(tcp_fake.path, tcp_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        Worker(tcp_address="7070")


# -- hello, the default socket ------------------------------------------------------


def test_hello_says_protocol_3_and_exposes_the_tenant(
    fake: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvwarden"):
        worker = Worker(fake.path)
        worker.status()
    assert fake.ops("hello")[0].args[0] == 3
    assert worker.server is not None and worker.server.protocol == 3
    assert worker.server.tenant == f"uid-{os.getuid()}"
    assert not [r for r in caplog.records if "speaks protocol" in r.getMessage()]
    worker.shutdown()


def test_hello_from_another_protocol_is_logged_at_error(
    fake: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    answer = fake._answer

    def protocol_1(op, args, fds):  # type: ignore[no-untyped-def]
        reply = answer(op, args, fds)
        if op == "hello":
            reply[1]["protocol"] = 1
        return reply

    fake._answer = protocol_1  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="kvwarden"):
        Connection(fake.path, "test").request("status", [], 5.0)
    assert any("speaks protocol 1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("runtime_dir", ["/run/user/1234", None])
def test_default_socket_path(monkeypatch: pytest.MonkeyPatch, runtime_dir: Optional[str]) -> None:
    if runtime_dir is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        assert default_socket_path() == f"/tmp/kvwarden-{os.getuid()}/kvwarden.sock"
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
        assert default_socket_path() == "/run/user/1234/kvwarden.sock"


def _outcome(record) -> Optional[str]:  # type: ignore[no-untyped-def]
    """claimed / proven / an error code / str(value) for other ops."""
    assert record.answer is not None, f"{record} was not answered"
    ok, value = record.answer
    if not ok:
        return value["code"]
    if isinstance(value, dict) and "outcome" in value:
        return value["outcome"]
    return str(value)
