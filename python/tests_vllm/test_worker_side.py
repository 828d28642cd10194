"""The worker side's bookkeeping against vLLM's contract, with vLLM's real config and
metadata but a stand-in route (no model, no server): a finished request is reported
``finished_sending`` only once its saves ended, and then once; a load's undelivered
blocks are reported in the same pass as the load; a preempted request's GPU saves are
waited for before vLLM may reuse its blocks (rows 51 and 52)."""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Tuple

import pytest
from test_scheduler import make_scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvwarden.vllm import BlockMoves, KvwardenConnector, KvwardenConnectorMetadata


class StandInRoute:
    """Saves wait for ``gate``; loads deliver ``deliver`` leading blocks."""

    def __init__(self, saves_read_blocks: bool, deliver: int = 0) -> None:
        self.saves_read_blocks = saves_read_blocks
        self.gate = threading.Event()
        self.deliver = deliver
        self.order: List[str] = []

    def block_bytes(self) -> int:
        return 1024

    def stage_save(self, moves: BlockMoves) -> Tuple[Optional[Callable[[], int]], int]:
        def save() -> int:
            self.gate.wait(60)
            self.order.append(f"saved {moves.req_id}")
            return len(moves.block_ids)

        return save, 0

    def load(self, moves: BlockMoves) -> int:
        return min(self.deliver, len(moves.block_ids))


@pytest.fixture
def rank(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    connector = KvwardenConnector(
        scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config
    )
    connector._registered = True  # the stand-in route needs no server
    connector._client()
    yield connector
    connector._route.gate.set()
    connector.shutdown()


def step(connector: KvwardenConnector, meta: KvwardenConnectorMetadata) -> None:
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.clear_connector_metadata()


def lanes_idle(connector: KvwardenConnector) -> None:
    assert connector.wait_for_lanes(60.0)


def test_row_52_a_finished_request_is_reported_once_its_saves_ended_and_only_once(rank):
    rank._route = StandInRoute(saves_read_blocks=False)
    step(rank, KvwardenConnectorMetadata(saves=[BlockMoves("r1", [b"k"] * 3, [1, 2, 3])]))

    # r1 finished while its save waits; r2 (no save planned) is not the workers' to report.
    assert rank.get_finished({"r1", "r2"}) == (None, None)
    assert rank.get_finished(set()) == (None, None)
    rank._route.gate.set()
    lanes_idle(rank)
    assert rank.get_finished(set()) == ({"r1"}, None)
    assert rank.get_finished(set()) == (None, None)  # once
    assert rank.stats["blocks_saved"] == 3


def test_row_51_a_loads_undelivered_blocks_are_reported_in_the_pass_that_reports_it(rank):
    rank._route = StandInRoute(saves_read_blocks=False, deliver=2)
    load = BlockMoves("r1", [b"k"] * 5, [10, 11, 12, 13, 14])
    step(rank, KvwardenConnectorMetadata(loads=[load]))
    lanes_idle(rank)

    sending, recving = rank.get_finished(set())
    assert (sending, recving) == (None, {"r1"})
    assert rank.get_block_ids_with_load_errors() == {12, 13, 14}
    assert rank.get_block_ids_with_load_errors() == set()
    assert (rank.stats["blocks_loaded"], rank.stats["load_errors"]) == (2, 3)


def waiting_on(condition: threading.Condition) -> bool:
    return bool(condition._waiters)  # a thread is blocked in wait(): deterministic order


def test_row_52_a_preempted_requests_gpu_saves_end_before_its_blocks_may_be_reused(rank):
    route = rank._route = StandInRoute(saves_read_blocks=True)
    step(rank, KvwardenConnectorMetadata(saves=[BlockMoves("r1", [b"k"] * 2, [1, 2])]))
    step(rank, KvwardenConnectorMetadata(saves=[BlockMoves("r2", [b"k"], [3])]))

    # The control: preempting a request without a pending save returns at once, even
    # though other saves (r1's, r2's) are still waiting.
    rank.handle_preemptions(KvwardenConnectorMetadata(preempted=["r9"]))

    done = threading.Event()

    def preempt() -> None:
        rank.handle_preemptions(KvwardenConnectorMetadata(preempted=["r1"]))
        route.order.append("handled")
        done.set()

    thread = threading.Thread(target=preempt)
    thread.start()
    deadline = time.monotonic() + 60
    while not waiting_on(rank._saves_ended):
        assert time.monotonic() < deadline, "handle_preemptions never waited"
        time.sleep(0.01)
    assert not done.is_set()
    route.order.append("released")
    route.gate.set()
    thread.join(60)
    order = route.order
    assert order[0] == "released"
    assert order.index("saved r1") < order.index("handled")  # (r2's save may come anywhere)


def test_cpu_saves_read_their_own_copy_so_a_preemption_does_not_wait(rank):
    rank._route = StandInRoute(saves_read_blocks=False)
    step(rank, KvwardenConnectorMetadata(saves=[BlockMoves("r1", [b"k"], [1])]))
    rank.handle_preemptions(KvwardenConnectorMetadata(preempted=["r1"]))  # returns
    assert rank._route.order == []  # the save still waits: nothing was waited for
