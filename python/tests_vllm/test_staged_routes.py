"""The GPU route's own code (``kvwarden.kv_routes.GpuRoute``: its gather into staging
rows, its headers, its checks on load and its scatter) on CPU tensors of vLLM's
layouts, against a real server: every block comes back byte for byte, one key and one
L1 slot per block when the record fits a slot, and the forward thread never waits for
the GPU (issue 47). Only the device allocation, streams and events differ on a GPU:
here the staging rows are memfds (the server copies them as it copies CUDA IPC
buffers) and the streams record where they are waited for."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator, List, Tuple

import pytest
import torch
from real_server import RealServer, find_binary
from test_kv_tensors import LAYOUTS, NUM_BLOCKS

from kvwarden import Worker, prefix
from kvwarden.kv_routes import BlockMoves, CpuRoute, GpuRoute
from kvwarden.kv_tensors import block_dim
from kvwarden.lanes import Lane
from kvwarden.vllm import _Backoff

FORWARD = "forward"  # the name of the thread that stands in for vLLM's model runner


class Sync:
    """Stands in for a CUDA event: records the thread that waits for it."""

    def __init__(self, waits: List[Tuple[str, str]], which: str) -> None:
        self.waits, self.which = waits, which

    def synchronize(self) -> None:
        self.waits.append((self.which, threading.current_thread().name))


class HostGpuRoute(GpuRoute):
    """GpuRoute with its device parts on the host."""

    def __init__(self, connector: Any) -> None:
        super().__init__(connector)
        self.ordered: List[Tuple[str, str]] = []  # (stream, thread) ordered after forward
        self.waits: List[Tuple[str, str]] = []  # (stream, thread) that waited for it

    # Staging rows in memfds, as the CPU route makes them.
    _buffer = CpuRoute._buffer

    def _on(self, which: str, after_forward: bool = False) -> Any:
        if after_forward:
            self.ordered.append((which, threading.current_thread().name))
        return contextlib.nullcontext()

    def _event(self, which: str) -> Sync:
        return Sync(self.waits, which)


def layers(dtype: torch.dtype) -> List[Tuple[str, torch.Tensor, int]]:
    torch.manual_seed(7)
    out = []
    for make in LAYOUTS:
        tensor = make().to(dtype)
        out.append((make.__name__, tensor, block_dim(tensor, NUM_BLOCKS)))
    return out


@pytest.fixture
def sized_server(short_tmp: str, request: Any) -> Iterator[RealServer]:
    """A server whose ``--slot-bytes`` is the test's parameter."""
    real = RealServer(
        find_binary() or pytest.fail("no kvwarden binary: set KVWARDEN_BIN"),
        os.path.join(short_tmp, "kv.sock"),
        os.path.join(short_tmp, "server.log"),
        reap_timeout_seconds=60.0,
        registration_grace_seconds=120.0,
        slot_bytes=str(request.param),
    )
    real.start()
    try:
        yield real
    finally:
        real.stop()


def route_on(worker: Worker, dtype: torch.dtype, layout: bytes = b"L" * 8) -> HostGpuRoute:
    host = SimpleNamespace(
        _rank=0,
        _layers=layers(dtype),
        _worker=worker,
        _backoff=_Backoff(5.0),
        _staging_blocks=4,  # two halves of 2: a load of 6 goes in 3 rounds
        _save_queue_blocks=8,
        _layout=layout,
        _model_name="staged-route-test",
    )
    route = HostGpuRoute(host)
    route.register(worker)
    return route


def key(name: bytes) -> bytes:
    """A chained key's size (the header holds exactly that)."""
    return name.ljust(prefix.KEY_BYTES, b".")


def save(route: HostGpuRoute, keys: List[bytes], ids: List[int]) -> int:
    """Stages on a thread named like the model runner, saves on a lane."""
    staged: List[Any] = []
    forward = threading.Thread(
        target=lambda: staged.append(route.stage_save(BlockMoves("r", keys, ids))), name=FORWARD
    )
    forward.start()
    forward.join(60)
    job, dropped = staged[0]
    assert job is not None and dropped == 0
    lane, stored = Lane("test-save"), []
    lane.submit(lambda: stored.append(job()))
    lane.stop(60.0)
    return stored[0]


# A block of the eight layouts is 32.5 KiB of float32 (seven of 4 KiB and MLA's 4.5 KiB;
# half that in bfloat16): with its 64-byte header, one record fits one slot of
# 33,280 + 64 bytes.
BLOCK_F32 = 7 * 4096 + 16 * 72 * 4


@pytest.mark.parametrize("sized_server", [BLOCK_F32 + 64], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_comes_back_byte_for_byte_one_key_per_block(
    sized_server: RealServer, dtype: torch.dtype
) -> None:
    src, dst = [0, 2, 3, 5, 6, 8], [1, 4, 7, 9, 0, 3]
    keys = [key(b"block-%d" % block) for block in src]
    with Worker(sized_server.socket_path) as worker:
        route = route_on(worker, dtype)
        assert route.parts == 1, "one key per block: its record fits one slot"
        want = [t.index_select(d, torch.tensor(src)).clone() for _, t, d in route.c._layers]
        before = {n: t.clone() for n, t, _ in route.c._layers}

        assert save(route, keys, src) == len(src)
        for _, t, d in route.c._layers:
            t.index_fill_(d, torch.tensor(dst), 0)
        assert route.load(BlockMoves("r", keys, dst)) == len(dst)

        for (name, t, d), expected in zip(route.c._layers, want):
            assert torch.equal(t.index_select(d, torch.tensor(dst)), expected), name
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
            assert torch.equal(
                t.index_select(d, torch.tensor(untouched)),
                before[name].index_select(d, torch.tensor(untouched)),
            ), f"{name}: a block the load was not given changed"
        # One L1 value per block; at float32 a record fills its slot (G5).
        assert worker.status()["l1"]["slots_used"] == len(src)
        if dtype == torch.float32:
            assert route.l1_use() > 0.99, route.l1_use()

    # The forward thread only ordered the save stream after its own work; the waits ran
    # on the lanes (the save's) and the load's caller.
    assert route.ordered[0] == ("save", FORWARD)
    assert all(thread != FORWARD for _, thread in route.waits), route.waits
    assert ("save", "test-save") in route.waits, route.waits


@pytest.mark.parametrize("sized_server", [BLOCK_F32 + 64], indirect=True)
def test_a_record_of_another_layout_is_refused_on_load(
    sized_server: RealServer, caplog: Any
) -> None:
    keys = [key(b"a"), key(b"b")]
    with Worker(sized_server.socket_path) as worker:
        route = route_on(worker, torch.float32, layout=b"A" * 8)
        assert save(route, keys, [0, 1]) == 2
        # The control: the same layout loads both.
        assert route.load(BlockMoves("r", keys, [2, 3])) == 2
    with Worker(sized_server.socket_path) as worker:
        other = route_on(worker, torch.float32, layout=b"B" * 8)
        with caplog.at_level(logging.WARNING, logger="vllm.kvwarden"):
            assert other.load(BlockMoves("r", keys, [2, 3])) == 0
    assert "block 2 not loaded: stored by a worker with another tensor layout" in caplog.text


@pytest.mark.parametrize("sized_server", [2 << 20], indirect=True)
def test_slots_much_larger_than_a_record_are_named_with_the_slot_size_that_fits(
    sized_server: RealServer, caplog: Any
) -> None:
    with Worker(sized_server.socket_path) as worker:
        with caplog.at_level(logging.WARNING, logger="vllm.kvwarden"):
            route = route_on(worker, torch.float32)
    assert route.l1_use() < 0.05
    assert f"--slot-bytes {route.record_bytes} to fill" in caplog.text, caplog.text


# A process that saves blocks through the route until it is killed: one line per save
# that returned (``saved <n>``: key ``kill-<n>`` holds block ``n % NUM_BLOCKS``).
SAVER = """
import sys, torch
from kvwarden import Worker
from test_staged_routes import NUM_BLOCKS, key, route_on, save
worker = Worker(sys.argv[1])
route = route_on(worker, torch.float32)
print("instance", worker.instance_id, flush=True)
n = 0
while True:
    ids = [(n + i) % NUM_BLOCKS for i in range(4)]
    assert save(route, [key(b"kill-%d" % (n + i)) for i in range(4)], ids) == 4
    for i in range(4):
        print("saved", n + i, flush=True)
    n += 4
"""


@pytest.mark.parametrize("sized_server", [BLOCK_F32 + 64], indirect=True)
def test_a_worker_sigkilled_while_its_route_saves_is_freed_and_every_saved_block_loads_intact(
    sized_server: RealServer,
) -> None:
    """Every layout through the route's own code, killed mid-run: the server frees the
    dead worker's instance on its exit, and another worker loads every block the dead
    one reported saved, byte for byte, into other blocks (nothing torn is served: a
    value is in L1 only once its whole copy is done)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    # This module and real_server.py (python/tests), as conftest.py puts them on the path.
    env["PYTHONPATH"] = os.pathsep.join(
        [here, os.path.join(here, "..", "tests"), env.get("PYTHONPATH", "")]
    )
    child = subprocess.Popen(
        [sys.executable, "-c", SAVER, sized_server.socket_path],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    saved: List[int] = []
    try:
        assert child.stdout is not None
        first = child.stdout.readline().split()
        assert first[:1] == ["instance"], first
        instance = int(first[1])
        while len(saved) < 24:
            line = child.stdout.readline()
            assert line.startswith("saved "), (line, child.poll())
            saved.append(int(line.split()[1]))
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while sized_server.entries(instance) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sized_server.entries(instance) == [], "the dead worker's instance is freed"
    assert sized_server.status()["contexts"]["freed_total"]["process_exited"] == 1

    with Worker(sized_server.socket_path) as worker:
        route = route_on(worker, torch.float32)
        originals = [t.clone() for _, t, _ in route.c._layers]
        for _, t, _ in route.c._layers:
            t.zero_()
        for n in saved:
            into = (n * 7 + 3) % NUM_BLOCKS
            assert route.load(BlockMoves("r", [key(b"kill-%d" % n)], [into])) == 1, n
            for (name, t, d), original in zip(route.c._layers, originals):
                assert torch.equal(
                    t.select(d, into), original.select(d, n % NUM_BLOCKS)
                ), f"{name}: block {n} came back different"
