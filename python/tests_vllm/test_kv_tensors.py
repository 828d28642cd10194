"""The block regions the CUDA route (and gpu_kv_check.py) copies, checked on CPU
tensors of vLLM's layouts: copying a block's regions onto another block's regions moves
exactly that block, and nothing else."""

import pytest
import torch

from kvwarden.kv_tensors import block_dim, block_regions

NUM_BLOCKS = 10


def kv_first():  # FlashAttention: [2, num_blocks, block_size, kv_heads, head_size]
    return torch.randn(2, NUM_BLOCKS, 16, 4, 8)


def block_first():  # FlashInfer: [num_blocks, 2, block_size, kv_heads, head_size]
    return torch.randn(NUM_BLOCKS, 2, 16, 4, 8)


def cpu():  # vLLM's CPU backend: [num_blocks, kv_heads, block_size, 2 * head_size]
    return torch.randn(NUM_BLOCKS, 4, 16, 16)


def head_major_view():  # HND memory viewed as NHD: a permuted, non-contiguous view
    return torch.randn(2, NUM_BLOCKS, 4, 16, 8).permute(0, 1, 3, 2, 4)


def carved_from_one_allocation():  # the second of two layers sharing one buffer
    return torch.randn(2, 2, NUM_BLOCKS, 16, 4, 8)[1]


def mla():  # MLA (DeepSeek): one latent tensor, [num_blocks, block_size, kv_lora_rank + rope_dim]
    return torch.randn(NUM_BLOCKS, 16, 72)


def cross_layer():  # cross-layer blocks: one layer's view of [num_blocks, num_layers, 2, ...]
    return torch.randn(NUM_BLOCKS, 3, 2, 16, 4, 8)[:, 1]


def cross_layer_kv_first():  # the same, viewed K/V first as attention backends index it
    return torch.randn(NUM_BLOCKS, 3, 2, 16, 4, 8)[:, 2].transpose(0, 1)


LAYOUTS = [
    kv_first,
    block_first,
    cpu,
    head_major_view,
    carved_from_one_allocation,
    mla,
    cross_layer,
    cross_layer_kv_first,
]


def copy_block(tensor, dim, source, target):
    """What the server does: the bytes of ``source``'s regions into ``target``'s."""
    raw = tensor.untyped_storage()
    for (src, n), (dst, m) in zip(
        block_regions(tensor, dim, source), block_regions(tensor, dim, target)
    ):
        assert n == m
        raw[dst : dst + n].copy_(raw[src : src + n].clone())


@pytest.mark.parametrize("make", LAYOUTS, ids=[f.__name__ for f in LAYOUTS])
def test_copying_a_blocks_regions_moves_exactly_that_block(make):
    tensor = make().to(torch.bfloat16)
    dim = block_dim(tensor, NUM_BLOCKS)
    before = tensor.clone()

    copy_block(tensor, dim, 3, 7)

    assert torch.equal(tensor.select(dim, 7), before.select(dim, 3))
    assert not torch.equal(tensor.select(dim, 7), before.select(dim, 7))
    for other in set(range(NUM_BLOCKS)) - {7}:
        assert torch.equal(tensor.select(dim, other), before.select(dim, other)), other


def test_a_block_is_one_region_block_first_and_two_kv_first():
    assert len(block_regions(block_first(), 0, 1)) == 1
    assert len(block_regions(kv_first(), 1, 1)) == 2


def test_a_tensor_without_a_block_dimension_is_refused_naming_its_shape():
    with pytest.raises(ValueError, match=r"\(3, 4, 5\)"):
        block_dim(torch.zeros(3, 4, 5), NUM_BLOCKS)


def test_a_strided_slice_is_refused():
    sliced = torch.zeros(NUM_BLOCKS, 4, 16, 16)[:, :, ::2]
    with pytest.raises(ValueError, match="not contiguous"):
        block_regions(sliced, 0, 0)


def test_one_layer_of_cross_layer_blocks_is_one_region_a_block_strided_by_all_layers():
    whole = torch.randn(NUM_BLOCKS, 3, 2, 16, 4, 8)
    layer = whole[:, 1]
    regions = block_regions(layer, 0, 4)
    element = layer.element_size()
    one_layer = 2 * 16 * 4 * 8 * element
    # Block 4 of layer 1: after 4 blocks of all 3 layers and layer 0 of block 4.
    assert regions == [((4 * 3 + 1) * one_layer, one_layer)]


def test_overlapping_blocks_are_refused():
    overlapping = torch.zeros(64).as_strided((NUM_BLOCKS, 8), (4, 1))
    with pytest.raises(ValueError, match="contiguous byte ranges"):
        block_regions(overlapping, 0, 0)
