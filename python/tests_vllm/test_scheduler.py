"""T1: vLLM's real ``Scheduler`` with the kvwarden connector and a real server.

No model runs: the test plays the model runner, so it sees exactly which blocks the
scheduler asks the workers to load and save.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from conftest import store_blocks
from engine_child import BLOCK_SIZE, MODEL_CONFIG, kv_transfer_config
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvwarden import prefix
from kvwarden.vllm import BlockMoves, KvwardenConnector, KvwardenConnectorMetadata

NUM_BLOCKS = 100
PROMPT = [(i * 7) % 1000 + 3 for i in range(300)]  # 9 full blocks and 12 tokens


def make_scheduler(model_dir: str, socket_path: str, step_tokens: int = 4096) -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=4096,
            enforce_eager=True,
            seed=0,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=step_tokens,
            max_model_len=4096,
            is_encoder_decoder=False,
            enable_chunked_prefill=step_tokens < 4096,
        ),
        load_config=LoadConfig(load_format="dummy"),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            **kv_transfer_config(socket_path, kvwarden_request_timeout_seconds=1.0)
        ),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    heads = MODEL_CONFIG["num_key_value_heads"]
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=MODEL_CONFIG["head_dim"],
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL_CONFIG["num_hidden_layers"])]
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    assert isinstance(scheduler.connector, KvwardenConnector)
    return scheduler


def server_keys(
    scheduler: Scheduler, tokens: List[int], blocks: int
) -> Tuple[List[bytes], List[bytes]]:
    """The chain keys of the first ``blocks`` blocks, and their rank-0 server keys."""
    keys = prefix.chain_keys(scheduler.connector._root, tokens, BLOCK_SIZE)[:blocks]
    return keys, [prefix.rank_key(k, 0) for k in keys]


def first_step(scheduler: Scheduler, tokens: List[int]):
    scheduler.add_request(Request("r1", tokens, SamplingParams(max_tokens=1, temperature=0), None))
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvwardenConnectorMetadata)
    (new,) = out.scheduled_new_reqs
    return out, meta, list(new.block_ids[0])


def finish(scheduler: Scheduler, out) -> None:
    """Plays the model runner: one sampled token, which ends the request (max_tokens=1)."""
    runner = ModelRunnerOutput(req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[7]])
    scheduler.update_from_output(out, runner)
    assert not scheduler.has_unfinished_requests(), "the request did not complete"


def test_stored_blocks_are_matched_and_exactly_their_block_ids_loaded(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    keys, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server)

    out, meta, block_ids = first_step(scheduler, PROMPT)

    assert scheduler.connector.stats["matched_tokens"] == 5 * BLOCK_SIZE
    assert out.num_scheduled_tokens["r1"] == len(PROMPT) - 5 * BLOCK_SIZE
    assert meta.loads == [BlockMoves("r1", keys, block_ids[:5])]
    # The blocks this step computes (6..9) are saved; the loaded ones are not again.
    all_keys = prefix.chain_keys(scheduler.connector._root, PROMPT, BLOCK_SIZE)
    assert meta.saves == [BlockMoves("r1", all_keys[5:9], block_ids[5:9])]
    finish(scheduler, out)


def test_nothing_stored_nothing_matched_and_every_full_block_saved(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)

    out, meta, block_ids = first_step(scheduler, PROMPT)

    assert out.num_scheduled_tokens["r1"] == len(PROMPT)
    assert meta.loads == []
    all_keys = prefix.chain_keys(scheduler.connector._root, PROMPT, BLOCK_SIZE)
    assert meta.saves == [BlockMoves("r1", all_keys, block_ids[:9])]
    finish(scheduler, out)


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    tokens = PROMPT[: 9 * BLOCK_SIZE]
    keys, on_server = server_keys(scheduler, tokens, 9)
    store_blocks(server.socket_path, on_server)

    out, meta, block_ids = first_step(scheduler, tokens)

    assert out.num_scheduled_tokens["r1"] == BLOCK_SIZE
    assert meta.loads == [BlockMoves("r1", keys[:8], block_ids[:8])]
    finish(scheduler, out)


def test_a_stored_block_after_a_missing_one_is_not_matched(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    keys, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server[:2] + on_server[3:])  # block 3 missing

    out, meta, block_ids = first_step(scheduler, PROMPT)

    assert out.num_scheduled_tokens["r1"] == len(PROMPT) - 2 * BLOCK_SIZE
    assert meta.loads == [BlockMoves("r1", keys[:2], block_ids[:2])]
    finish(scheduler, out)


def test_with_the_server_stopped_nothing_matches_and_the_request_completes(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    _, on_server = server_keys(scheduler, PROMPT, 9)
    store_blocks(server.socket_path, on_server)
    server.stop()

    out, meta, _ = first_step(scheduler, PROMPT)

    assert scheduler.connector.stats["matched_tokens"] == 0
    assert out.num_scheduled_tokens["r1"] == len(PROMPT)
    assert meta.loads == []
    finish(scheduler, out)


def test_a_stalled_server_costs_one_timeout_then_lookups_pause(model_dir, server):
    import signal

    scheduler = make_scheduler(model_dir, server.socket_path)
    _, on_server = server_keys(scheduler, PROMPT, 9)
    store_blocks(server.socket_path, on_server)
    server.signal(signal.SIGSTOP)
    try:
        out, meta, _ = first_step(scheduler, PROMPT)
        finish(scheduler, out)
        scheduler.add_request(Request("r2", PROMPT, SamplingParams(max_tokens=1), None))
        second = scheduler.schedule()
    finally:
        server.signal(signal.SIGCONT)

    # One lookup timed out; the second request did not ask (the backoff is open).
    assert scheduler.connector.stats["lookups"] == 1
    assert scheduler.connector.stats["lookup_failures"] == 1
    assert out.num_scheduled_tokens["r1"] == len(PROMPT)
    assert second.num_scheduled_tokens["r2"] == len(PROMPT)


def test_a_chunked_prefill_saves_each_block_once_in_the_step_that_completes_it(model_dir, server):
    # 100 tokens a step: the 300-token prompt takes 3 steps, after 2 loaded blocks.
    scheduler = make_scheduler(model_dir, server.socket_path, step_tokens=100)
    keys, on_server = server_keys(scheduler, PROMPT, 2)
    store_blocks(server.socket_path, on_server)
    all_keys = prefix.chain_keys(scheduler.connector._root, PROMPT, BLOCK_SIZE)

    out, meta, block_ids = first_step(scheduler, PROMPT)
    plans = [meta]
    computed = 2 * BLOCK_SIZE + out.num_scheduled_tokens["r1"]
    while computed < len(PROMPT):
        # Plays the model runner for a step that ends inside the prompt: nothing sampled.
        runner = ModelRunnerOutput(
            req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[]]
        )
        scheduler.update_from_output(out, runner)
        out = scheduler.schedule()
        computed += out.num_scheduled_tokens["r1"]
        for blocks in out.scheduled_cached_reqs.new_block_ids:
            if blocks is not None:
                block_ids += blocks[0]
        plans.append(out.kv_connector_metadata)

    assert [len(p.loads) for p in plans] == [1] + [0] * (len(plans) - 1)
    assert plans[0].loads == [BlockMoves("r1", keys, block_ids[:2])]
    saved = [
        (key, block)
        for plan in plans
        for moves in plan.saves
        for key, block in zip(moves.keys, moves.block_ids)
    ]
    assert saved == list(zip(all_keys[2:9], block_ids[2:9]))  # each block once, in order
    assert len(plans) == 3
    assert [len(p.saves[0].keys) if p.saves else 0 for p in plans] == [3, 3, 1]
    finish(scheduler, out)
