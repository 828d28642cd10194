"""Where a block lives in an engine's paged KV tensors (needs PyTorch, not vLLM).

A paged KV tensor has one dimension of ``num_blocks``: dimension 0 on vLLM's CPU
backend (``[num_blocks, kv_heads, block_size, 2 * head_size]``) and on layouts that put
the block first, dimension 1 on those that put K/V first (``[2, num_blocks, ...]``).
One block of one layer is then one contiguous region per index of the dimensions laid
out before it in memory: one region, or a K and a V region. The GPU check
(``python/scripts/gpu_kv_check.py``) and the vLLM connector both use these helpers.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Tuple

from .buffers import CUDA_IPC_HANDLE_BYTES, CudaIpcBuffer


def block_dim(tensor: Any, num_blocks: int) -> int:
    """The dimension of ``tensor`` that indexes blocks: 0 or 1, whichever has
    ``num_blocks`` entries (0 when both do)."""
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(
        f"a KV tensor of shape {tuple(tensor.shape)} has no dimension 0 or 1 of "
        f"{num_blocks} blocks; kvwarden supports block-first and K/V-first paged layouts"
    )


def block_regions(tensor: Any, dim: int, block_id: int) -> List[Tuple[int, int]]:
    """``(byte offset within the tensor's storage, nbytes)`` of each contiguous region
    holding block ``block_id``: one per index of the dimensions laid out before the
    block dimension in memory.

    The tensor may be a permuted view of a contiguous one (vLLM permutes its KV views
    for head-major layouts): regions follow the memory order, and a region copied into
    another block's regions of a tensor of the same layout moves exactly that block."""
    # Memory order: dimensions by decreasing stride (stable, so ties keep their order).
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    physical = tensor.permute(order)
    if not physical.is_contiguous():
        raise ValueError(
            f"a KV tensor of shape {tuple(tensor.shape)} and strides {tuple(tensor.stride())} "
            f"is not a permutation of a contiguous one; kvwarden copies blocks as "
            f"contiguous byte ranges"
        )
    position = order.index(dim)
    element = tensor.element_size()
    stride = physical.stride()
    base = physical.storage_offset()
    nbytes = stride[position] * element
    regions = []
    for outer in itertools.product(*(range(n) for n in physical.shape[:position])):
        first = base + sum(i * s for i, s in zip(outer, stride)) + block_id * stride[position]
        regions.append((first * element, nbytes))
    return regions


#: The version byte of the handle PyTorch's ``_share_cuda_()`` returns since it stopped
#: returning a bare ``cudaIpcMemHandle_t`` (torch 2.11 on an H200, driver 580): version,
#: the segment's type, then the type's payload.
TORCH_HANDLE_VERSION = 2
#: The type of a block ``cudaMalloc`` allocated: its payload is the 64-byte
#: ``cudaIpcMemHandle_t`` of the allocation's base.
TORCH_HANDLE_CUDA_MALLOC = ord("c")
#: The type of an expandable segment (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``):
#: memory from ``cuMemCreate``, which has no CUDA IPC handle.
TORCH_HANDLE_EXPANDABLE = ord("e")


def torch_ipc_handle(shared: bytes, torch_version: str) -> bytes:
    """The ``cudaIpcMemHandle_t`` in what ``storage._share_cuda_()`` gave as its handle:
    the bare 64 bytes (older PyTorch), or version 2 of PyTorch's shareable handle of
    type ``c`` (a ``cudaMalloc`` block; 66 bytes). Anything else is refused with a
    message that names it, the torch version, and what to change."""
    shared = bytes(shared)
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) >= 2 and shared[0] == TORCH_HANDLE_VERSION:
        kind = shared[1]
        if kind == TORCH_HANDLE_CUDA_MALLOC and len(shared) == 2 + CUDA_IPC_HANDLE_BYTES:
            return shared[2:]
        if kind == TORCH_HANDLE_EXPANDABLE:
            raise ValueError(
                f"the KV cache is in an expandable segment (torch {torch_version}, "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): such memory has no "
                f"CUDA IPC handle. Start the engine without expandable_segments (or with "
                f"expandable_segments:False) so that its KV cache is cudaMalloc'd"
            )
    described = (
        f"version {shared[0]}, type {chr(shared[1])!r}"
        if len(shared) >= 2 and 32 <= shared[1] < 127
        else "an unknown layout"
    )
    raise ValueError(
        f"torch {torch_version} shares this KV cache with a {len(shared)}-byte handle of "
        f"{described}; kvwarden reads the bare 64-byte cudaIpcMemHandle_t and version "
        f"{TORCH_HANDLE_VERSION} type 'c' (a cudaMalloc block, 66 bytes). Run the engine "
        f"with PyTorch's default CUDA caching allocator (no custom memory pool), or a "
        f"torch version whose handle kvwarden reads"
    )


def cuda_ipc_buffer(tensor: Any) -> CudaIpcBuffer:
    """The whole storage under a CUDA ``tensor`` as a :class:`CudaIpcBuffer`: offsets of
    :func:`block_regions` are offsets in it."""
    if not tensor.is_cuda:
        raise ValueError(f"cuda_ipc_buffer needs a CUDA tensor, got one on {tensor.device}")
    storage = tensor.untyped_storage()
    # (device, handle, size_bytes, offset_bytes, ...): the handle names the allocation's
    # base, offset_bytes where this storage starts in it.
    shared = storage._share_cuda_()
    device, handle, size_bytes, offset_bytes = shared[0], shared[1], shared[2], shared[3]
    import torch

    handle = torch_ipc_handle(bytes(handle), torch.__version__)
    return CudaIpcBuffer(handle, int(device), int(offset_bytes), int(size_bytes))
