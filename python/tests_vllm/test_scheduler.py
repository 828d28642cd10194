"""T1: vLLM's real ``Scheduler`` with the kvwarden connector and a real server.

No model runs: the test plays the model runner and the workers' connectors (what
``get_finished`` and ``get_block_ids_with_load_errors`` report), so it sees exactly which
blocks the scheduler asks the workers to load and save, which requests wait for a load
and when vLLM frees blocks whose saves are pending.
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
    KVEventsConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvwarden import prefix
from kvwarden.vllm import BlockMoves, KvwardenConnector, KvwardenConnectorMetadata

NUM_BLOCKS = 100
PROMPT = [(i * 7) % 1000 + 3 for i in range(300)]  # 9 full blocks and 12 tokens


def make_scheduler(
    model_dir: str, socket_path: str, step_tokens: int = 4096, kv_events: bool = False
) -> Scheduler:
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
            **kv_transfer_config(
                socket_path,
                kvwarden_request_timeout_seconds=1.0,
                kvwarden_events_interval_seconds=0.0,
            )
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
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


def first_step(scheduler: Scheduler, tokens: List[int], failed_blocks: int = -1):
    """Adds request r1 and schedules until it computes. A request with hits first waits
    for its asynchronous load (``WAITING_FOR_REMOTE_KVS``, not scheduled); the test then
    reports the load ended (with block ``failed_blocks`` of the load and those after it
    failed, when given). Returns the step that computes, the load (or None), that
    step's metadata and r1's block ids."""
    scheduler.add_request(Request("r1", tokens, SamplingParams(max_tokens=1, temperature=0), None))
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvwardenConnectorMetadata)
    load = None
    if meta.loads:
        (load,) = meta.loads
        assert "r1" not in out.num_scheduled_tokens, "r1 ran before its load ended"
        assert scheduler.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        failed = set(load.block_ids[failed_blocks:]) if failed_blocks >= 0 else set()
        report_transfers(scheduler, out, recving={"r1"}, invalid=failed)
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        assert meta.loads == []
    (new,) = out.scheduled_new_reqs
    return out, load, meta, list(new.block_ids[0])


def report_transfers(scheduler, out, recving=(), sending=(), invalid=(), ran=()) -> None:
    """Plays a step's model runner: ``ran`` each sampled nothing (a step inside a
    prompt), and the workers' connectors reported these transfers ended."""
    runner = ModelRunnerOutput(
        req_ids=list(ran),
        req_id_to_index={r: i for i, r in enumerate(ran)},
        sampled_token_ids=[[] for _ in ran],
        kv_connector_output=KVConnectorOutput(
            finished_recving=set(recving) or None,
            finished_sending=set(sending) or None,
            invalid_block_ids=set(invalid),
        ),
    )
    scheduler.update_from_output(out, runner)


def finish(scheduler: Scheduler, out) -> None:
    """Plays the model runner: one sampled token, which ends the request (max_tokens=1);
    then the workers report its saves done, and vLLM frees its blocks."""
    runner = ModelRunnerOutput(req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[7]])
    scheduler.update_from_output(out, runner)
    assert not scheduler.has_unfinished_requests(), "the request did not complete"
    if "r1" in scheduler.requests:  # held for its saves
        report_transfers(scheduler, scheduler.schedule(), sending={"r1"})
    assert "r1" not in scheduler.requests


def test_stored_blocks_are_matched_and_exactly_their_block_ids_loaded(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    keys, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server)

    out, load, meta, block_ids = first_step(scheduler, PROMPT)

    assert scheduler.connector.stats["matched_tokens"] == 5 * BLOCK_SIZE
    assert out.num_scheduled_tokens["r1"] == len(PROMPT) - 5 * BLOCK_SIZE
    assert load == BlockMoves("r1", keys, block_ids[:5])
    # The blocks this step computes (6..9) are saved; the loaded ones are not again.
    all_keys = prefix.chain_keys(scheduler.connector._root, PROMPT, BLOCK_SIZE)
    assert meta.saves == [BlockMoves("r1", all_keys[5:9], block_ids[5:9])]
    finish(scheduler, out)


def test_nothing_stored_nothing_matched_and_every_full_block_saved(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)

    out, load, meta, block_ids = first_step(scheduler, PROMPT)

    assert out.num_scheduled_tokens["r1"] == len(PROMPT)
    assert load is None
    all_keys = prefix.chain_keys(scheduler.connector._root, PROMPT, BLOCK_SIZE)
    assert meta.saves == [BlockMoves("r1", all_keys, block_ids[:9])]
    finish(scheduler, out)


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    tokens = PROMPT[: 9 * BLOCK_SIZE]
    keys, on_server = server_keys(scheduler, tokens, 9)
    store_blocks(server.socket_path, on_server)

    out, load, meta, block_ids = first_step(scheduler, tokens)

    assert out.num_scheduled_tokens["r1"] == BLOCK_SIZE
    assert load == BlockMoves("r1", keys[:8], block_ids[:8])
    finish(scheduler, out)


def test_a_stored_block_after_a_missing_one_is_not_matched(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    keys, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server[:2] + on_server[3:])  # block 3 missing

    out, load, meta, block_ids = first_step(scheduler, PROMPT)

    assert out.num_scheduled_tokens["r1"] == len(PROMPT) - 2 * BLOCK_SIZE
    assert load == BlockMoves("r1", keys[:2], block_ids[:2])
    finish(scheduler, out)


def test_with_the_server_stopped_nothing_matches_and_the_request_completes(model_dir, server):
    scheduler = make_scheduler(model_dir, server.socket_path)
    _, on_server = server_keys(scheduler, PROMPT, 9)
    store_blocks(server.socket_path, on_server)
    server.stop()

    out, load, meta, _ = first_step(scheduler, PROMPT)

    assert scheduler.connector.stats["matched_tokens"] == 0
    assert out.num_scheduled_tokens["r1"] == len(PROMPT)
    assert load is None
    finish(scheduler, out)


def test_a_stalled_server_costs_one_timeout_then_lookups_pause(model_dir, server):
    import signal

    scheduler = make_scheduler(model_dir, server.socket_path)
    _, on_server = server_keys(scheduler, PROMPT, 9)
    store_blocks(server.socket_path, on_server)
    server.signal(signal.SIGSTOP)
    try:
        out, load, meta, _ = first_step(scheduler, PROMPT)
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

    out, load, meta, block_ids = first_step(scheduler, PROMPT)
    plans = [meta]
    computed = 2 * BLOCK_SIZE + out.num_scheduled_tokens["r1"]
    while computed < len(PROMPT):
        # Plays the model runner for a step that ends inside the prompt: nothing sampled.
        report_transfers(scheduler, out, ran=["r1"])
        out = scheduler.schedule()
        computed += out.num_scheduled_tokens["r1"]
        for blocks in out.scheduled_cached_reqs.new_block_ids:
            if blocks is not None:
                block_ids += blocks[0]
        plans.append(out.kv_connector_metadata)

    assert [len(p.loads) for p in plans] == [0] * len(plans)
    assert load == BlockMoves("r1", keys, block_ids[:2])
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


def decode_step(scheduler: Scheduler, out, running: List[str], **transfers) -> None:
    """Plays a step in which each of ``running`` sampled one token."""
    runner = ModelRunnerOutput(
        req_ids=list(running),
        req_id_to_index={r: i for i, r in enumerate(running)},
        sampled_token_ids=[[5] for _ in running],
        kv_connector_output=KVConnectorOutput(
            finished_recving=set(transfers.get("recving", ())) or None,
            finished_sending=set(transfers.get("sending", ())) or None,
        ),
    )
    scheduler.update_from_output(out, runner)


def test_row_51_a_request_waiting_for_its_load_does_not_hold_back_another_requests_decode(
    model_dir, server
):
    scheduler = make_scheduler(model_dir, server.socket_path)
    _, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server)
    other = [(i * 11) % 1000 + 3 for i in range(40)]  # no stored blocks
    scheduler.add_request(Request("r0", other, SamplingParams(max_tokens=20), None))
    out = scheduler.schedule()
    decode_step(scheduler, out, ["r0"])  # r0's prefill

    scheduler.add_request(Request("r1", PROMPT, SamplingParams(max_tokens=1), None))
    steps = []
    for _ in range(6):  # r1's load has not ended: the workers report nothing for it
        out = scheduler.schedule()
        steps.append(sorted(out.num_scheduled_tokens))
        assert scheduler.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        decode_step(scheduler, out, ["r0"])
    assert steps == [["r0"]] * 6  # r0 decoded in every step r1 waited

    out = scheduler.schedule()
    decode_step(scheduler, out, ["r0"], recving={"r1"})
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["r1"] == len(PROMPT) - 5 * BLOCK_SIZE
    assert out.num_scheduled_tokens["r0"] == 1


def test_a_failed_block_of_a_load_is_recomputed_with_those_after_it_and_saved_again(
    model_dir, server
):
    scheduler = make_scheduler(model_dir, server.socket_path)
    keys, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server)
    all_keys = prefix.chain_keys(scheduler.connector._root, PROMPT, BLOCK_SIZE)

    # The workers report the load ended with its third block (and so those after it)
    # not delivered.
    out, load, meta, block_ids = first_step(scheduler, PROMPT, failed_blocks=2)

    assert load == BlockMoves("r1", keys, block_ids[:5])
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * BLOCK_SIZE
    assert out.num_scheduled_tokens["r1"] == len(PROMPT) - 2 * BLOCK_SIZE
    assert meta.saves == [BlockMoves("r1", all_keys[2:9], block_ids[2:9])]
    finish(scheduler, out)


def test_row_52_a_request_with_saves_keeps_its_blocks_until_the_workers_report_them(
    model_dir, server
):
    scheduler = make_scheduler(model_dir, server.socket_path)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()

    out, load, meta, block_ids = first_step(scheduler, PROMPT)
    assert meta.saves, "the test needs a request with saves"
    runner = ModelRunnerOutput(req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[7]])
    scheduler.update_from_output(out, runner)

    assert not scheduler.has_unfinished_requests()
    assert "r1" in scheduler.requests, "vLLM freed r1 while its saves were pending"
    assert pool.get_num_free_blocks() < free_before
    out = scheduler.schedule()
    report_transfers(scheduler, out)  # a step without the report: still held
    assert "r1" in scheduler.requests
    report_transfers(scheduler, scheduler.schedule(), sending={"r1"})
    assert "r1" not in scheduler.requests
    assert pool.get_num_free_blocks() == free_before

    # The control: a prompt shorter than a block plans no save, so nothing is held.
    scheduler.add_request(Request("r2", PROMPT[:20], SamplingParams(max_tokens=1), None))
    out = scheduler.schedule()
    assert out.kv_connector_metadata.saves == []
    runner = ModelRunnerOutput(req_ids=["r2"], req_id_to_index={"r2": 0}, sampled_token_ids=[[7]])
    scheduler.update_from_output(out, runner)
    assert "r2" not in scheduler.requests
    assert pool.get_num_free_blocks() == free_before


def salted(request_id: str, salt, **kwargs) -> Request:
    params = SamplingParams(max_tokens=1)
    return Request(request_id, PROMPT, params, None, cache_salt=salt, **kwargs)


def matched(scheduler: Scheduler, request: Request) -> int:
    tokens, _ = scheduler.connector.get_num_new_matched_tokens(request, 0)
    return tokens


def test_row_50_the_same_tokens_under_another_cache_salt_get_no_hits_and_the_same_salt_hits(
    model_dir, server
):
    scheduler = make_scheduler(model_dir, server.socket_path)
    connector = scheduler.connector
    _, unsalted = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, unsalted)
    tenant_b = [prefix.rank_key(k, 0) for k in connector._keys(salted("b0", "tenant-b"), PROMPT)]
    store_blocks(server.socket_path, tenant_b[:3])

    # The control: without a salt the blocks stored without one are found.
    assert matched(scheduler, salted("u", None)) == 5 * BLOCK_SIZE
    assert matched(scheduler, salted("b1", "tenant-b")) == 3 * BLOCK_SIZE
    assert matched(scheduler, salted("c1", "tenant-c")) == 0
    # The salt is in the first block's key, so every key of the chain differs.
    assert not set(tenant_b) & set(unsalted)


def test_row_50_keys_follow_vllms_extra_keys_for_lora_adapters_and_images(model_dir, server):
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    scheduler = make_scheduler(model_dir, server.socket_path)
    connector = scheduler.connector
    plain = connector._keys(salted("p", None), PROMPT)

    adapter_a = connector._keys(salted("a", None, lora_request=LoRARequest("a", 1, "/a")), PROMPT)
    adapter_b = connector._keys(salted("b", None, lora_request=LoRARequest("b", 2, "/b")), PROMPT)
    assert len({adapter_a[0], adapter_b[0], plain[0]}) == 3  # every block, from the first

    def image(identifier: str) -> MultiModalFeatureSpec:
        # The same placeholder tokens (PROMPT's) at tokens 100..139: blocks 3 and 4.
        return MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=100, length=40),
        )

    with_a = connector._keys(salted("ia", None, mm_features=[image("img-a")]), PROMPT)
    with_b = connector._keys(salted("ib", None, mm_features=[image("img-b")]), PROMPT)
    assert with_a[:3] == with_b[:3] == plain[:3]  # blocks before the image are shared
    assert all(a != b for a, b in zip(with_a[3:], with_b[3:]))  # from its block on, not

    # On the server: adapter a's stored blocks are found for adapter a only.
    store_blocks(server.socket_path, [prefix.rank_key(k, 0) for k in adapter_a[:4]])
    request_a = salted("a2", None, lora_request=LoRARequest("a", 1, "/a"))
    request_b = salted("b2", None, lora_request=LoRARequest("b", 2, "/b"))
    assert matched(scheduler, request_a) == 4 * BLOCK_SIZE
    assert matched(scheduler, request_b) == 0


def test_the_connectors_counts_reach_vllms_stats_and_prometheus(model_dir, server):
    import prometheus_client

    from kvwarden.vllm_metrics import KvwardenStats

    scheduler = make_scheduler(model_dir, server.socket_path)
    _, on_server = server_keys(scheduler, PROMPT, 5)
    store_blocks(server.socket_path, on_server)
    assert matched(scheduler, salted("s1", None)) == 5 * BLOCK_SIZE

    # What vLLM's scheduler takes after each step (update_from_output).
    stats = scheduler.connector.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["lookups"], stats.data["lookup_hits"]) == (1, 1)
    assert stats.data["matched_tokens"] == 5 * BLOCK_SIZE
    assert scheduler.connector.get_kv_connector_stats() is None  # a new interval: nothing yet
    # Two ranks' intervals summed, as vLLM aggregates them.
    summed = KvwardenConnector.build_kv_connector_stats(dict(stats.data)).aggregate(
        KvwardenStats(data={"blocks_loaded": 5, "matched_tokens": 1})
    )
    reduced = summed.reduce()
    assert (reduced["blocks_loaded"], reduced["matched_tokens"]) == (5, 5 * BLOCK_SIZE + 1)

    registry = prometheus_client.CollectorRegistry()

    def in_registry(kind):
        def init(self, *args, **kwargs):
            kind.__init__(self, *args, registry=registry, **kwargs)

        return type(kind.__name__, (kind,), {"__init__": init})

    prom = KvwardenConnector.build_prom_metrics(
        scheduler.vllm_config if hasattr(scheduler, "vllm_config") else None,
        {
            prometheus_client.Gauge: in_registry(prometheus_client.Gauge),
            prometheus_client.Counter: in_registry(prometheus_client.Counter),
            prometheus_client.Histogram: in_registry(prometheus_client.Histogram),
        },
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(summed.data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvwarden_blocks_loaded_total", labels) == 5
    assert registry.get_sample_value("vllm:kvwarden_lookups_total", labels) == 1
    assert registry.get_sample_value("vllm:kvwarden_saves_dropped_total", labels) == 0


def hashed_request(request_id: str, tokens: List[int], **kwargs) -> Request:
    """A request with vLLM's block hashes, as the engine makes it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=1, temperature=0),
        None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn),
        **kwargs,
    )


def test_blocks_kvwarden_holds_are_announced_in_vllms_kv_events_and_withdrawn_on_restart(
    model_dir, server
):
    """Issue 42: the scheduler's KV events carry the blocks every rank of this engine
    holds in kvwarden (vLLM's hash, parent and tokens), and a server restart withdraws
    them. Control: with KV events off nothing is announced."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    off = make_scheduler(model_dir, server.socket_path)
    assert off.connector.take_events() == [], "KV events off: nothing announced"

    scheduler = make_scheduler(model_dir, server.socket_path, kv_events=True)
    keys, rank0 = server_keys(scheduler, PROMPT, 4)
    store_blocks(server.socket_path, rank0)
    request = hashed_request("r1", PROMPT)
    scheduler.add_request(request)
    scheduler.schedule()  # the lookup: the connector learns the prompt's blocks
    events = scheduler.connector.take_events()
    assert all(isinstance(e, BlockStored) for e in events), events
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # As vLLM announces its own blocks (ints by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    assert [e.block_hashes[0] for e in events] == hashes, "the 4 blocks held, in order"
    assert events[0].parent_block_hash is None
    assert [e.parent_block_hash for e in events[1:]] == hashes[:3]
    assert events[1].token_ids == PROMPT[BLOCK_SIZE : 2 * BLOCK_SIZE]
    assert {(e.medium, e.ownership, e.block_size) for e in events} == {
        ("CPU", "kvwarden", BLOCK_SIZE)
    }
    # Extra keys in the shape vLLM publishes its own (none in this prompt).
    assert all(e.extra_keys == [None] for e in events), events[0].extra_keys
    assert scheduler.connector.take_events() == [], "told once"

    # The server restarts: unreachable for a moment, so every announced block is
    # withdrawn (the new server holds nothing of them either).
    server.restart()
    withdrawn = scheduler.connector.take_events()
    assert all(isinstance(e, BlockRemoved) for e in withdrawn), withdrawn
    assert sorted(e.block_hashes[0] for e in withdrawn) == sorted(hashes)
    assert scheduler.connector._announcer.announced() == 0


def test_an_adapters_blocks_are_announced_with_its_name_as_vllm_announces_them(model_dir, server):
    """Issue 42: a LoRA adapter's blocks held in kvwarden are announced with the
    adapter's name and id and its extra keys, as vLLM announces its own; another
    adapter's request for the same tokens announces nothing of them (control: its keys
    are other keys, none held)."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    scheduler = make_scheduler(model_dir, server.socket_path, kv_events=True)
    connector = scheduler.connector

    def adapter_request(request_id: str, name: str, adapter_id: int) -> Request:
        lora = LoRARequest(name, adapter_id, f"/{name}")
        return hashed_request(request_id, PROMPT, lora_request=lora)

    request_b = adapter_request("b", "b", 2)
    matched(scheduler, request_b)  # adapter b's keys: none stored
    assert connector.take_events() == [], "nothing of adapter b is held"
    keys_a = connector._keys(adapter_request("a0", "a", 1), PROMPT)
    store_blocks(server.socket_path, [prefix.rank_key(k, 0) for k in keys_a[:3]])
    request_a = adapter_request("a1", "a", 1)
    assert matched(scheduler, request_a) == 3 * BLOCK_SIZE
    events = connector.take_events()
    # vLLM's hashes of the adapter's blocks (the adapter in each), not the base model's.
    hashes = [maybe_convert_block_hash(h) for h in request_a.block_hashes[:3]]
    assert [e.block_hashes[0] for e in events] == hashes
    plain = hashed_request("p", PROMPT)
    assert not set(hashes) & {maybe_convert_block_hash(h) for h in plain.block_hashes}
    assert {(e.lora_name, e.lora_id) for e in events} == {("a", 1)}
    assert all(e.extra_keys == [("a",)] for e in events), events[0].extra_keys


def test_a_lookup_that_finds_the_server_gone_has_every_block_withdrawn_at_the_next_step(
    model_dir, server
):
    """Issue 42 (failure mode 74): in a step, vLLM asks for lookups before it takes the
    connector's events. When a lookup is the first request to find the server gone,
    the events read is skipped for the pause that follows, and the blocks are withdrawn
    all the same (lookups report no hits: nothing is loadable). Control: while the
    server answers, a new request's lookup withdraws nothing."""
    from vllm.distributed.kv_events import BlockRemoved

    scheduler = make_scheduler(model_dir, server.socket_path, kv_events=True)
    _, rank0 = server_keys(scheduler, PROMPT, 4)
    store_blocks(server.socket_path, rank0)
    scheduler.add_request(hashed_request("r1", PROMPT))
    scheduler.schedule()
    assert len(scheduler.connector.take_events()) == 4, "the 4 blocks held are announced"
    scheduler.add_request(hashed_request("r2", PROMPT[:-1] + [PROMPT[-1] + 1]))
    scheduler.schedule()
    assert scheduler.connector.take_events() == [], "the server answers: nothing withdrawn"

    server.stop()
    scheduler.add_request(hashed_request("r3", PROMPT[:-1] + [PROMPT[-1] + 2]))
    scheduler.schedule()  # the lookup finds the server gone first
    assert scheduler.connector.stats["lookup_failures"] == 1, "the lookup failed first"
    withdrawn = scheduler.connector.take_events()
    assert len(withdrawn) == 4 and all(isinstance(e, BlockRemoved) for e in withdrawn), withdrawn
    assert scheduler.connector._announcer.announced() == 0


def test_a_block_one_engine_described_is_announced_by_another_that_never_saw_it(model_dir, server):
    """Issue 42: engine A's scheduler saw the request and describes the blocks it
    announces; engine B's never did, and announces the same blocks, with the same
    hashes, parents and tokens, from those descriptions. Control: before A described
    them, B announced nothing."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    a = make_scheduler(model_dir, server.socket_path, kv_events=True)
    b = make_scheduler(model_dir, server.socket_path, kv_events=True)
    _, rank0 = server_keys(a, PROMPT, 4)
    store_blocks(server.socket_path, rank0)
    assert b.connector.take_events() == [], "B knows nothing of these blocks yet"
    request = hashed_request("r1", PROMPT)
    a.add_request(request)
    a.schedule()
    from_a = a.connector.take_events()
    assert len(from_a) == 4
    from_b = b.connector.take_events()
    hashes = {maybe_convert_block_hash(h) for h in request.block_hashes[:4]}

    def blocks(events):
        return {e.block_hashes[0]: (e.parent_block_hash, e.token_ids) for e in events}

    assert set(blocks(from_b)) == hashes, "B announces A's blocks (in the server's order)"
    assert blocks(from_b) == blocks(from_a), "with the same parents and tokens"
