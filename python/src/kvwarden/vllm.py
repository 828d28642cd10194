"""vLLM v1 KV connector backed by kvwarden: ``pip install ./python[vllm]``.

Select it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvwardenConnector",
        "kv_connector_module_path": "kvwarden.vllm", "kv_role": "kv_both"}'

Scheduler side (one per engine): chained prefix keys per full prompt block
(``kvwarden.prefix``), ``lookup`` of a new request's keys, the number of tokens to load
(the last prompt token is always recomputed), and each step's load and save plan in the
connector metadata. Worker side (one per rank): one :class:`kvwarden.Worker`, the
rank's KV tensors registered with the server, the step's blocks moved before
(``start_load_kv``) and after (``wait_for_save``) the forward pass.

Where the bytes go:

- CUDA tensors are registered as CUDA IPC buffers and the server copies each block's
  regions itself (server-driven ``store``/``retrieve``);
- CPU tensors are ordinary allocations the server cannot map, so the worker gathers
  the step's blocks into a memfd staging buffer registered with the server, and the
  server copies each block record between it and L1: one copy per block each way, in
  batched requests (the engine-driven path, ``prepare_*``/``commit_*``, needs two round
  trips per block). CPU records carry a header with a CRC-32: a record that fails it is
  a load error and vLLM recomputes the block.

Transfers are batched (``store_batch``/``retrieve_batch``, at most
:data:`~kvwarden.worker.MAX_BATCH_ITEMS` items a request), in the order of the step's
plan (``KvwardenConnectorMetadata.loads``/``saves``): a save is two batch requests
(every block part but the first, then the first parts, so that a lookup that finds a
block's first part finds a whole block; one request when every block is one part), a
load one (on CPU: per round of staged blocks). Each retrieve item carries its part's
length, and the server fills a part only from a value of exactly that length: a value
stored with another length is a miss, never a partial write.

kvwarden never fails a request: while the server is down, restarting or has reaped
this worker, lookups report no hits and saves are skipped; a load that fails is reported
through ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks (the
connector sets ``kv_load_failure_policy`` to ``"recompute"``). A stalled server costs at
most one request timeout, then nothing is asked of it for a while. See
``docs/vllm.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import prefix
from .buffers import MemfdBuffer
from .kv_tensors import block_dim, block_regions, cuda_ipc_buffer
from .worker import MAX_BATCH_ITEMS, Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger, so that lines show with vLLM's own (its handlers cover "vllm.*").
log = logging.getLogger("vllm.kvwarden")

#: Where one part of a block lives: (registered buffer index, offset, nbytes).
Region = Tuple[int, int, int]

#: ``kv_connector_extra_config`` keys and their defaults.
DEFAULTS: Dict[str, Any] = {
    # The server's Unix socket; None: the server's default (kvwarden.default_socket_path).
    "kvwarden_socket": None,
    # Bound on one request to the server; a stalled server costs at most this per step.
    "kvwarden_request_timeout_seconds": 2.0,
    # After a failed lookup or transfer, this long without asking (no hits, no saves).
    "kvwarden_retry_after_seconds": 5.0,
    # Blocks the CPU staging buffer holds (a step's transfers go in rounds of this many).
    "kvwarden_staging_blocks": 64,
    # The worker's heartbeat (keep 3 × it within the server's reap timeout).
    "kvwarden_heartbeat_interval_seconds": 10.0,
}


@dataclass
class BlockMoves:
    """One request's blocks to move this step: ``keys[i]`` ↔ vLLM block ``block_ids[i]``."""

    req_id: str
    keys: List[bytes]
    block_ids: List[int]


@dataclass
class KvwardenConnectorMetadata(KVConnectorMetadata):
    """A step's plan: what to load before the forward pass, what to save after it."""

    loads: List[BlockMoves] = field(default_factory=list)
    saves: List[BlockMoves] = field(default_factory=list)


@dataclass
class _RequestState:
    """The scheduler's view of one request."""

    keys: List[bytes]
    prompt_tokens: int
    block_ids: List[int] = field(default_factory=list)
    # Tokens vLLM had computed (local prefix cache) when it asked for matches.
    local_computed_tokens: int = 0
    # Blocks to load in the next step: [first, first + count).
    load_first: int = 0
    load_count: int = 0
    # Blocks before this index are stored, loaded or vLLM's own prefix hits.
    saved_blocks: int = 0


class _Backoff:
    """After a failure, nothing is asked of the server for ``retry_after_seconds``."""

    def __init__(self, retry_after_seconds: float) -> None:
        self.retry_after_seconds = retry_after_seconds
        self._until = 0.0

    def open(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self) -> None:
        self._until = time.monotonic() + self.retry_after_seconds


class KvwardenConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a kvwarden server (see the module docs)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(DEFAULTS)
        extra.update(self._kv_transfer_config.kv_connector_extra_config or {})
        self._socket: Optional[str] = extra["kvwarden_socket"]
        self._timeout = float(extra["kvwarden_request_timeout_seconds"])
        self._backoff = _Backoff(float(extra["kvwarden_retry_after_seconds"]))
        self._staging_blocks = int(extra["kvwarden_staging_blocks"])
        self._interval = float(extra["kvwarden_heartbeat_interval_seconds"])
        self._block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        # Shards per block: every tensor-parallel rank of every pipeline stage.
        self._shards = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self._root = prefix.namespace(_namespace_fields(vllm_config, kv_cache_config))
        self._worker: Optional[Worker] = None

        if role == KVConnectorRole.SCHEDULER:
            self._requests: Dict[str, _RequestState] = {}
            #: Counters, for tests and the benchmark.
            self.stats = {"lookups": 0, "lookup_failures": 0, "matched_tokens": 0}
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                # A kvwarden miss must never fail a request: vLLM recomputes instead.
                log.info("kvwarden: kv_load_failure_policy %r set to 'recompute'", policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        else:
            self._rank = _tp_rank()
            self._layers: List[Tuple[str, Any, int]] = []  # (name, tensor, block dim)
            self._route: Optional[_Route] = None
            self._registered = False
            self._load_errors: Set[int] = set()
            #: Counters, for tests and the benchmark.
            self.stats = {
                "blocks_loaded": 0,
                "blocks_saved": 0,
                "load_errors": 0,
                "load_seconds": 0.0,
                "save_seconds": 0.0,
            }

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

    # ================================================================================
    # Scheduler side
    # ================================================================================

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        state = self._requests.get(request.request_id)
        prompt = list(request.prompt_token_ids or [])
        if state is None or state.prompt_tokens != len(prompt):
            state = _RequestState(
                keys=prefix.chain_keys(self._root, prompt, self._block_size),
                prompt_tokens=len(prompt),
            )
            self._requests[request.request_id] = state
        state.local_computed_tokens = num_computed_tokens
        state.load_count = 0
        if not state.keys or not self._backoff.open():
            return 0, False
        worker = self._client()
        self.stats["lookups"] += 1
        hits = len(state.keys)
        for rank in range(self._shards):
            keys = [prefix.rank_key(k, rank) for k in state.keys[:hits]]
            try:
                hits = min(hits, int(worker._request("lookup", [keys])[0]))
            except Exception as error:  # any failure: no hits, and a pause
                log.warning(
                    "kvwarden: lookup failed, reporting no hits for %g s: %s",
                    self._backoff.retry_after_seconds,
                    error,
                )
                self.stats["lookup_failures"] += 1
                self._backoff.failed()
                return 0, False
        matched = prefix.loadable_tokens(hits, self._block_size, len(prompt), num_computed_tokens)
        self.stats["matched_tokens"] += matched
        return matched, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        state.load_first = state.local_computed_tokens // self._block_size
        state.load_count = num_external_tokens // self._block_size

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvwardenConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
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
        """Adds the request's pending load and the blocks this step completes."""
        if state.load_count:
            last = state.load_first + state.load_count
            meta.loads.append(
                BlockMoves(
                    req_id,
                    state.keys[state.load_first : last],
                    state.block_ids[state.load_first : last],
                )
            )
            state.saved_blocks = max(state.saved_blocks, last)
            state.load_count = 0
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

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._requests.pop(request.request_id, None)
        return False, None

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
        self._route = _GpuRoute(self) if first.is_cuda else _CpuRoute(self)
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
        if self._route is None or not self._backoff.open():
            return False
        try:
            self._route.register(self._client())
        except Exception as error:
            log.warning(
                "kvwarden: rank %d could not register its KV cache (%s); no loads or saves, "
                "retrying in %g s",
                self._rank,
                error,
                self._backoff.retry_after_seconds,
            )
            self._backoff.failed()
            return False
        self._registered = True
        return True

    def _usable(self) -> bool:
        return (
            self._ensure_registered()
            and self._backoff.open()
            and self._worker is not None
            and self._worker.is_healthy()
        )

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwardenConnectorMetadata)
        started = time.perf_counter()
        for moves in meta.loads:
            loaded = self._guarded("load", moves, 0)
            self.stats["blocks_loaded"] += loaded
            if loaded < len(moves.block_ids):
                # vLLM recomputes from the first block not loaded.
                failed = moves.block_ids[loaded:]
                self._load_errors.update(failed)
                self.stats["load_errors"] += len(failed)
                log.info(
                    "kvwarden: request %s: %d of %d blocks loaded; vLLM recomputes the rest",
                    moves.req_id,
                    loaded,
                    len(moves.block_ids),
                )
        self.stats["load_seconds"] += time.perf_counter() - started

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # wait_for_save saves every layer after the forward pass

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvwardenConnectorMetadata)
        started = time.perf_counter()
        for moves in meta.saves:
            self.stats["blocks_saved"] += self._guarded("save", moves, 0)
        self.stats["save_seconds"] += time.perf_counter() - started

    def _guarded(self, what: str, moves: BlockMoves, failure: int) -> int:
        """``self._route.load``/``save``; never raises into vLLM: any error (a server
        of another configuration, a bug) counts as nothing moved, and pauses transfers."""
        if not (self._usable() and self._route):
            return failure
        try:
            return getattr(self._route, what)(moves)
        except Exception:
            log.exception(
                "kvwarden: %s of request %s failed; vLLM computes without it for %g s",
                what,
                moves.req_id,
                self._backoff.retry_after_seconds,
            )
            self._backoff.failed()
            return failure
    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


class _Route:
    """How one rank's blocks travel; ``load``/``save`` return how many blocks (from the
    first) went through, and open the connector's backoff on a failure."""

    def __init__(self, connector: KvwardenConnector) -> None:
        self.c = connector

    def register(self, worker: Worker) -> None:
        raise NotImplementedError

    def key(self, key: bytes, part: int) -> bytes:
        return prefix.rank_key(key, self.c._rank, part)

    def failed(self, what: str) -> None:
        # A stalled or dead server would cost a timeout per request and step: pause.
        # (A plain miss, a block evicted since the lookup, pauses too; it is rare.)
        self.c._backoff.failed()
        log.info(
            "kvwarden: %s; no transfers for %g s", what, self.c._backoff.retry_after_seconds
        )

    def save_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Region]]) -> int:
        """Stores block ``i``'s ``parts[i]`` (``(buffer, offset, nbytes)`` each) under
        ``key(keys[i], part)``; how many leading blocks were stored whole. Two batch
        requests (one when every block is one part): every part but the first, then the
        first parts of the blocks stored so far, so that a lookup that finds a block's
        part 0 finds a complete block."""
        rest = [
            (self.key(key, part), *region)
            for key, regions in zip(keys, parts)
            for part, region in enumerate(regions)
            if part > 0
        ]
        stored = self._batches(self.c._worker.store_batch, rest)
        whole, at = 0, 0
        for regions in parts:
            if not all(stored[at : at + len(regions) - 1]):
                break
            at += len(regions) - 1
            whole += 1
        heads = [(self.key(key, 0), *regions[0]) for key, regions in zip(keys, parts[:whole])]
        done = _leading(self._batches(self.c._worker.store_batch, heads))
        if done < len(keys):
            self.failed(f"save of a block stopped after {done} blocks")
        return done

    def load_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Region]]) -> int:
        """Retrieves every part of every block in one batch request; how many leading
        blocks came back whole (a later block may have been written too: vLLM computes
        it again, as it does every block after the first not loaded)."""
        items = [
            (self.key(key, part), buffer, offset, nbytes)
            for key, regions in zip(keys, parts)
            for part, (buffer, offset, nbytes) in enumerate(regions)
        ]
        got = self._batches(self.c._worker.retrieve_batch, items)
        whole, at = 0, 0
        for regions in parts:
            if any(got[at + i] != nbytes for i, (_, _, nbytes) in enumerate(regions)):
                break
            at += len(regions)
            whole += 1
        return whole

    @staticmethod
    def _batches(send: Callable[[List[Any]], List[Any]], items: List[Any]) -> List[Any]:
        """``send`` in batches of at most ``MAX_BATCH_ITEMS``: one request per step
        unless a step moves more parts than a batch holds."""
        out: List[Any] = []
        for first in range(0, len(items), MAX_BATCH_ITEMS):
            out += send(items[first : first + MAX_BATCH_ITEMS])
        return out


class _CpuRoute(_Route):
    """Block records staged in a registered memfd; the server copies them to and from L1."""

    def register(self, worker: Worker) -> None:
        self.layer_bytes = [
            t[(slice(None),) * d + (0,)].numel() * t.element_size() for _, t, d in self.c._layers
        ]
        self.payload_bytes = sum(self.layer_bytes)
        record = prefix.RECORD_HEADER_BYTES + self.payload_bytes
        status = worker.status()
        self.slot_bytes = int(status["l1"]["slot_bytes"])
        self.parts = -(-record // self.slot_bytes)
        self.record_bytes = record
        self.stride = -(-record // 4096) * 4096
        self.rows = max(1, self.c._staging_blocks)
        if getattr(self, "staging", None) is None:  # kept across failed registrations
            self.staging = MemfdBuffer.create(
                self.rows * self.stride, f"kvwarden-vllm-rank{self.c._rank}"
            )
            flat = torch.frombuffer(self.staging.view, dtype=torch.uint8)
            self.table = flat.view(self.rows, self.stride)
        worker.register_kv_cache([self.staging], model_name=_model_name(self.c._vllm_config))

    def _part_spans(self, row: int) -> List[Tuple[int, int]]:
        start = row * self.stride
        return [
            (
                start + p * self.slot_bytes,
                min(self.slot_bytes, self.record_bytes - p * self.slot_bytes),
            )
            for p in range(self.parts)
        ]

    def _parts(self, row: int) -> List[Region]:
        return [(0, offset, nbytes) for offset, nbytes in self._part_spans(row)]

    def save(self, moves: BlockMoves) -> int:
        done = 0
        for first in range(0, len(moves.block_ids), self.rows):
            keys = moves.keys[first : first + self.rows]
            ids = moves.block_ids[first : first + self.rows]
            self._gather(ids)
            for row, key in enumerate(keys):
                record = self.staging.view[
                    row * self.stride : row * self.stride + self.record_bytes
                ]
                payload = record[prefix.RECORD_HEADER_BYTES :]
                record[: prefix.RECORD_HEADER_BYTES] = prefix.pack_header(
                    self.key(key, 0), payload, self.c._layout
                )
                del payload, record
            stored = self.save_parts(keys, [self._parts(row) for row in range(len(keys))])
            done += stored
            if stored < len(keys):
                return done
        return done

    def load(self, moves: BlockMoves) -> int:
        done = 0
        for first in range(0, len(moves.block_ids), self.rows):
            keys = moves.keys[first : first + self.rows]
            ids = moves.block_ids[first : first + self.rows]
            retrieved = self.load_parts(keys, [self._parts(row) for row in range(len(keys))])
            if retrieved < len(keys):
                self.failed(f"block {ids[retrieved]}: not retrieved")
            good = 0
            for row, key in enumerate(keys[:retrieved]):
                start = row * self.stride
                problem = prefix.record_problem(
                    self.staging.view[start : start + self.record_bytes],
                    self.key(key, 0),
                    self.payload_bytes,
                    self.c._layout,
                )
                if problem is not None:
                    log.warning("kvwarden: block %d not loaded: %s", ids[row], problem)
                    break
                good += 1
            if good:
                self._scatter(ids[:good])
            done += good
            if good < len(ids):
                break
        return done

    def _gather(self, ids: List[int]) -> None:
        index = torch.tensor(ids, dtype=torch.long)
        offset = prefix.RECORD_HEADER_BYTES
        for (_, tensor, dim), nbytes in zip(self.c._layers, self.layer_bytes):
            rows = tensor.index_select(dim, index).movedim(dim, 0).reshape(len(ids), -1)
            self.table[: len(ids), offset : offset + nbytes].copy_(rows.view(torch.uint8))
            offset += nbytes

    def _scatter(self, ids: List[int]) -> None:
        index = torch.tensor(ids, dtype=torch.long)
        offset = prefix.RECORD_HEADER_BYTES
        for (_, tensor, dim), nbytes in zip(self.c._layers, self.layer_bytes):
            shape = list(tensor.shape)
            del shape[dim]
            rows = self.table[: len(ids), offset : offset + nbytes].view(tensor.dtype)
            tensor.index_copy_(dim, index, rows.reshape([len(ids)] + shape).movedim(0, dim))
            offset += nbytes


class _GpuRoute(_Route):
    """CUDA tensors registered over IPC; the server copies each block region itself."""

    def register(self, worker: Worker) -> None:
        buffers = []
        by_storage: Dict[int, int] = {}
        self.where: List[Tuple[int, Any, int]] = []  # (buffer index, tensor, dim)
        for _, tensor, dim in self.c._layers:
            base = tensor.untyped_storage().data_ptr()
            if base not in by_storage:
                by_storage[base] = len(buffers)
                buffers.append(cuda_ipc_buffer(tensor))
            self.where.append((by_storage[base], tensor, dim))
        worker.register_kv_cache(buffers, model_name=_model_name(self.c._vllm_config))
        self.buffers = buffers

    def _regions(self, block_id: int) -> List[Tuple[int, int, int]]:
        """(buffer, offset, nbytes) of every region of a block, layer by layer."""
        out = []
        for index, tensor, dim in self.where:
            for offset, nbytes in block_regions(tensor, dim, block_id):
                out.append((index, offset, nbytes))
        return out

    def save(self, moves: BlockMoves) -> int:
        torch.cuda.current_stream().synchronize()  # the forward pass wrote these blocks
        return self.save_parts(moves.keys, [self._regions(block) for block in moves.block_ids])

    def load(self, moves: BlockMoves) -> int:
        done = self.load_parts(moves.keys, [self._regions(block) for block in moves.block_ids])
        if done < len(moves.block_ids):
            self.failed(f"block {moves.block_ids[done]}: not retrieved")
        return done


def _leading(answers: List[Any]) -> int:
    """How many answers, from the first, are true."""
    count = 0
    for answer in answers:
        if not answer:
            break
        count += 1
    return count


def _without(shape: Tuple[int, ...], dim: int) -> Tuple[int, ...]:
    return shape[:dim] + shape[dim + 1 :]


def _model_name(vllm_config: "VllmConfig") -> str:
    return str(vllm_config.model_config.model)


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
