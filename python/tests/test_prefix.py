"""The prefix keys and block records the engine connectors store (no engine needed)."""

from kvwarden import prefix

ROOT = prefix.namespace({"model": "m", "dtype": "bfloat16", "block_size": 4, "tp_size": 1})
LAYOUT = prefix.layout_digest("(2, 4, 8):torch.bfloat16:0")


def test_keys_cover_only_full_blocks():
    assert len(prefix.chain_keys(ROOT, list(range(11)), 4)) == 2
    assert len(prefix.chain_keys(ROOT, list(range(12)), 4)) == 3
    assert prefix.chain_keys(ROOT, [1, 2, 3], 4) == []


def test_a_shared_prefix_shares_keys_and_a_changed_token_changes_every_later_key():
    a = prefix.chain_keys(ROOT, list(range(16)), 4)
    b = prefix.chain_keys(ROOT, list(range(16)), 4)
    changed = list(range(16))
    changed[5] = 999  # in block 1
    c = prefix.chain_keys(ROOT, changed, 4)
    assert a == b
    assert c[0] == a[0]
    assert all(x != y for x, y in zip(c[1:], a[1:]))


def test_different_models_or_layouts_never_share_keys():
    tokens = list(range(8))
    base = prefix.chain_keys(ROOT, tokens, 4)
    for field, value in (("model", "other"), ("dtype", "float16"), ("tp_size", 2)):
        fields = {"model": "m", "dtype": "bfloat16", "block_size": 4, "tp_size": 1}
        fields[field] = value
        other = prefix.chain_keys(prefix.namespace(fields), tokens, 4)
        assert not set(other) & set(base), field


def test_namespace_ignores_the_order_fields_are_given_in():
    assert prefix.namespace({"a": 1, "b": 2}) == prefix.namespace({"b": 2, "a": 1})


def test_rank_and_part_make_distinct_server_keys():
    key = prefix.chain_keys(ROOT, list(range(4)), 4)[0]
    keys = {prefix.rank_key(key, r, p) for r in range(2) for p in range(3)}
    assert len(keys) == 6


def test_the_last_prompt_token_is_always_recomputed():
    # 8 tokens, blocks of 4, both stored: only the first block may be loaded.
    assert prefix.loadable_tokens(2, 4, 8, 0) == 4
    # 9 tokens: both full blocks may be loaded, the 9th token is computed.
    assert prefix.loadable_tokens(2, 4, 9, 0) == 8
    # Only what lies beyond what the engine computed itself counts.
    assert prefix.loadable_tokens(2, 4, 9, 4) == 4
    assert prefix.loadable_tokens(2, 4, 9, 8) == 0
    assert prefix.loadable_tokens(0, 4, 9, 0) == 0
    assert prefix.loadable_tokens(5, 4, 1, 0) == 0


def _record(key, payload, layout=LAYOUT):
    return prefix.pack_header(key, payload, layout) + payload


def test_a_record_loads_under_its_own_key_layout_and_length():
    key = prefix.rank_key(b"k" * prefix.KEY_BYTES, 0)
    payload = bytes(range(256)) * 4
    assert prefix.record_problem(_record(key, payload), key, len(payload), LAYOUT) is None


def test_a_corrupted_or_foreign_record_is_refused():
    key = prefix.rank_key(b"k" * prefix.KEY_BYTES, 0)
    other = prefix.rank_key(b"k" * prefix.KEY_BYTES, 1)
    payload = bytes(range(256)) * 4
    good = _record(key, payload)
    flipped = bytearray(good)
    flipped[prefix.RECORD_HEADER_BYTES + 100] ^= 1
    assert "checksum" in prefix.record_problem(bytes(flipped), key, len(payload), LAYOUT)
    assert "another key" in prefix.record_problem(good, other, len(payload), LAYOUT)
    assert "layout" in prefix.record_problem(
        good, key, len(payload), prefix.layout_digest("(2, 4, 16):torch.float16:1")
    )
    assert "payload of" in prefix.record_problem(
        _record(key, payload[:-2]) + b"\0\0", key, len(payload), LAYOUT
    )
    assert "magic" in prefix.record_problem(b"\0" * len(good), key, len(payload), LAYOUT)
    assert "record of" in prefix.record_problem(good[:-1], key, len(payload), LAYOUT)


def test_a_header_without_a_crc_checks_key_layout_and_length_only():
    # A record staged in device memory: the host writes its header from the payload's
    # length, and checks only the header on load.
    key = prefix.rank_key(b"k" * prefix.KEY_BYTES, 0)
    other = prefix.rank_key(b"k" * prefix.KEY_BYTES, 1)
    header = prefix.pack_header(key, 1024, LAYOUT)
    assert len(header) == prefix.RECORD_HEADER_BYTES
    assert prefix.header_problem(header, key, 1024, LAYOUT) is None
    assert "another key" in prefix.header_problem(header, other, 1024, LAYOUT)
    assert "payload of" in prefix.header_problem(header, key, 1023, LAYOUT)
    assert "layout" in prefix.header_problem(header, key, 1024, b"\1" * 8)
    assert "header of" in prefix.header_problem(header[:-1], key, 1024, LAYOUT)
    # The whole-record check still wants the CRC: one of 0 is not a payload's.
    payload = b"\1" * 1024
    assert "checksum" in prefix.record_problem(header + payload, key, 1024, LAYOUT)


def test_extra_keys_change_the_block_they_belong_to_and_every_later_key():
    root = prefix.namespace({"model": "m"})
    tokens = list(range(96))
    plain = prefix.chain_keys(root, tokens, 32)
    assert prefix.chain_keys(root, tokens, 32, [None, None, None]) == plain  # as before
    salted = prefix.encode_extra_keys((("cache_salt", "tenant-b"),))
    image = prefix.encode_extra_keys((("mm", "img-hash", 4),))

    first = prefix.chain_keys(root, tokens, 32, [salted, None, None])
    middle = prefix.chain_keys(root, tokens, 32, [None, image, None])

    assert all(a != b for a, b in zip(first, plain))  # the salt: every key differs
    assert middle[0] == plain[0]
    assert middle[1] != plain[1] and middle[2] != plain[2]


def test_extra_keys_encode_distinct_values_distinctly():
    values = [
        None,
        True,
        False,
        0,
        1,
        "1",
        b"1",
        1.0,
        ("a", "b"),
        ("ab",),
        (("a",), "b"),
        ["a", "b", None],
        ("lora", "adapter-a", "/a"),
        ("lora", "adapter-a", "/b"),
    ]
    encoded = [prefix.encode_extra_keys(v) for v in values]
    assert len(set(encoded)) == len(values)
    # A tuple and a list of the same items are the same keys (engines use either).
    assert prefix.encode_extra_keys(("x", 1)) == prefix.encode_extra_keys(["x", 1])
    assert prefix.encode_extra_keys(("mm", "h", 3)) == prefix.encode_extra_keys(("mm", "h", 3))
