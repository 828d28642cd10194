"""T2: whole generations on vLLM (CPU, a tiny random model) with the kvwarden connector.

Each engine is its own process (``engine.py``); tokens are compared with a reference
engine that runs the same prompts, grouped the same way, without the connector.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, Iterator, List

import pytest
from conftest import RealServer
from engine import Engine
from engine_child import BLOCK_SIZE

from kvwarden import Worker, prefix


def tokens(seed: int, n: int) -> List[int]:
    return [(i * seed + seed) % 1000 + 3 for i in range(n)]


A = tokens(7, 300)  # 9 full blocks and 12 tokens: 9 × 32 = 288 tokens loadable
A_CHANGED = [A[0] + 1] + A[1:]
B = tokens(13, 300)
D = tokens(17, 300)
E = tokens(19, 200)
F = tokens(23, 150)
G = tokens(29, 300)
GROUPS = {"A": [A], "A_CHANGED": [A_CHANGED], "B": [B], "D": [D], "DEF": [D, E, F], "G": [G]}
DEF_MAX_TOKENS = 16
#: The connector's settings in these tests: quick heartbeat and backoff, so that a
#: restarted server is noticed within seconds.
FAST = {
    "kvwarden_heartbeat_interval_seconds": 1.0,
    "kvwarden_retry_after_seconds": 1.0,
    "kvwarden_request_timeout_seconds": 2.0,
}


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def baseline(model: str, module_tmp: str) -> Dict[str, List[List[int]]]:
    """The greedy tokens of every prompt group, from an engine without the connector."""
    engine = Engine(model, os.path.join(module_tmp, "baseline.log"))
    try:
        return {
            name: engine.generate(group, DEF_MAX_TOKENS if name == "DEF" else 8)["tokens"]
            for name, group in GROUPS.items()
        }
    finally:
        engine.close()


@pytest.fixture(scope="module")
def engine(model: str, module_server: RealServer, module_tmp: str) -> Iterator[Engine]:
    running = Engine(
        model, os.path.join(module_tmp, "engine.log"), module_server.socket_path, **FAST
    )
    try:
        yield running
    finally:
        running.close()


def server_key(engine: Engine, prompt: List[int], block: int) -> bytes:
    keys = prefix.chain_keys(bytes.fromhex(engine.ready["root"]), prompt, BLOCK_SIZE)
    return prefix.rank_key(keys[block], 0)


def corrupt(socket_path: str, key: bytes) -> None:
    """Flips one payload byte of the record L1 holds under ``key``, through an
    engine-driven mapping of the pool (which can write every slot)."""
    with Worker(socket_path) as worker:
        worker.register_engine_driven("test-corruptor")
        slot = worker.prepare_retrieve(key)
        assert slot is not None, "the block to corrupt is not stored"
        offset = prefix.RECORD_HEADER_BYTES + 100
        slot.view[offset] = slot.view[offset] ^ 0xFF
        slot.view.release()
        assert worker.commit_retrieve(key)


def test_the_tiny_model_depends_on_the_first_block(baseline):
    # What makes the token comparisons below able to fail: a wrong early block (here,
    # one changed prompt token) changes the greedy tokens.
    assert baseline["A"] != baseline["A_CHANGED"]
    assert len(set(baseline["A"][0])) > 2, "degenerate output: the comparisons would prove little"


def test_a_second_run_loads_the_stored_blocks_and_gives_the_same_tokens(engine, baseline):
    first = engine.generate([A])
    second = engine.generate([A])

    assert (first["matched_tokens"], first["blocks_loaded"], first["blocks_saved"]) == (0, 0, 9)
    assert (second["matched_tokens"], second["blocks_loaded"]) == (9 * BLOCK_SIZE, 9)
    assert (second["load_errors"], second["blocks_saved"]) == (0, 0)
    assert first["tokens"] == baseline["A"]
    assert second["tokens"] == baseline["A"]


def test_a_corrupted_stored_block_is_recomputed_with_those_after_it(
    engine, module_server, baseline
):
    engine.generate([B])
    corrupt(module_server.socket_path, server_key(engine, B, 4))

    again = engine.generate([B])

    assert again["matched_tokens"] == 9 * BLOCK_SIZE  # the lookup cannot tell
    assert (again["blocks_loaded"], again["load_errors"]) == (4, 5)
    assert again["tokens"] == baseline["B"]


def test_server_killed_mid_run_every_request_completes_then_the_worker_recovers(
    engine, module_server, baseline
):
    engine.generate([D])
    module_server.pings_answered_false_expected = "the test restarts the server"

    # The server dies as the step that loads D's blocks starts.
    killed = engine.generate([D, E, F], DEF_MAX_TOKENS, kill_at_first_load=module_server.proc.pid)

    assert killed["matched_tokens"] == 9 * BLOCK_SIZE  # looked up before the kill
    assert (killed["blocks_loaded"], killed["load_errors"]) == (0, 9)
    assert killed["tokens"] == baseline["DEF"]

    down = engine.generate([D])
    assert (down["matched_tokens"], down["blocks_loaded"]) == (0, 0)
    assert down["tokens"] == baseline["D"]

    module_server.stop()
    module_server.start()  # a new server: empty L1, the worker's instance unknown
    runs = []

    def g_loaded() -> bool:
        runs.append(engine.generate([G]))
        return runs[-1]["blocks_loaded"] == 9

    wait_until(g_loaded, "a prompt stored after the restart is loaded again")
    assert all(run["tokens"] == baseline["G"] for run in runs)
    assert len(module_server.entries(engine.ready["instance_id"])) == 1


def test_a_sigkilled_engine_is_freed_by_process_exit_and_the_next_start_registers_cleanly(
    model, server, baseline, short_tmp
):
    first = Engine(model, os.path.join(short_tmp, "first.log"), server.socket_path, **FAST)
    try:
        assert first.generate([A])["blocks_saved"] == 9
        instance = first.ready["instance_id"]
        assert len(server.entries(instance)) == 1
        freed = server.status()["contexts"]["freed_total"]
        first.kill()
    finally:
        first.close()

    wait_until(lambda: not server.entries(instance), "the killed engine's instance is freed")
    after = server.status()["contexts"]["freed_total"]
    assert after["process_exited"] == freed["process_exited"] + 1
    assert after["reaped"] == freed["reaped"]

    second = Engine(model, os.path.join(short_tmp, "second.log"), server.socket_path, **FAST)
    try:
        result = second.generate([A])
        entries = server.entries(second.ready["instance_id"])
    finally:
        second.close()
    assert result["blocks_loaded"] == 9  # stored by the killed engine: L1 keeps them
    assert result["tokens"] == baseline["A"]
    assert [e["module"] for e in entries] == ["server_driven"]
    assert server.status()["contexts"]["freed_total"]["process_exited"] == after["process_exited"]
