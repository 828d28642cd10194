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

from .buffers import CudaIpcBuffer


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
    return CudaIpcBuffer(bytes(handle), int(device), int(offset_bytes), int(size_bytes))
