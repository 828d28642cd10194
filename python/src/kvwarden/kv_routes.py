"""How one rank's KV blocks travel between an engine's tensors and a kvwarden server.

Engine-neutral apart from torch: the vLLM connector (``kvwarden.vllm``) drives these
routes from its lanes, and ``python/scripts/gpu_kv_check.py`` drives the same GPU route
on a GPU host without vLLM. A route's host (the connector, or a stand-in) provides:
``_rank``, ``_layers`` (``(name, tensor, block dim)`` per KV tensor), ``_worker`` (a
registered :class:`~kvwarden.Worker`), ``_backoff`` (``failed()``,
``retry_after_seconds``), ``_staging_blocks``, ``_save_queue_blocks``, ``_layout`` (the
tensor layout digest) and ``_model_name``.

- :class:`GpuRoute`: CUDA tensors registered over CUDA IPC; the server copies each
  block region itself, so a queued save reads the engine's blocks (``saves_read_blocks``).
- :class:`CpuRoute`: block records staged in registered memfds (one for loads, one for
  the save queue); the server copies them to and from L1. A record carries a header with
  a CRC-32, checked on load.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import prefix
from .buffers import MemfdBuffer
from .kv_tensors import block_regions, cuda_ipc_buffer
from .worker import MAX_BATCH_ITEMS, Worker

# Under vLLM's logger when it runs there (its handlers cover "vllm.*").
log = logging.getLogger("vllm.kvwarden")

#: Blocks of one CPU load round: small enough that the server's copy of the next round
#: overlaps most of this one's check and scatter, large enough to cost few round trips.
LOAD_ROUND_BLOCKS = 16

#: An element type of each size, for moving tensors' bytes whatever their dtype.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Where one part of a block lives: (registered buffer index, offset, nbytes).
Region = Tuple[int, int, int]


@dataclass
class BlockMoves:
    """One request's blocks to move: ``keys[i]`` ↔ vLLM block ``block_ids[i]``."""

    req_id: str
    keys: List[bytes]
    block_ids: List[int]



class Route:
    """How one rank's blocks travel; ``load``/``save`` return how many blocks (from the
    first) went through, and open the connector's backoff on a failure."""

    #: Whether a queued save reads vLLM's blocks themselves (then a preempted
    #: request's saves must end before its blocks are reused).
    saves_read_blocks = False

    def __init__(self, connector: Any) -> None:
        self.c = connector

    def register(self, worker: Worker) -> None:
        raise NotImplementedError

    def block_bytes(self) -> int:
        """KV bytes of one block on this rank (for the metrics)."""
        raise NotImplementedError

    def stage_save(self, moves: BlockMoves) -> Tuple[Optional[Callable[[], int]], int]:
        """On the forward thread, right after the forward pass: makes the blocks of
        ``moves`` safe to save later and returns the save (run on the save lane; how
        many leading blocks it stored) and how many blocks were dropped (a full queue)."""
        raise NotImplementedError

    def load(self, moves: BlockMoves) -> int:
        """On the load lane: how many leading blocks of ``moves`` are now in vLLM's."""
        raise NotImplementedError

    def key(self, key: bytes, part: int) -> bytes:
        return prefix.rank_key(key, self.c._rank, part)

    def failed(self, what: str) -> None:
        # A stalled or dead server would cost a timeout per request and step: pause.
        # (A plain miss, a block evicted since the lookup, pauses too; it is rare.)
        self.c._backoff.failed()
        worker = self.c._worker
        # During an outage the Worker's outage log says it all, once.
        outage = getattr(worker, "outage", None)
        level = logging.DEBUG if outage is not None and outage.is_down() else logging.INFO
        log.log(
            level, "kvwarden: %s; no transfers for %g s", what, self.c._backoff.retry_after_seconds
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


class CpuRoute(Route):
    """Block records staged in registered memfds (buffer 0: loads, buffer 1: the save
    queue); the server copies them to and from L1."""

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
        if getattr(self, "staging", None) is None:  # kept across failed registrations
            rank = self.c._rank
            self.staging, self.table = self._buffer(self.c._staging_blocks, f"load-rank{rank}")
            self.queue, self.queue_table = self._buffer(
                self.c._save_queue_blocks, f"save-rank{rank}"
            )
            self.free_rows = list(range(self.c._save_queue_blocks))
            self.rows_lock = threading.Lock()
        worker.register_kv_cache(
            [self.staging, self.queue], model_name=self.c._model_name
        )

    def _buffer(self, rows: int, name: str) -> Tuple[MemfdBuffer, torch.Tensor]:
        buffer = MemfdBuffer.create(rows * self.stride, f"kvwarden-vllm-{name}")
        flat = torch.frombuffer(buffer.view, dtype=torch.uint8)
        return buffer, flat.view(rows, self.stride)

    def block_bytes(self) -> int:
        return self.payload_bytes

    def _parts(self, buffer: int, row: int) -> List[Region]:
        start = row * self.stride
        return [
            (
                buffer,
                start + p * self.slot_bytes,
                min(self.slot_bytes, self.record_bytes - p * self.slot_bytes),
            )
            for p in range(self.parts)
        ]

    def stage_save(self, moves: BlockMoves) -> Tuple[Optional[Callable[[], int]], int]:
        with self.rows_lock:
            count = min(len(moves.block_ids), len(self.free_rows))
            rows, self.free_rows = self.free_rows[:count], self.free_rows[count:]
        dropped = len(moves.block_ids) - count
        if not count:
            return None, dropped
        try:
            self._gather(moves.block_ids[:count], rows)
        except BaseException:
            self._release(rows)
            raise
        keys = moves.keys[:count]

        def save() -> int:
            try:
                for row, key in zip(rows, keys):
                    start = row * self.stride
                    record = self.queue.view[start : start + self.record_bytes]
                    payload = record[prefix.RECORD_HEADER_BYTES :]
                    record[: prefix.RECORD_HEADER_BYTES] = prefix.pack_header(
                        self.key(key, 0), payload, self.c._layout
                    )
                    del payload, record
                return self.save_parts(keys, [self._parts(1, row) for row in rows])
            finally:
                self._release(rows)

        return save, dropped

    def _release(self, rows: List[int]) -> None:
        with self.rows_lock:
            self.free_rows.extend(rows)

    def load(self, moves: BlockMoves) -> int:
        """In rounds of half the load staging buffer, pipelined: while this round's
        records are checked and scattered, the server copies the next round into the
        other half (fetched from the route's fetch thread; the worker's connection
        serializes the requests)."""
        rows = self.table.shape[0]
        halves = 2 if rows >= 2 else 1
        size = max(1, min(rows // halves, LOAD_ROUND_BLOCKS))
        rounds = [
            (moves.keys[first : first + size], moves.block_ids[first : first + size])
            for first in range(0, len(moves.block_ids), size)
        ]

        def fetch(index: int) -> int:
            keys = rounds[index][0]
            base = (index % halves) * size
            return self.load_parts(keys, [self._parts(0, base + row) for row in range(len(keys))])

        done = 0
        pending = self._fetcher().submit(fetch, 0) if rounds else None
        try:
            for index, (keys, ids) in enumerate(rounds):
                retrieved = pending.result()
                pending = None
                if retrieved == len(keys) and index + 1 < len(rounds) and halves == 2:
                    pending = self._fetcher().submit(fetch, index + 1)
                if retrieved < len(keys):
                    self.failed(f"block {ids[retrieved]}: not retrieved")
                base = (index % halves) * size
                good = 0
                for row, key in enumerate(keys[:retrieved]):
                    start = (base + row) * self.stride
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
                    self._scatter(ids[:good], base)
                done += good
                if good < len(ids):
                    break
                if pending is None and index + 1 < len(rounds):
                    pending = self._fetcher().submit(fetch, index + 1)  # one half only
        finally:
            if pending is not None:  # never leave a fetch writing into the staging rows
                pending.result()
        return done

    def _fetcher(self) -> "concurrent.futures.ThreadPoolExecutor":
        if getattr(self, "fetch_pool", None) is None:
            self.fetch_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"kvwarden-fetch-rank{self.c._rank}"
            )
        return self.fetch_pool

    def _gather(self, ids: List[int], rows: List[int]) -> None:
        """vLLM blocks ``ids`` into save-queue rows ``rows``, layer after layer."""
        index = torch.tensor(ids, dtype=torch.long)
        rows_index = torch.tensor(rows, dtype=torch.long)
        offset = prefix.RECORD_HEADER_BYTES
        for (_, tensor, dim), nbytes in zip(self.c._layers, self.layer_bytes):
            data = tensor.index_select(dim, index).movedim(dim, 0).reshape(len(ids), -1)
            self.queue_table[:, offset : offset + nbytes].index_copy_(
                0, rows_index, data.view(torch.uint8)
            )
            offset += nbytes

    def _scatter(self, ids: List[int], base: int = 0) -> None:
        """Load rows ``base..base + len(ids)`` into vLLM blocks ``ids`` (blocks of a request
        waiting for this load: no forward pass touches them meanwhile). On the load lane,
        with numpy over the same memory: a plain copy there, with no torch thread pool of
        its own competing with the forward pass's for the cores."""
        import numpy as np  # vLLM's dependency; the GPU route does without

        index = np.asarray(ids, dtype=np.int64)
        offset = prefix.RECORD_HEADER_BYTES
        for (_, tensor, dim), nbytes in zip(self.c._layers, self.layer_bytes):
            words = _WORDS[tensor.element_size()]
            shape = list(tensor.shape)
            del shape[dim]
            rows = self.table[base : base + len(ids), offset : offset + nbytes].view(words).numpy()
            target = np.moveaxis(tensor.view(words).numpy(), dim, 0)
            target[index] = rows.reshape([len(ids)] + shape)
            offset += nbytes


class GpuRoute(Route):
    """CUDA tensors registered over IPC; the server copies each block region itself."""

    saves_read_blocks = True

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
        worker.register_kv_cache(buffers, model_name=self.c._model_name)
        self.buffers = buffers
        self.queued = 0  # blocks whose save is queued or running
        self.queued_lock = threading.Lock()

    def block_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self._regions(0))

    def _regions(self, block_id: int) -> List[Tuple[int, int, int]]:
        """(buffer, offset, nbytes) of every region of a block, layer by layer."""
        out = []
        for index, tensor, dim in self.where:
            for offset, nbytes in block_regions(tensor, dim, block_id):
                out.append((index, offset, nbytes))
        return out

    def stage_save(self, moves: BlockMoves) -> Tuple[Optional[Callable[[], int]], int]:
        with self.queued_lock:
            count = min(len(moves.block_ids), self.c._save_queue_blocks - self.queued)
            count = max(count, 0)
            self.queued += count
        dropped = len(moves.block_ids) - count
        if not count:
            return None, dropped
        # The forward pass wrote these blocks: the server reads them once it is done.
        torch.cuda.current_stream().synchronize()
        keys, ids = moves.keys[:count], moves.block_ids[:count]

        def save() -> int:
            try:
                return self.save_parts(keys, [self._regions(block) for block in ids])
            finally:
                with self.queued_lock:
                    self.queued -= count

        return save, dropped

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
