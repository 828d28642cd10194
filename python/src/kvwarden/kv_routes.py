"""How one rank's KV blocks travel between an engine's tensors and a kvwarden server.

Engine-neutral apart from torch: the vLLM connector (``kvwarden.vllm``) drives these
routes from its lanes, and ``python/scripts/gpu_kv_check.py`` drives the same GPU route
on a GPU host without vLLM. A route's host (the connector, or a stand-in) provides:
``_rank``, ``_layers`` (``(name, tensor, block dim)`` per KV tensor), ``_worker`` (a
registered :class:`~kvwarden.Worker`), ``_backoff`` (``failed()``,
``retry_after_seconds``), ``_staging_blocks``, ``_save_queue_blocks``, ``_layout`` (the
tensor layout digest) and ``_model_name``.

Both routes stage (:class:`StagedRoute`): a block is gathered into one record (a
64-byte header with its key and the layout digest, then every layer's bytes of the
block) in a staging buffer registered with the server, one for loads and one for the
save queue, and the server copies each record between it and L1: one key and one L1
slot per block when the record fits a slot (``--slot-bytes``), a few large copies
instead of one small copy per layer.

- :class:`GpuRoute`: staging in device memory shared over CUDA IPC; the gather and the
  scatter run on the route's own CUDA streams, ordered after the forward pass by the GPU,
  so no hook synchronizes the forward pass.
- :class:`CpuRoute`: staging in memfds; each record also carries a CRC-32 of its
  payload, checked on load.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import prefix
from .buffers import MemfdBuffer
from .kv_tensors import cuda_ipc_buffer
from .worker import MAX_BATCH_ITEMS, Worker

# Under vLLM's logger when it runs there (its handlers cover "vllm.*").
log = logging.getLogger("vllm.kvwarden")

#: Blocks of one CPU load round: small enough that the server's copy of the next round
#: overlaps most of this one's check and scatter, large enough to cost few round trips.
LOAD_ROUND_BLOCKS = 16

#: Below this share of the L1 a block's record takes that is the block's own bytes, the
#: route tells the operator which ``--slot-bytes`` fits its records.
L1_USE_WARNING = 0.9

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
    #: request's saves must end before its blocks are reused). The staged routes save
    #: their own copy; a route that lets the server read vLLM's blocks sets it.
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


class StagedRoute(Route):
    """Blocks gathered into staging rows, one record per block (a header, then every
    layer's bytes of the block), registered with the server in two buffers (0: loads,
    1: the save queue); the server copies each record between its row and L1 in
    slot-size parts: a few large copies a block, and one key per block when its record
    fits a slot (``--slot-bytes``). A queued save reads the save queue's own copy, never
    vLLM's blocks. :class:`CpuRoute` stages in memfds, :class:`GpuRoute` in device
    memory shared over CUDA IPC."""

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
            log.info(
                "kvwarden: rank %d: staging %.1f MiB of %s memory (kvwarden_staging_blocks "
                "%d + kvwarden_save_queue_blocks %d rows of %d bytes), %d L1 slot(s) a block",
                rank,
                (self.c._staging_blocks + self.c._save_queue_blocks) * self.stride / 2**20,
                self.table.device.type,
                self.c._staging_blocks,
                self.c._save_queue_blocks,
                self.stride,
                self.parts,
            )
            self._advise_slot_bytes()
        worker.register_kv_cache([self.staging, self.queue], model_name=self.c._model_name)

    def l1_use(self) -> float:
        """KV bytes of a block over the L1 bytes its record takes (G5)."""
        return self.payload_bytes / (self.parts * self.slot_bytes)

    def _advise_slot_bytes(self) -> None:
        """Names the ``--slot-bytes`` that fits a record when the server's slots leave
        much of the L1 a block takes empty."""
        fitting = -(-self.record_bytes // 64) * 64
        better = self.payload_bytes / fitting
        if self.l1_use() < L1_USE_WARNING and better > self.l1_use():
            log.warning(
                "kvwarden: rank %d: a block record is %d bytes and the server's L1 slots "
                "%d bytes, so blocks fill %.0f%% of the L1 they take; start kvwarden serve "
                "with --slot-bytes %d to fill %.0f%% (every engine on the node shares the "
                "slot size)",
                self.c._rank,
                self.record_bytes,
                self.slot_bytes,
                100 * self.l1_use(),
                fitting,
                100 * better,
            )

    def _buffer(self, rows: int, name: str) -> Tuple[Any, torch.Tensor]:
        """A staging buffer of ``rows`` rows of ``self.stride`` bytes: what to register
        with the server, and a ``[rows, stride]`` uint8 tensor over the same bytes."""
        raise NotImplementedError

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
        keys = moves.keys[:count]
        try:
            ready = self._gather(moves.block_ids[:count], rows, keys)
        except BaseException:
            self._release(rows)
            raise

        def save() -> int:
            try:
                ready()
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
                problems = self._problems(base, [self.key(key, 0) for key in keys[:retrieved]])
                good = 0
                for problem in problems:
                    if problem is not None:
                        log.warning("kvwarden: block %d not loaded: %s", ids[good], problem)
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

    def _gather(self, ids: List[int], rows: List[int], keys: List[bytes]) -> Callable[[], None]:
        """On the forward thread: starts gathering vLLM blocks ``ids`` (and their
        headers) into save-queue rows ``rows``; returns what the save lane calls before
        the server reads those rows (it returns once they are complete)."""
        raise NotImplementedError

    def _gather_layers(self, ids: List[int], rows: List[int]) -> None:
        """vLLM blocks ``ids`` into save-queue rows ``rows``, layer after layer, with
        torch on the tensors' device."""
        device = self.queue_table.device
        index = _index(ids, device)
        rows_index = _index(rows, device)
        offset = prefix.RECORD_HEADER_BYTES
        for (_, tensor, dim), nbytes in zip(self.c._layers, self.layer_bytes):
            data = tensor.index_select(dim, index).movedim(dim, 0).reshape(len(ids), -1)
            self.queue_table[:, offset : offset + nbytes].index_copy_(
                0, rows_index, data.view(torch.uint8)
            )
            offset += nbytes

    def _problems(self, base: int, keys: List[bytes]) -> List[Optional[str]]:
        """Per loaded row ``base + i``: why it cannot be loaded as ``keys[i]``, or None."""
        raise NotImplementedError

    def _scatter(self, ids: List[int], base: int = 0) -> None:
        """Load rows ``base..base + len(ids)`` into vLLM blocks ``ids`` (blocks of a
        request waiting for this load: no forward pass touches them meanwhile); returns
        once they are in place."""
        raise NotImplementedError


class CpuRoute(StagedRoute):
    """Records in registered memfds, with a CRC-32 of each payload: written on the save
    lane, checked on load."""

    def _buffer(self, rows: int, name: str) -> Tuple[MemfdBuffer, torch.Tensor]:
        buffer = MemfdBuffer.create(rows * self.stride, f"kvwarden-vllm-{name}")
        flat = torch.frombuffer(buffer.view, dtype=torch.uint8)
        return buffer, flat.view(rows, self.stride)

    def _gather(self, ids: List[int], rows: List[int], keys: List[bytes]) -> Callable[[], None]:
        self._gather_layers(ids, rows)  # a memcpy: done when it returns

        def seal() -> None:  # the header and CRC, on the save lane
            for row, key in zip(rows, keys):
                start = row * self.stride
                record = self.queue.view[start : start + self.record_bytes]
                payload = record[prefix.RECORD_HEADER_BYTES :]
                record[: prefix.RECORD_HEADER_BYTES] = prefix.pack_header(
                    self.key(key, 0), payload, self.c._layout
                )
                del payload, record

        return seal

    def _problems(self, base: int, keys: List[bytes]) -> List[Optional[str]]:
        out = []
        for row, key in enumerate(keys):
            start = (base + row) * self.stride
            out.append(
                prefix.record_problem(
                    self.staging.view[start : start + self.record_bytes],
                    key,
                    self.payload_bytes,
                    self.c._layout,
                )
            )
        return out

    def _scatter(self, ids: List[int], base: int = 0) -> None:
        """With numpy over the same memory, on the load lane: a plain copy there, with no
        torch thread pool of its own competing with the forward pass's for the cores."""
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


class GpuRoute(StagedRoute):
    """Records in device memory shared with the server over CUDA IPC. The gather and the
    scatter are torch copies on the route's own CUDA streams, ordered after the forward
    pass's stream by the GPU itself: no hook synchronizes the forward pass from the host.
    The save lane waits for the gather's event, the load lane for the scatter's; the
    server then moves each record (one or a few slot-size copies) between the device and
    L1. Headers carry the key and the layout but no CRC-32 (the host never reads a
    payload)."""

    def _buffer(self, rows: int, name: str) -> Tuple[Any, torch.Tensor]:
        device = self.c._layers[0][1].device
        pools = self.__dict__.setdefault("pools", [])  # alive as long as the route
        with _cuda_malloc_segments(pools):
            table = torch.empty((rows, self.stride), dtype=torch.uint8, device=device)
        return cuda_ipc_buffer(table), table

    def _stream(self, which: str) -> Any:
        """The route's stream for ``which`` ("save" or "load"), made on first use."""
        streams = self.__dict__.setdefault("streams", {})
        if which not in streams:
            streams[which] = torch.cuda.Stream(device=self.c._layers[0][1].device)
        return streams[which]

    def _on(self, which: str, after_forward: bool = False) -> Any:
        """A context that makes the ``which`` stream current; with ``after_forward``
        (on the model runner's thread), the stream first waits on the GPU for the work
        the forward pass's stream has queued so far."""
        stream = self._stream(which)
        if after_forward:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        return torch.cuda.stream(stream)

    def _event(self, which: str) -> Any:
        event = torch.cuda.Event()
        event.record(self._stream(which))
        return event

    def _gather(self, ids: List[int], rows: List[int], keys: List[bytes]) -> Callable[[], None]:
        headers = b"".join(
            prefix.pack_header(self.key(key, 0), self.payload_bytes, self.c._layout) for key in keys
        )
        with self._on("save", after_forward=True):
            host = torch.frombuffer(bytearray(headers), dtype=torch.uint8).view(len(keys), -1)
            self.queue_table[:, : prefix.RECORD_HEADER_BYTES].index_copy_(
                0, _index(rows, self.queue_table.device), _to(host, self.queue_table.device)
            )
            self._gather_layers(ids, rows)
            event = self._event("save")
        return event.synchronize

    def _problems(self, base: int, keys: List[bytes]) -> List[Optional[str]]:
        # The server's copies into the rows ended before its answer: read the headers.
        with self._on("load"):
            headers = self.table[base : base + len(keys), : prefix.RECORD_HEADER_BYTES].cpu()
        return [
            prefix.header_problem(
                bytes(headers[row].numpy()), key, self.payload_bytes, self.c._layout
            )
            for row, key in enumerate(keys)
        ]

    def _scatter(self, ids: List[int], base: int = 0) -> None:
        # The blocks belong to a request waiting for this load: no forward pass work
        # touches them, so the load stream need not follow the forward pass.
        with self._on("load"):
            index = _index(ids, self.table.device)
            offset = prefix.RECORD_HEADER_BYTES
            for (_, tensor, dim), nbytes in zip(self.c._layers, self.layer_bytes):
                words = _WORDS[tensor.element_size()]
                shape = list(tensor.shape)
                del shape[dim]
                rows = self.table[base : base + len(ids), offset : offset + nbytes]
                values = rows.contiguous().view(words).view([len(ids)] + shape)
                tensor.view(words).index_copy_(dim, index, values.movedim(0, dim))
                offset += nbytes
            event = self._event("load")
        event.synchronize()


@contextlib.contextmanager
def _cuda_malloc_segments(pools: List[Any]) -> Iterator[None]:
    """Device allocations inside get a segment of their own that ``cudaMalloc`` made,
    which has a CUDA IPC handle, even in an engine that runs with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: the allocations go to a fresh
    ``torch.cuda.MemPool`` (appended to ``pools``: no free block of an expandable
    segment to reuse), with expandable segments off for their duration. vLLM's own KV
    cache keeps whatever allocator it has: the server never maps it."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    make_pool = getattr(torch.cuda, "MemPool", None)
    use_pool = getattr(torch.cuda, "use_mem_pool", None)
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if make_pool is None or use_pool is None:
        yield  # an older torch: the caching allocator's default (cudaMalloc) segments
        return
    pools.append(make_pool())
    if expandable and setter is not None:
        setter("expandable_segments:False")
    try:
        with use_pool(pools[-1]):
            yield
    finally:
        if expandable and setter is not None:
            setter("expandable_segments:True")


def _index(values: List[int], device: Any) -> torch.Tensor:
    """``values`` as a long tensor on ``device``."""
    return _to(torch.tensor(values, dtype=torch.long), device)


def _to(host: torch.Tensor, device: Any) -> torch.Tensor:
    """``host`` on ``device``; to a CUDA device from page-locked memory without waiting
    (a copy from pageable memory would synchronize the stream, and so wait for the
    forward pass this stream follows)."""
    if host.device == device:
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _leading(answers: List[Any]) -> int:
    """How many answers, from the first, are true."""
    count = 0
    for answer in answers:
        if not answer:
            break
        count += 1
    return count
