"""The batched moves both routes share (``Route.save_parts``/``load_parts``), against a
worker that records its batches: a block's first part is stored only after all its
others, a failure stops at the first incomplete block, and a step larger than a batch
goes in several."""

from types import SimpleNamespace
from typing import Any, List, Optional, Set

from kvwarden import prefix
from kvwarden.kv_routes import Route
from kvwarden.vllm import _Backoff
from kvwarden.worker import MAX_BATCH_ITEMS


class RecordingWorker:
    def __init__(self, full: Set[bytes] = frozenset(), missing: Set[bytes] = frozenset()):
        self.full, self.missing = full, missing
        self.batches: List[List[Any]] = []

    def store_batch(self, items: List[Any]) -> List[bool]:
        self.batches.append(list(items))
        return [key not in self.full for key, _, _, _ in items]

    def retrieve_batch(self, items: List[Any]) -> List[Optional[int]]:
        self.batches.append(list(items))
        return [None if key in self.missing else nbytes for key, _, _, nbytes in items]


def route(worker: RecordingWorker) -> Route:
    connector = SimpleNamespace(_rank=0, _worker=worker, _backoff=_Backoff(5.0))
    return Route(connector)


def key(block: int, part: int) -> bytes:
    return prefix.rank_key(b"b%d" % block, 0, part)


KEYS = [b"b0", b"b1", b"b2"]
PARTS = [[(0, 1000 * b + 100 * p, 100) for p in range(3)] for b in range(3)]


def test_save_stores_every_other_part_then_the_first_parts_in_two_batches() -> None:
    worker = RecordingWorker()
    assert route(worker).save_parts(KEYS, PARTS) == 3
    assert [[item[0] for item in batch] for batch in worker.batches] == [
        [key(b, p) for b in range(3) for p in (1, 2)],
        [key(b, 0) for b in range(3)],
    ]
    assert worker.batches[1][2] == (key(2, 0), 0, 2000, 100)


def test_save_stops_before_the_first_block_with_a_part_not_stored() -> None:
    worker = RecordingWorker(full={key(1, 2)})
    r = route(worker)
    assert r.save_parts(KEYS, PARTS) == 1
    assert [item[0] for item in worker.batches[1]] == [key(0, 0)], "no head of block 1 or 2"
    assert not r.c._backoff.open(), "a failed save pauses transfers"


def test_one_part_blocks_save_in_one_batch() -> None:
    worker = RecordingWorker()
    parts = [[(0, 100 * b, 100)] for b in range(3)]
    assert route(worker).save_parts(KEYS, parts) == 3
    assert [len(batch) for batch in worker.batches if batch] == [3]


def test_load_counts_the_leading_blocks_whose_every_part_came_back() -> None:
    worker = RecordingWorker(missing={key(1, 1)})
    assert route(worker).load_parts(KEYS, PARTS) == 1
    assert len(worker.batches) == 1 and len(worker.batches[0]) == 9, "one request"
    assert worker.batches[0][5] == (key(1, 2), 0, 1200, 100), "each item carries its nbytes"
    assert route(RecordingWorker()).load_parts(KEYS, PARTS) == 3


def test_a_step_larger_than_a_batch_goes_in_several() -> None:
    worker = RecordingWorker()
    blocks = MAX_BATCH_ITEMS + 5
    keys = [b"b%d" % b for b in range(blocks)]
    parts = [[(0, 100 * b, 100)] for b in range(blocks)]
    assert route(worker).load_parts(keys, parts) == blocks
    assert [len(batch) for batch in worker.batches] == [MAX_BATCH_ITEMS, 5]


def test_the_backoff_closes_after_a_failure_and_opens_on_a_recovery_or_its_time() -> None:
    recoveries = [0]
    backoff = _Backoff(3600.0, lambda: recoveries[0])
    assert backoff.open()
    backoff.failed()
    assert not backoff.open()  # an hour to wait…
    recoveries[0] += 1  # …unless the heartbeat restored the registrations
    assert backoff.open()
    backoff.failed()
    assert not backoff.open()  # a failure after that recovery closes it again
    assert _Backoff(0.0, lambda: 0).open()
