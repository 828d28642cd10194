"""What the vLLM connector did, in vLLM's own stats and Prometheus output.

Every process of an engine counts what it did (the scheduler its lookups, each rank its
loads and saves) and hands vLLM the counts of the last interval
(``get_kv_connector_stats``); vLLM sums them over the ranks and intervals
(:class:`KvwardenStats`), logs them with its throughput line and passes them to
:class:`KvwardenPromMetrics`, whose counters appear on the server's ``/metrics`` as
``vllm:kvwarden_<name>_total`` (labelled per engine like vLLM's own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: Counter name → what it counts (the Prometheus help text).
COUNTERS: Dict[str, str] = {
    "lookups": "Requests whose prefix the scheduler looked up in kvwarden.",
    "lookup_failures": "Lookups that failed (server unreachable or stalled): no hits.",
    "lookup_hits": "Looked-up requests that kvwarden had at least one block of.",
    "matched_tokens": "Prompt tokens kvwarden offered to load (beyond vLLM's own prefix cache).",
    "blocks_loaded": "KV blocks loaded from kvwarden.",
    "bytes_loaded": "Bytes of KV loaded from kvwarden.",
    "load_seconds": "Seconds the load lanes spent loading (off the forward path).",
    "load_errors": "Blocks a load could not deliver (vLLM recomputed them).",
    "blocks_saved": "KV blocks saved to kvwarden.",
    "bytes_saved": "Bytes of KV saved to kvwarden.",
    "save_seconds": "Seconds the save lanes spent saving (off the forward path).",
    "saves_dropped": "Blocks not saved because the save queue was full.",
    "unreachable_seconds": "Seconds rank 0 found the kvwarden server unreachable.",
}


class Counters:
    """Cumulative counts (``total``, for tests) and those of the current interval
    (:meth:`take`, for vLLM's stats); thread-safe."""

    def __init__(self) -> None:
        self.total: Dict[str, float] = {name: 0 for name in COUNTERS}
        self._interval: Dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, value: float = 1) -> None:
        if not value:
            return
        with self._lock:
            self.total[name] = self.total.get(name, 0) + value
            self._interval[name] = self._interval.get(name, 0) + value

    def take(self) -> Dict[str, float]:
        """The counts since the last call, and a fresh interval."""
        with self._lock:
            interval, self._interval = self._interval, {}
        return interval


@dataclass
class KvwardenStats(KVConnectorStats):
    """Counts of one interval, summed over ranks (``data``: name → count)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> Dict[str, int | float]:
        out: Dict[str, int | float] = {}
        for name in COUNTERS:
            value = self.data.get(name, 0)
            out[name] = round(value, 3) if isinstance(value, float) else int(value)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvwardenPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Dict[type, type],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvwarden_{name}",
                documentation=help_text,
                labelnames=labelnames,
            )
            for name, help_text in COUNTERS.items()
        }
        self._per_engine = {
            engine: {name: c.labels(*values) for name, c in self._counters.items()}
            for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        counters = self._per_engine.get(engine_idx)
        if counters is None:
            return
        for name, value in (transfer_stats_data or {}).items():
            if name in counters and value and value > 0:
                counters[name].inc(value)
