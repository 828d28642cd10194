"""Prefix keys and block records: what an engine connector stores under which key.

Pure and engine-neutral (no vLLM, no torch): the vLLM connector (``kvwarden.vllm``)
builds on it, and its rules are tested without an engine.

A block's key is chained: ``key[i] = blake2b(key[i-1] + token ids of block i)``, with
``key[-1]`` a namespace digest of everything that makes KV bytes differ for the same
tokens (model, dtype, KV layout, block size, tensor-parallel size). Equal keys therefore
mean an equal prefix of the same model in the same layout, and a block is only ever
found together with every block before it. What else makes a block's KV differ for the
same tokens (an engine's per-block extra keys: LoRA adapter, multimodal hashes, a
tenant's ``cache_salt``) goes into that block's digest too (``extras``), and so into
every later key. Each tensor-parallel rank stores its own
shard under ``rank_key(key, rank, part)``.

A stored value is a record: a 64-byte header (magic, payload length, CRC-32 of the
payload, the key it was stored under, a digest of the storing worker's tensor layout)
followed by the payload. A record that fails any check is treated as a miss: the engine
recomputes the block instead of loading bytes it cannot trust.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import List, Mapping, Optional, Sequence, Union

#: Bytes of a chained block key.
KEY_BYTES = 16
#: Bytes before a record's payload (keeps the payload 64-byte aligned).
RECORD_HEADER_BYTES = 64
_MAGIC = b"KVWBLK01"
# magic, payload bytes, crc32, layout digest (8), key (16 + 4 rank/part)
_HEADER = struct.Struct("<8sQI8s20s")
assert _HEADER.size <= RECORD_HEADER_BYTES


def namespace(fields: Mapping[str, Union[str, int]]) -> bytes:
    """The chain's root: a digest of ``fields`` (sorted, so the order given is irrelevant).

    Put every property that changes the KV bytes of a token: model, dtype, KV layout,
    block size, tensor-parallel size."""
    text = "\n".join(f"{name}={fields[name]}" for name in sorted(fields))
    return hashlib.blake2b(b"kvwarden-prefix/1\n" + text.encode(), digest_size=KEY_BYTES).digest()


def chain_keys(
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    extras: Optional[Sequence[Optional[bytes]]] = None,
) -> List[bytes]:
    """The keys of the *full* blocks of ``token_ids``; a partial last block has none.

    ``extras[i]``, when given and not None, is what besides its tokens makes block ``i``'s
    KV bytes differ (an engine's per-block extra keys: an adapter, an image's hash, a
    tenant's salt; :func:`encode_extra_keys`): it goes into block ``i``'s digest, and so
    through the chain into every later key. Without extras a key is as before."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size!r}")
    keys: List[bytes] = []
    previous = root
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        block = struct.pack(f"<{block_size}q", *token_ids[start : start + block_size])
        extra = extras[index] if extras is not None and index < len(extras) else None
        if extra:
            block += _EXTRA_MARK + struct.pack("<I", len(extra)) + extra
        previous = hashlib.blake2b(previous + block, digest_size=KEY_BYTES).digest()
        keys.append(previous)
    return keys


#: Separates a block's tokens from its extra keys in the digest's input (tokens are
#: whole 8-byte words, so no token list can end in these bytes and a length).
_EXTRA_MARK = b"\xffkvw-extra"


def encode_extra_keys(value: object) -> bytes:
    """A canonical byte string of an engine's extra keys for one block: nested tuples and
    lists of str, bytes, int, float, bool and None, each tagged with its type and length,
    so that two different values never encode alike. Anything else is encoded by its
    type name and ``repr`` (stable for the value types engines use)."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: object, out: bytearray) -> None:
    def tagged(tag: bytes, body: bytes) -> None:
        out.extend(tag + struct.pack("<I", len(body)) + body)

    if value is None:
        out.extend(b"N")
    elif isinstance(value, bool):
        out.extend(b"T" if value else b"F")
    elif isinstance(value, int):
        tagged(b"i", str(value).encode())
    elif isinstance(value, float):
        out.extend(b"f" + struct.pack("<d", value))
    elif isinstance(value, str):
        tagged(b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        tagged(b"b", bytes(value))
    elif isinstance(value, (tuple, list)):
        out.extend(b"t" + struct.pack("<I", len(value)))
        for item in value:
            _encode(item, out)
    else:
        tagged(b"r", f"{type(value).__qualname__}:{value!r}".encode("utf-8", "replace"))


def rank_key(key: bytes, rank: int, part: int = 0) -> bytes:
    """The server key of part ``part`` of tensor-parallel rank ``rank``'s shard of a block."""
    return key + struct.pack("<HH", rank, part)


def loadable_tokens(
    hit_blocks: int, block_size: int, prompt_tokens: int, computed_tokens: int
) -> int:
    """How many tokens beyond ``computed_tokens`` an engine may load for a prompt of
    ``prompt_tokens`` whose first ``hit_blocks`` blocks are stored.

    The last prompt token is always recomputed (its logits start the generation), so a
    prompt that is exactly a whole number of blocks loads one block less."""
    usable_blocks = min(hit_blocks, max(prompt_tokens - 1, 0) // block_size)
    return max(usable_blocks * block_size - computed_tokens, 0)


def layout_digest(description: str) -> bytes:
    """8 bytes naming a worker's tensor layout (shapes, dtype, block dimension)."""
    return hashlib.blake2b(description.encode(), digest_size=8).digest()


def pack_header(key: bytes, payload: Union[bytes, memoryview, int], layout: bytes) -> bytes:
    """The header of a record holding ``payload`` under ``key`` (a ``rank_key``). Given
    the payload's length instead of its bytes (a record staged in device memory, which
    the host does not read), the header carries no CRC-32 (0) and its payload is not
    checked on load (:func:`header_problem`)."""
    if isinstance(payload, int):
        length, crc = payload, 0
    else:
        length, crc = len(payload), zlib.crc32(payload)
    header = _HEADER.pack(_MAGIC, length, crc, layout, key)
    return header.ljust(RECORD_HEADER_BYTES, b"\0")


def header_problem(
    header: Union[bytes, memoryview], key: bytes, payload_bytes: int, layout: bytes
) -> Optional[str]:
    """Why a record with this ``header`` cannot be loaded as ``key``'s block, leaving out
    its payload's CRC-32 (:func:`record_problem` checks that too), or None."""
    if len(header) < RECORD_HEADER_BYTES:
        return f"header of {len(header)} bytes, expected {RECORD_HEADER_BYTES}"
    magic, length, _, got_layout, got_key = _HEADER.unpack_from(header, 0)
    if magic != _MAGIC:
        return f"bad magic {magic!r}, expected {_MAGIC!r}"
    if got_key != key:
        return "the record was stored under another key"
    if length != payload_bytes:
        return f"payload of {length} bytes, expected {payload_bytes}"
    if got_layout != layout:
        return "stored by a worker with another tensor layout"
    return None


def record_problem(
    record: Union[bytes, memoryview], key: bytes, payload_bytes: int, layout: bytes
) -> Optional[str]:
    """Why ``record`` cannot be loaded as ``key``'s block, or None when it can."""
    if len(record) < RECORD_HEADER_BYTES + payload_bytes:
        return f"record of {len(record)} bytes, expected {RECORD_HEADER_BYTES + payload_bytes}"
    problem = header_problem(record[:RECORD_HEADER_BYTES], key, payload_bytes, layout)
    if problem is not None:
        return problem
    crc = _HEADER.unpack_from(record, 0)[2]
    payload = memoryview(record)[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + payload_bytes]
    if zlib.crc32(payload) != crc:
        return "checksum mismatch (corrupted)"
    return None
