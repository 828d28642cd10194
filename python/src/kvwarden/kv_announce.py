"""Announcing what kvwarden holds as an engine's KV events (issue 42).

A KV-aware router learns which blocks an engine can serve from the engine's KV events.
The server tells a reader what entered and left its tenant's tiers (``kv_events``); the
scheduler-side connector turns that into the engine's own events for the blocks it can
load from kvwarden: a block is announced once every shard of it (one per
tensor-parallel rank) is held, in L1 or L2, and its parent is announced (a block loads
only with its whole prefix, so one whose parent left is not announced on its own), and
withdrawn, with every block after it, as soon as that stops being true. The
server's keys do not say which tokens a block holds: a block is announced once its
metadata (hash, parent, tokens, extra keys) is known, learned from a request with that
prefix (``learn``) or from the description another engine of the tenant attached to
the block's first shard on the server (``describe_keys``, :func:`encode_meta`); until
then its shards are remembered, bounded. Blocks learned here are described in turn
(``to_describe``), so that every engine of the tenant can announce them.

Pure and engine-neutral: the events are made by the two functions it is given, and its
rules are tested without an engine.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import msgpack

#: Blocks whose metadata is kept, and shards whose presence is kept (oldest first out).
MAX_BLOCKS = 65536
MAX_SHARDS = 262144


class BlockMeta(NamedTuple):
    """What an engine's ``BlockStored`` needs of a block besides its key."""

    block_hash: Any
    parent_hash: Optional[Any]
    token_ids: List[int]
    extra_keys: Optional[Tuple[Any, ...]]
    #: The LoRA adapter whose block it is (vLLM's ``lora_name`` and ``lora_id``).
    lora_name: Optional[str] = None
    lora_id: Optional[int] = None


#: The description format's version (the first element of an encoded description):
#: 2 adds the adapter; 3 adds every shard's server key and ``BlockStored.extra_keys``
#: as the engine publishes it, so that the server can announce the block itself
#: (``kvwarden serve --kv-events``, ``kvwarden_core::kv_publish``). Versions 1 and 2
#: are still read.
META_VERSION = 3


def encode_meta(
    chain_key: bytes,
    meta: BlockMeta,
    shard_keys: Sequence[bytes] = (),
    event_extra_keys: Any = None,
) -> bytes:
    """A block's description for the server (``describe_keys``): ``shard_keys`` are
    the server keys of every shard of the block, the one it is attached to first."""
    return msgpack.packb(
        [
            META_VERSION,
            chain_key,
            meta.block_hash,
            meta.parent_hash,
            list(meta.token_ids),
            None if meta.extra_keys is None else list(meta.extra_keys),
            None if meta.lora_name is None else [meta.lora_name, meta.lora_id],
            list(shard_keys),
            event_extra_keys,
        ],
        use_bin_type=True,
    )


def decode_meta(data: bytes) -> Optional[Tuple[bytes, BlockMeta]]:
    """The block a description names, or None for one this version cannot read."""
    try:
        fields = msgpack.unpackb(data, raw=False)
    except Exception:
        return None
    if not isinstance(fields, list) or (fields[:1], len(fields)) not in (
        ([1], 6),
        ([2], 7),
        ([3], 9),
    ):
        return None
    _, chain_key, block_hash, parent_hash, tokens, extra = fields[:6]
    lora = fields[6] if len(fields) >= 7 else None
    if not isinstance(chain_key, bytes) or not isinstance(tokens, list):
        return None
    if not all(isinstance(t, int) for t in tokens):
        return None
    lora_name, lora_id = None, None
    if lora is not None:
        if not (
            isinstance(lora, list)
            and len(lora) == 2
            and isinstance(lora[0], str)
            and (lora[1] is None or isinstance(lora[1], int))
        ):
            return None
        lora_name, lora_id = lora
    extra_keys = None if extra is None else tuple(_tuples(extra))
    return chain_key, BlockMeta(block_hash, parent_hash, tokens, extra_keys, lora_name, lora_id)


def _tuples(items: Any) -> List[Any]:
    """Lists back to the tuples the engine's extra keys were (msgpack has no tuple)."""
    return [tuple(_tuples(i)) if isinstance(i, list) else i for i in items]


class Announcer:
    """Turns ``kv_events`` pages into announcements (see the module docs).

    ``rank_key(chain_key, rank)`` is the server key of a block's shard; ``stored(meta)``
    and ``removed(block_hash)`` make the engine's events; ``event_extra_keys(meta)`` is
    what the engine's ``BlockStored.extra_keys`` says of the block, for its description.
    """

    def __init__(
        self,
        shards: int,
        rank_key: Callable[[bytes, int], bytes],
        stored: Callable[[BlockMeta], Any],
        removed: Callable[[Any], Any],
        event_extra_keys: Callable[[BlockMeta], Any] = lambda meta: None,
    ) -> None:
        self._shards = shards
        self._rank_key = rank_key
        self._stored = stored
        self._removed = removed
        self._event_extra_keys = event_extra_keys
        #: The reader's cursor for the next ``kv_events``.
        self.cursor = b""
        self._meta: "OrderedDict[bytes, BlockMeta]" = OrderedDict()
        #: The block of each known hash, and the known blocks whose parent has a hash.
        self._by_hash: Dict[Any, bytes] = {}
        self._children: Dict[Any, Set[bytes]] = {}
        self._block_of: Dict[bytes, bytes] = {}
        self._present: "OrderedDict[bytes, Set[str]]" = OrderedDict()
        self._announced: Set[bytes] = set()
        #: Blocks whose description the server holds (told by it, or sent to it).
        self._described: Set[bytes] = set()
        self._out: List[Any] = []

    def learn(self, chain_key: bytes, meta: BlockMeta) -> None:
        """Remembers what block ``chain_key`` is; announces it if it is held."""
        if chain_key in self._meta:
            self._meta.move_to_end(chain_key)
            return
        self._meta[chain_key] = meta
        self._by_hash[meta.block_hash] = chain_key
        if meta.parent_hash is not None:
            self._children.setdefault(meta.parent_hash, set()).add(chain_key)
        for rank in range(self._shards):
            self._block_of[self._rank_key(chain_key, rank)] = chain_key
        while len(self._meta) > MAX_BLOCKS:
            self._forget(next(iter(self._meta)))
        self._settle(chain_key)

    def apply(
        self,
        cursor: bytes,
        resync: bool,
        events: Sequence[Tuple[bool, bytes, str, Optional[bytes]]],
    ) -> None:
        """Applies one ``kv_events`` page."""
        if resync:
            for chain_key in sorted(self._announced):
                self._out.append(self._removed(self._meta[chain_key].block_hash))
            self._announced.clear()
            self._present.clear()
            self._described.clear()
        touched: List[bytes] = []
        for stored, key, tier, described in events:
            if stored and described is not None:
                block = decode_meta(described)
                if block is not None and self._rank_key(block[0], 0) == key:
                    self.learn(*block)
                    self._described.add(block[0])
            elif stored and tier == "l1":
                # A new value of a block's first shard has no description: describe again.
                first = self._block_of.get(key)
                if first is not None and self._rank_key(first, 0) == key:
                    self._described.discard(first)
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

    def to_describe(self, limit: int) -> List[Tuple[bytes, bytes, bytes]]:
        """Up to ``limit`` announced blocks whose description the server lacks:
        ``(chain_key, first shard's server key, description)``."""
        out = []
        for chain_key in self._announced:
            if chain_key not in self._described and len(out) < limit:
                meta = self._meta[chain_key]
                shards = [self._rank_key(chain_key, r) for r in range(self._shards)]
                extra = self._event_extra_keys(meta)
                out.append((chain_key, shards[0], encode_meta(chain_key, meta, shards, extra)))
        return out

    def mark_described(self, chain_keys: Sequence[bytes]) -> None:
        """These blocks were described (or could not be: their first shard is not in
        L1): not again until that shard enters L1 anew."""
        self._described.update(chain_keys)

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

    def _loadable(self, chain_key: bytes) -> bool:
        """Known, every shard held, and its parent (if any) announced."""
        meta = self._meta.get(chain_key)
        if meta is None:
            return False
        if not all(self._rank_key(chain_key, r) in self._present for r in range(self._shards)):
            return False
        if meta.parent_hash is None:
            return True
        parent = self._by_hash.get(meta.parent_hash)
        return parent is not None and parent in self._announced

    def _settle(self, chain_key: bytes) -> None:
        """Announces or withdraws the block as it is loadable or not, then the blocks
        after it (a parent's event always comes before its children's)."""
        todo = [chain_key]
        while todo:
            block = todo.pop()
            loadable = self._loadable(block)
            if loadable == (block in self._announced):
                continue
            meta = self._meta.get(block)
            if loadable and meta is not None:
                self._announced.add(block)
                self._out.append(self._stored(meta))
            else:
                self._announced.discard(block)
                if meta is not None:
                    self._out.append(self._removed(meta.block_hash))
            if meta is not None:
                todo.extend(self._children.get(meta.block_hash, ()))

    def _forget(self, chain_key: bytes) -> None:
        """Drops a block's metadata: withdrawn if announced (its removal could not be
        told later)."""
        meta = self._meta.pop(chain_key)
        self._described.discard(chain_key)
        for rank in range(self._shards):
            self._block_of.pop(self._rank_key(chain_key, rank), None)
        if self._by_hash.get(meta.block_hash) == chain_key:
            del self._by_hash[meta.block_hash]
        siblings = self._children.get(meta.parent_hash)
        if siblings is not None:
            siblings.discard(chain_key)
            if not siblings:
                del self._children[meta.parent_hash]
        if chain_key in self._announced:
            self._announced.discard(chain_key)
            self._out.append(self._removed(meta.block_hash))
            for child in list(self._children.get(meta.block_hash, ())):
                self._settle(child)
