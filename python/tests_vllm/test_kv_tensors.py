"""The block regions the CUDA route (and gpu_kv_check.py) copies, checked on CPU
tensors of vLLM's layouts: the bytes at a block's regions are exactly that block."""

import pytest
import torch

from kvwarden.kv_tensors import block_dim, block_regions

NUM_BLOCKS = 10
LAYOUTS = {
    "kv_first (FlashAttention)": (2, NUM_BLOCKS, 16, 4, 8),
    "block_first (FlashInfer)": (NUM_BLOCKS, 2, 16, 4, 8),
    "cpu": (NUM_BLOCKS, 4, 16, 16),
}


def region_bytes(tensor, regions):
    raw = tensor.untyped_storage()
    return b"".join(bytes(raw[offset : offset + nbytes]) for offset, nbytes in regions)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_blocks_regions_hold_exactly_that_block(layout):
    tensor = torch.randn(LAYOUTS[layout]).to(torch.bfloat16)
    dim = block_dim(tensor, NUM_BLOCKS)
    for block in (0, 3, NUM_BLOCKS - 1):
        want = tensor.select(dim, block).contiguous().view(torch.uint8).numpy().tobytes()
        assert region_bytes(tensor, block_regions(tensor, dim, block)) == want
        other = tensor.select(dim, (block + 1) % NUM_BLOCKS).contiguous()
        assert region_bytes(tensor, block_regions(tensor, dim, block)) != (
            other.view(torch.uint8).numpy().tobytes()
        )


def test_a_view_into_a_shared_allocation_counts_its_own_offset():
    shared = torch.randn((2,) + LAYOUTS["kv_first (FlashAttention)"]).to(torch.bfloat16)
    second = shared[1]
    want = second.select(1, 4).contiguous().view(torch.uint8).numpy().tobytes()
    assert region_bytes(second, block_regions(second, 1, 4)) == want


def test_a_tensor_without_a_block_dimension_is_refused_naming_its_shape():
    with pytest.raises(ValueError, match=r"\(3, 4, 5\)"):
        block_dim(torch.zeros(3, 4, 5), NUM_BLOCKS)
