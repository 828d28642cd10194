"""Announcing what kvwarden holds as an engine's KV events (issue 42).

A KV-aware router learns which blocks an engine can serve from the engine's KV events.
The server tells a reader what entered and left its tenant's tiers (``kv_events``); the
scheduler-side connector turns that into the engine's own events for the blocks it can
load from kvwarden: a block is announced once every shard of it (one per
tensor-parallel rank) is held, in L1 or L2, and withdrawn as soon as one is not. The
server's keys do not say which tokens a block holds, so a block is announced only once
the connector has seen a request with that prefix (its hash, parent, tokens and extra
keys: ``learn``); until then its shards are remembered, bounded.

Pure and engine-neutral: the events are made by the two functions it is given, and its
rules are tested without an engine.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

#: Blocks whose metadata is kept, and shards whose presence is kept (oldest first out).
MAX_BLOCKS = 65536
MAX_SHARDS = 262144


class BlockMeta(NamedTuple):
    """What an engine's ``BlockStored`` needs of a block besides its key."""

    block_hash: Any
    parent_hash: Optional[Any]
    token_ids: List[int]
    extra_keys: Optional[Tuple[Any, ...]]


class Announcer:
    """Turns ``kv_events`` pages into announcements (see the module docs).

    ``rank_key(chain_key, rank)`` is the server key of a block's shard; ``stored(meta)``
    and ``removed(block_hash)`` make the engine's events.
    """

    def __init__(
        self,
        shards: int,
        rank_key: Callable[[bytes, int], bytes],
        stored: Callable[[BlockMeta], Any],
        removed: Callable[[Any], Any],
    ) -> None:
        self._shards = shards
        self._rank_key = rank_key
        self._stored = stored
        self._removed = removed
        #: The reader's cursor for the next ``kv_events``.
        self.cursor = b""
        self._meta: "OrderedDict[bytes, BlockMeta]" = OrderedDict()
        self._block_of: Dict[bytes, bytes] = {}
        self._present: "OrderedDict[bytes, Set[str]]" = OrderedDict()
        self._announced: Set[bytes] = set()
        self._out: List[Any] = []

    def learn(self, chain_key: bytes, meta: BlockMeta) -> None:
        """Remembers what block ``chain_key`` is; announces it if it is held."""
        if chain_key in self._meta:
            self._meta.move_to_end(chain_key)
            return
        self._meta[chain_key] = meta
        for rank in range(self._shards):
            self._block_of[self._rank_key(chain_key, rank)] = chain_key
        while len(self._meta) > MAX_BLOCKS:
            self._forget(next(iter(self._meta)))
        self._settle(chain_key)

    def apply(self, cursor: bytes, resync: bool, events: Sequence[Tuple[bool, bytes, str]]) -> None:
        """Applies one ``kv_events`` page."""
        if resync:
            for chain_key in sorted(self._announced):
                self._out.append(self._removed(self._meta[chain_key].block_hash))
            self._announced.clear()
            self._present.clear()
        touched: List[bytes] = []
        for stored, key, tier in events:
            if stored:
                self._present.setdefault(key, set()).add(tier)
                self._present.move_to_end(key)
            else:
                tiers = self._present.get(key)
                if tiers is not None:
                    tiers.discard(tier)
                    if not tiers:
                        del self._present[key]
            chain_key = self._block_of.get(key)
            if chain_key is not None:
                touched.append(chain_key)
        while len(self._present) > MAX_SHARDS:
            key, _ = self._present.popitem(last=False)
            if key in self._block_of:
                touched.append(self._block_of[key])
        for chain_key in dict.fromkeys(touched):
            self._settle(chain_key)
        self.cursor = cursor

    def withdraw_all(self) -> None:
        """The server cannot be reached: nothing is loadable. Everything announced is
        withdrawn, and the next read starts over (a resync)."""
        self.apply(b"", True, [])

    def take(self) -> List[Any]:
        """The events made since the last call, oldest first."""
        out, self._out = self._out, []
        return out

    def announced(self) -> int:
        """Blocks announced now."""
        return len(self._announced)

    def _held(self, chain_key: bytes) -> bool:
        return all(self._rank_key(chain_key, r) in self._present for r in range(self._shards))

    def _settle(self, chain_key: bytes) -> None:
        meta = self._meta.get(chain_key)
        if meta is None:
            return
        held = self._held(chain_key)
        if held and chain_key not in self._announced:
            self._announced.add(chain_key)
            self._out.append(self._stored(meta))
        elif not held and chain_key in self._announced:
            self._announced.discard(chain_key)
            self._out.append(self._removed(meta.block_hash))

    def _forget(self, chain_key: bytes) -> None:
        """Drops a block's metadata: withdrawn if announced (its removal could not be
        told later)."""
        meta = self._meta.pop(chain_key)
        for rank in range(self._shards):
            self._block_of.pop(self._rank_key(chain_key, rank), None)
        if chain_key in self._announced:
            self._announced.discard(chain_key)
            self._out.append(self._removed(meta.block_hash))
