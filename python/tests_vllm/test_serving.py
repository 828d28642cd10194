"""T3: the connector at serving load, on whole generations of the tiny model (CPU):
asynchronous loads that never hold back another request's decode, keys that know the
tenant (``cache_salt``) and the LoRA adapter, a full save queue, and an outage that
costs the engine's log a few lines.

Each engine is its own process (``engine.py``); tokens are compared with a reference
engine without the connector. Nothing here asserts on time: the steps a request decodes
while another's load is held are counted by the scheduler's own state.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, Iterator, List

import pytest
from conftest import RealServer
from engine import Engine
from engine_child import BLOCK_SIZE, MODEL_CONFIG
from test_engine import A, B, tokens, wait_until

#: A request that decodes for a while next to one whose load is held.
LONG = tokens(31, 100)
LONG_TOKENS = 48
#: Overlapped steps the held load waits for before the server is let go.
HELD_STEPS = 8
SETTINGS = {
    "kvwarden_heartbeat_interval_seconds": 10.0,
    "kvwarden_retry_after_seconds": 1.0,
    # Longer than the held load: it must end by the server answering, not a timeout.
    "kvwarden_request_timeout_seconds": 60.0,
}


@pytest.fixture(scope="module")
def baseline(model: str, module_tmp: str) -> Dict[str, List[List[int]]]:
    engine = Engine(model, os.path.join(module_tmp, "baseline.log"))
    try:
        return {
            "A": engine.generate([A])["tokens"],
            "LONG+B": engine.generate([LONG, B], [LONG_TOKENS, 8])["tokens"],
        }
    finally:
        engine.close()


@pytest.fixture(scope="module")
def engine(model: str, module_server: RealServer, module_tmp: str) -> Iterator[Engine]:
    running = Engine(
        model, os.path.join(module_tmp, "engine.log"), module_server.socket_path, **SETTINGS
    )
    try:
        yield running
    finally:
        running.close()


def overlapped(steps: List[dict]) -> int:
    """Steps in which a request ran while another waited for its load."""
    return sum(
        1
        for step in steps
        if step["waiting_for_load"] and set(step["ran"]) - set(step["waiting_for_load"])
    )


def test_row_51_a_held_load_does_not_hold_back_another_requests_decode(
    engine, module_server, baseline
):
    assert engine.generate([B])["blocks_saved"] == 9

    # B's load starts with the server SIGSTOPped; it is SIGCONTed only after LONG has
    # run HELD_STEPS steps while B waited. A load on the forward path would stop the
    # engine's steps instead, until its request timed out: no overlap, a load error.
    held = engine.generate(
        [LONG, B],
        [LONG_TOKENS, 8],
        stall_at_first_load=[module_server.proc.pid, HELD_STEPS],
    )

    assert overlapped(held["steps"]) >= HELD_STEPS
    assert (held["matched_tokens"], held["blocks_loaded"], held["load_errors"]) == (288, 9, 0)
    assert held["tokens"] == baseline["LONG+B"]


def test_row_50_the_same_tokens_under_another_cache_salt_are_not_served_and_the_same_salt_is(
    engine, baseline
):
    first = engine.generate([A], cache_salt="tenant-a")
    other = engine.generate([A], cache_salt="tenant-b")
    again = engine.generate([A], cache_salt="tenant-a")
    unsalted = engine.generate([A])

    assert (first["matched_tokens"], first["blocks_saved"]) == (0, 9)
    assert (other["matched_tokens"], other["blocks_loaded"], other["blocks_saved"]) == (0, 0, 9)
    # The control: the same salt is served its own blocks.
    assert (again["matched_tokens"], again["blocks_loaded"]) == (9 * BLOCK_SIZE, 9)
    assert (unsalted["matched_tokens"], unsalted["blocks_saved"]) == (0, 9)
    for run in (first, other, again, unsalted):
        assert run["tokens"] == baseline["A"]


def kvwarden_lines(log_path: str, since: int) -> List[str]:
    """The engine log's lines about kvwarden, any level, from line ``since`` on."""
    with open(log_path, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()[since:]
    return [line for line in lines if "kvwarden" in line]


def log_lines(log_path: str) -> int:
    with open(log_path, "rb") as f:
        return len(f.read().splitlines())


def test_row_53_a_stopped_server_costs_the_log_one_warning_and_one_when_it_is_back(
    engine, module_server, baseline
):
    module_server.pings_answered_false_expected = "the test restarts the server"
    module_server.stop()
    start = log_lines(engine.log_path)
    down = []
    for _ in range(5):
        time.sleep(1.1)  # past kvwarden_retry_after_seconds: each generate asks again
        down.append(engine.generate([A]))
    # (A client made during the outage says so once; that is no failure line.)
    during = [
        line for line in kvwarden_lines(engine.log_path, start) if "worker created" not in line
    ]

    module_server.start()

    def loaded() -> bool:
        time.sleep(1.1)
        return engine.generate([A])["blocks_saved"] + engine.generate([A])["blocks_loaded"] > 0

    wait_until(loaded, "the connector saves and loads again once the server is back")
    after = kvwarden_lines(engine.log_path, start)

    assert all(run["tokens"] == baseline["A"] and run["matched_tokens"] == 0 for run in down)
    # Five generates, each with a failed lookup and a failed save: one WARNING from the
    # scheduler's client and one from the rank's (one process here; two in a real
    # deployment), and at most the rank's health going; nothing per request or step.
    unreachable = [line for line in during if "is unreachable" in line]
    assert len(unreachable) == 2 and all("WARNING" in line for line in unreachable), during
    assert len(during) <= 3, "\n".join(during)
    # Every outage that began ended, in its own line.
    began = sum("is unreachable" in line for line in after)
    assert sum("answers again after" in line for line in after) == began, "\n".join(after)


@pytest.fixture
def small_queue_engine(model: str, server: RealServer, short_tmp: str) -> Iterator[Engine]:
    running = Engine(
        model,
        os.path.join(short_tmp, "queue.log"),
        server.socket_path,
        kvwarden_save_queue_blocks=4,
        **SETTINGS,
    )
    try:
        yield running
    finally:
        running.close()


def test_row_52_a_full_save_queue_drops_saves_counted_and_never_fails_a_request(
    small_queue_engine, baseline
):
    first = small_queue_engine.generate([A])
    second = small_queue_engine.generate([A])

    # 9 blocks completed in one step, 4 rows in the queue: 4 saved, 5 dropped.
    assert (first["blocks_saved"], first["saves_dropped"]) == (4, 5)
    assert (second["matched_tokens"], second["blocks_loaded"]) == (4 * BLOCK_SIZE, 4)
    assert first["tokens"] == second["tokens"] == baseline["A"]


def write_lora(directory: str, seed: int, base: str) -> str:
    """A random rank-8 LoRA adapter of q_proj and v_proj in PEFT's format."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    rank, hidden = 8, MODEL_CONFIG["hidden_size"]
    head = MODEL_CONFIG["head_dim"]
    outs = {
        "q_proj": MODEL_CONFIG["num_attention_heads"] * head,
        "v_proj": MODEL_CONFIG["num_key_value_heads"] * head,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(MODEL_CONFIG["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(outs),
        "base_model_name_or_path": base,
    }
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return directory


def test_row_50_two_lora_adapters_never_share_blocks(model, server, short_tmp):
    adapters = [
        ["adapter-a", 1, write_lora(os.path.join(short_tmp, "lora-a"), 1, model)],
        ["adapter-b", 2, write_lora(os.path.join(short_tmp, "lora-b"), 2, model)],
    ]
    engine = Engine(
        model, os.path.join(short_tmp, "lora.log"), server.socket_path, lora=True, **SETTINGS
    )
    try:
        first_a = engine.generate([A], lora=adapters[0])
        first_b = engine.generate([A], lora=adapters[1])
        again_a = engine.generate([A], lora=adapters[0])
        again_b = engine.generate([A], lora=adapters[1])
    finally:
        engine.close()

    # What makes the test able to fail: the adapters change the greedy tokens.
    assert first_a["tokens"] != first_b["tokens"]
    assert (first_a["matched_tokens"], first_a["blocks_saved"]) == (0, 9)
    assert (first_b["matched_tokens"], first_b["blocks_saved"]) == (0, 9)  # not a's blocks
    assert (again_a["blocks_loaded"], again_b["blocks_loaded"]) == (9, 9)  # each its own
    assert again_a["tokens"] == first_a["tokens"]
    assert again_b["tokens"] == first_b["tokens"]
