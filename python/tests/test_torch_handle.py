"""The CUDA IPC handle in what PyTorch's ``storage._share_cuda_()`` returns (issue 47):
the bare 64-byte ``cudaIpcMemHandle_t`` of older torch, and version 2 of torch's
shareable handle (torch 2.11 on an H200: a version byte 2, a type byte ``c`` for a
``cudaMalloc`` block, then the 64 bytes). An expandable segment (type ``e``, 42 bytes
there) and an unknown version are refused with a message naming the torch version and
the setting to change (for type ``e``, also ``cuda_buffer``, which registers it as
``cuda_vmm``); nothing is guessed from a length alone."""

from __future__ import annotations

import pytest

from kvwarden.kv_tensors import torch_ipc_handle

HANDLE = bytes(range(7, 71))  # 64 bytes, none of them a prefix's


def test_the_bare_64_byte_handle_is_taken_as_it_is() -> None:
    assert torch_ipc_handle(HANDLE, "2.4.0") == HANDLE


def test_version_2_of_a_cuda_malloc_block_gives_the_64_bytes_after_its_prefix() -> None:
    assert torch_ipc_handle(b"\x02c" + HANDLE, "2.11.0") == HANDLE


def test_an_expandable_segment_names_the_allocator_setting() -> None:
    with pytest.raises(ValueError) as refused:
        torch_ipc_handle(b"\x02e" + bytes(40), "2.11.0")
    message = str(refused.value)
    assert "torch 2.11.0" in message
    assert "expandable_segments:True" in message and "expandable_segments:False" in message
    assert "cuda_buffer()" in message and "cuda_vmm" in message, "the way to register it"


@pytest.mark.parametrize(
    "shared, described",
    [
        (b"\x03c" + HANDLE, "version 3, type 'c'"),  # a later version of the same type
        (b"\x02c" + HANDLE[:63], "version 2, type 'c'"),  # a payload one byte short
        (b"\x02x" + HANDLE, "version 2, type 'x'"),  # a type kvwarden does not know
        (b"\x02", "an unknown layout"),
        (b"", "an unknown layout"),
    ],
)
def test_any_other_handle_is_refused_naming_it_and_the_torch_version(
    shared: bytes, described: str
) -> None:
    with pytest.raises(ValueError) as refused:
        torch_ipc_handle(shared, "2.99.0")
    message = str(refused.value)
    assert f"torch 2.99.0 shares this KV cache with a {len(shared)}-byte handle" in message
    assert described in message, message
    assert "version 2 type 'c'" in message
