"""The announcer's rules (issue 42), without an engine: a block is announced once every
shard is held, its metadata is known and its parent is announced, withdrawn (with the
blocks after it) as soon as that stops being true, and a resync withdraws everything
before it applies the snapshot."""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import msgpack

from kvwarden import kv_announce
from kvwarden.kv_announce import Announcer, BlockMeta, decode_meta, encode_meta


def rank_key(chain_key: bytes, rank: int) -> bytes:
    return chain_key + b"/" + bytes([rank])


def make(shards: int = 2) -> Announcer:
    return Announcer(
        shards,
        rank_key,
        stored=lambda meta: ("stored", meta.block_hash, meta.parent_hash, tuple(meta.token_ids)),
        removed=lambda block_hash: ("removed", block_hash),
    )


def meta(n: int) -> BlockMeta:
    return BlockMeta(
        block_hash=f"h{n}",
        parent_hash=f"h{n - 1}" if n else None,
        token_ids=[n, n],
        extra_keys=None,
    )


def shard(
    n: int, rank: int, stored: bool = True, tier: str = "l1", meta: Optional[bytes] = None
) -> Tuple[bool, bytes, str, Optional[bytes]]:
    return (stored, rank_key(f"k{n}".encode(), rank), tier, meta)


def test_a_block_is_announced_once_every_shard_is_held_and_withdrawn_when_one_is_not() -> None:
    a = make()
    a.learn(b"k0", meta(0))
    a.apply(b"c1", False, [shard(0, 0)])
    assert a.take() == [], "one of two shards: not loadable yet"
    a.apply(b"c2", False, [shard(0, 1)])
    assert a.take() == [("stored", "h0", None, (0, 0))]
    assert a.cursor == b"c2"
    # Held in L2 too: rank 1 leaving L1 leaves it loadable.
    a.apply(b"c3", False, [shard(0, 1, tier="l2"), shard(0, 1, stored=False)])
    assert a.take() == []
    a.apply(b"c4", False, [shard(0, 0, stored=False)])
    assert a.take() == [("removed", "h0")]
    assert a.announced() == 0


def test_shards_held_before_their_block_is_known_are_announced_when_it_is() -> None:
    a = make()
    a.apply(b"c", False, [shard(0, 0), shard(0, 1), shard(1, 0), shard(1, 1), shard(2, 0)])
    assert a.take() == [], "nothing known of these blocks yet"
    a.learn(b"k1", meta(1))
    assert a.take() == [], "k1's parent is not known: k1 alone cannot be loaded"
    a.learn(b"k0", meta(0))
    a.learn(b"k2", meta(2))
    assert a.take() == [
        ("stored", "h0", None, (0, 0)),
        ("stored", "h1", "h0", (1, 1)),
    ], "k0, then k1 after it; k2 lacks a shard"


def test_a_block_whose_parent_leaves_is_withdrawn_with_every_block_after_it() -> None:
    """vLLM #57159: a block is loadable only with its whole prefix, so a block whose
    parent left is not announced on its own. Control: the last block leaving withdraws
    only itself."""
    a = make(shards=1)
    for n in range(4):
        a.learn(f"k{n}".encode(), meta(n))
    a.apply(b"c", False, [shard(n, 0) for n in range(4)])
    assert [e[1] for e in a.take()] == ["h0", "h1", "h2", "h3"], "in chain order"
    a.apply(b"d", False, [shard(3, 0, stored=False)])
    assert a.take() == [("removed", "h3")], "control: only the last block"
    a.apply(b"e", False, [shard(3, 0)])
    assert a.take() == [("stored", "h3", "h2", (3, 3))]
    a.apply(b"f", False, [shard(1, 0, stored=False)])
    assert sorted(a.take()) == [("removed", "h1"), ("removed", "h2"), ("removed", "h3")]
    assert a.announced() == 1, "k0 stays"
    a.apply(b"g", False, [shard(1, 0)])
    assert [e[1] for e in a.take()] == ["h1", "h2", "h3"], "back, in chain order"


def test_a_resync_withdraws_everything_then_applies_the_snapshot() -> None:
    a = make(shards=1)
    for n in range(3):
        a.learn(f"k{n}".encode(), meta(n))
    a.apply(b"c", False, [shard(n, 0) for n in range(3)])
    assert len(a.take()) == 3
    a.apply(b"d", True, [shard(1, 0), shard(0, 0)])
    assert a.take() == [
        ("removed", "h0"),
        ("removed", "h1"),
        ("removed", "h2"),
        ("stored", "h0", None, (0, 0)),
        ("stored", "h1", "h0", (1, 1)),
    ]
    assert a.announced() == 2


def test_an_unreachable_server_withdraws_everything_and_the_next_read_starts_over() -> None:
    a = make(shards=1)
    a.learn(b"k0", meta(0))
    a.apply(b"c", False, [shard(0, 0)])
    assert a.take() == [("stored", "h0", None, (0, 0))]
    a.withdraw_all()
    assert a.take() == [("removed", "h0")]
    assert a.cursor == b"", "the next read is a new reader's"


def test_a_block_whose_metadata_is_forgotten_is_withdrawn(monkeypatch) -> None:
    monkeypatch.setattr(kv_announce, "MAX_BLOCKS", 2)
    a = make(shards=1)
    a.learn(b"k0", meta(0))
    a.apply(b"c", False, [shard(0, 0)])
    assert a.take() == [("stored", "h0", None, (0, 0))]
    a.learn(b"k1", meta(1))
    a.learn(b"k2", meta(2))  # k0 is the oldest: forgotten, so withdrawn
    events: List[Any] = a.take()
    assert events == [("removed", "h0")]
    assert a.announced() == 0


def test_a_block_another_engine_described_is_announced_from_its_description() -> None:
    # Engine 1 learned block k0 from a request, announced it, and describes it.
    one = make(shards=2)
    one.learn(b"k0", meta(0))
    one.apply(b"c", False, [shard(0, 0), shard(0, 1)])
    assert one.take() == [("stored", "h0", None, (0, 0))]
    [(chain_key, key, described)] = one.to_describe(8)
    assert (chain_key, key) == (b"k0", rank_key(b"k0", 0))
    one.mark_described([chain_key])
    assert one.to_describe(8) == [], "described once"
    # Engine 2 never saw the request: the server tells it the description with the
    # first shard, and it announces the block once both shards are held.
    two = make(shards=2)
    two.apply(b"c", True, [shard(0, 0, meta=described)])
    assert two.take() == []
    two.apply(b"d", False, [shard(0, 1)])
    assert two.take() == [("stored", "h0", None, (0, 0))]
    assert two.to_describe(8) == [], "the server holds it already"


def test_a_description_that_does_not_name_its_shard_or_cannot_be_read_is_ignored() -> None:
    a = make(shards=1)
    wrong = encode_meta(b"k9", meta(9))  # names block k9, sent with k0's shard
    a.apply(b"c", False, [shard(0, 0, meta=wrong), shard(1, 0, meta=b"\xc1garbage")])
    assert a.take() == []
    assert decode_meta(b"\xc1garbage") is None
    assert decode_meta(encode_meta(b"k1", meta(1))) == (b"k1", meta(1))


def test_a_block_is_described_again_when_its_first_shard_returns_to_l1() -> None:
    a = make(shards=1)
    a.learn(b"k0", meta(0))
    a.apply(b"c", False, [shard(0, 0)])
    assert [chain for chain, _, _ in a.to_describe(8)] == [b"k0"]
    a.mark_described([b"k0"])  # refused, say: the shard was only in L2
    assert a.to_describe(8) == [], "not asked again every step"
    a.apply(b"d", False, [shard(0, 0, stored=False), shard(0, 0)])  # a new value in L1
    assert [chain for chain, _, _ in a.to_describe(8)] == [b"k0"]


def test_an_adapters_block_is_described_with_its_adapter_and_a_version_1_description_is_read() -> (
    None
):
    import msgpack

    adapter = meta(1)._replace(extra_keys=(("lora", "a"),), lora_name="a", lora_id=3)
    assert decode_meta(encode_meta(b"k1", adapter)) == (b"k1", adapter)
    # Another engine's connector of the version before: no adapter field.
    version_1 = msgpack.packb([1, b"k1", "h1", "h0", [1, 1], None], use_bin_type=True)
    assert decode_meta(version_1) == (b"k1", meta(1))
    # An adapter field that is not [name, id]: not read.
    bad = msgpack.packb([2, b"k1", "h1", "h0", [1, 1], None, [3, "a"]], use_bin_type=True)
    assert decode_meta(bad) is None


#: The description the Rust server reads (``kvwarden_core::kv_publish``'s test decodes
#: the same bytes): the two sides of version 3 agree byte for byte.
DESCRIPTION_V3 = os.path.join(
    os.path.dirname(__file__), "..", "..", "core", "src", "kv_publish", "description-v3.msgpack"
)


def v3_example() -> bytes:
    block = BlockMeta(
        block_hash=b"hash",
        parent_hash=7,
        token_ids=[1, 2],
        extra_keys=(("lora", "adapter"), "salt"),
        lora_name="adapter",
        lora_id=3,
    )
    return encode_meta(b"chain", block, [b"k0", b"k1"], [["adapter", "salt"]])


def test_a_description_names_every_shard_and_the_events_extra_keys_as_the_server_reads_it() -> (
    None
):
    a = Announcer(
        2,
        rank_key,
        stored=lambda meta: ("stored", meta.block_hash),
        removed=lambda block_hash: ("removed", block_hash),
        event_extra_keys=lambda meta: [["salt"]],
    )
    a.learn(b"k0", meta(0))
    a.apply(b"c", False, [shard(0, 0), shard(0, 1)])
    [(chain, first, description)] = a.to_describe(8)
    assert (chain, first) == (b"k0", rank_key(b"k0", 0))
    fields = msgpack.unpackb(description, raw=False)
    assert fields[0] == kv_announce.META_VERSION == 3
    assert fields[7] == [rank_key(b"k0", 0), rank_key(b"k0", 1)], "every shard, the first first"
    assert fields[8] == [["salt"]]
    assert decode_meta(description) == (b"k0", meta(0)), "this side reads it too"
    # The bytes the server's decoder is tested with are what this side writes.
    with open(DESCRIPTION_V3, "rb") as f:
        assert f.read() == v3_example()
