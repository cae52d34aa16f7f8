"""moe_fuse.attention: the block mask built from the key padding lists the tiles torch's create_block_mask lists
on the dense mask function; and causal_padded_attention equals SDPA with the materialised mask in float64,
forward and backward, rows that see no key included (zeros)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from moe_fuse import attention


def key_valid(kind, batch, n, seed=0):
    valid = torch.ones(batch, n, dtype=torch.bool)
    if kind == "right":
        valid[0, n - n // 3:] = False
        valid[1, n - 1:] = False
    elif kind == "left":
        valid[0, : n // 2] = False
        valid[1, :129] = False
    elif kind == "random":  # holes anywhere, a whole empty key tile in the first row
        gen = torch.Generator().manual_seed(seed)
        valid = torch.rand(batch, n, generator=gen) > 0.2
        valid[0, 128:256] = False
    return valid


def listed(counts, indices) -> set:
    """{(b, row, column)}: the tiles a block mask lists for each row (up to its count)."""
    return {(b, row, int(c)) for b in range(counts.shape[0]) for row in range(counts.shape[-1])
            for c in indices[b, 0, row, : int(counts[b, 0, row])]}


@pytest.mark.parametrize("n", [1, 100, 128, 300, 640])
@pytest.mark.parametrize("kind", ["ones", "right", "left", "random"])
def test_block_mask_lists_the_tiles_torch_lists(kind, n):
    """The tiles that hold a visible (query, key) pair are listed, as by torch's create_block_mask on the dense mask
    function; a tile listed full has every pair of its rows in range visible (torch also counts the rows past n,
    so its last query tile is never full: ours may be); the query-major lists are the key-major ones transposed."""
    valid = key_valid(kind, 2, n)
    got = attention.block_mask(valid, n)
    want = create_block_mask(lambda b, h, q, kv: (kv <= q) & valid[b, kv], 2, 1, n, n, device="cpu")
    full = listed(got.full_kv_num_blocks, got.full_kv_indices)
    partial = listed(got.kv_num_blocks, got.kv_indices)
    assert not full & partial
    assert full | partial == listed(want.kv_num_blocks, want.kv_indices) | listed(want.full_kv_num_blocks,
                                                                                 want.full_kv_indices)
    assert listed(want.full_kv_num_blocks, want.full_kv_indices) <= full
    dense = torch.ones(n, n, dtype=torch.bool).tril() & valid[:, None, :]
    tile = attention.BLOCK
    for b, row, col in full:
        assert dense[b, row * tile:(row + 1) * tile, col * tile:(col + 1) * tile].all()
    transposed = {(b, c, r) for b, r, c in full}
    assert listed(got.full_q_num_blocks, got.full_q_indices) == transposed
    assert listed(got.q_num_blocks, got.q_indices) == {(b, c, r) for b, r, c in partial}
    assert got.seq_lengths == (n, n) and got.BLOCK_SIZE == want.BLOCK_SIZE


def against_masked_sdpa(fn, operand, mask, seed):
    """fn(q, k, v, operand, 0.3) against SDPA with ``mask`` in float64 (grouped heads, a sequence of 300): the
    output and the gradients of q, k and v; returns them."""
    gen = torch.Generator().manual_seed(seed)
    b, h, kvh, n, d = 2, 4, 2, 300, 16
    q, k, v, dy = (torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64) for heads in (h, kvh, kvh, h))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*ins, attn_mask=mask, scale=0.3, enable_gqa=True)
    want_grads = torch.autograd.grad(want, ins, dy)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    got = fn(*ins, operand, 0.3)
    got_grads = torch.autograd.grad(got, ins, dy)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    return got, got_grads


@pytest.mark.parametrize("fn", [attention.causal_padded_attention, attention.causal_prefix_padded_attention])
@pytest.mark.parametrize("kind", ["ones", "right", "left", "random"])
def test_causal_padded_attention_is_masked_sdpa(kind, fn):
    n = 300
    valid = key_valid(kind, 2, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril() & valid[:, None, None, :]
    got, got_grads = against_masked_sdpa(fn, valid, mask, seed=1)
    if kind == "left":
        assert got[0, :, : n // 2].abs().max() == 0 and got_grads[0][0, :, : n // 2].abs().max() == 0


@pytest.mark.parametrize("n", [100, 128, 300, 640])
@pytest.mark.parametrize("kind", ["ones", "right", "left", "random"])
def test_block_mask_past_the_prefix_lists_the_tiles_torch_lists(kind, n):
    """With the valid prefix of each row: the tiles of the queries past it only, as torch lists them on the dense
    mask function; every tile listed full is visible whole."""
    valid = key_valid(kind, 2, n)
    valid[1, : n // 2] = True  # the second row's prefix in the middle of a tile
    prefix = valid.int().cumprod(-1).sum(-1, dtype=torch.int32)
    got = attention.block_mask(valid, n, prefix=prefix)
    want = create_block_mask(lambda b, h, q, kv: (kv <= q) & valid[b, kv] & (q >= prefix[b]), 2, 1, n, n,
                             device="cpu")
    full = listed(got.full_kv_num_blocks, got.full_kv_indices)
    partial = listed(got.kv_num_blocks, got.kv_indices)
    assert not full & partial
    assert full | partial == listed(want.kv_num_blocks, want.kv_indices) | listed(want.full_kv_num_blocks,
                                                                                 want.full_kv_indices)
    dense = (torch.ones(n, n, dtype=torch.bool).tril() & valid[:, None, :]
             & (torch.arange(n)[None, :, None] >= prefix[:, None, None]))
    tile = attention.BLOCK
    for b, row, col in full:
        assert dense[b, row * tile:(row + 1) * tile, col * tile:(col + 1) * tile].all()
    if kind == "ones":
        assert not full and not partial  # nothing is left to FlexAttention


def documents(kind, batch, n):
    """Document ids along each row (never decreasing): one document, or sequences packed back to back."""
    doc = torch.zeros(batch, n, dtype=torch.long)
    if kind == "packed":
        doc[0] = (torch.arange(n) >= 100).long() + (torch.arange(n) >= 129).long() + (torch.arange(n) >= 257).long()
        doc[1] = torch.arange(n) // 37  # many short documents, none aligned with the tiles
    return doc


@pytest.mark.parametrize("n", [1, 100, 300, 640])
@pytest.mark.parametrize("kind", ["one", "packed"])
def test_document_block_mask_lists_the_tiles_torch_lists(kind, n):
    doc = documents(kind, 2, n)
    got = attention.block_mask(None, n, doc)
    want = create_block_mask(lambda b, h, q, kv: (kv <= q) & (doc[b, q] == doc[b, kv]), 2, 1, n, n, device="cpu")
    full = listed(got.full_kv_num_blocks, got.full_kv_indices)
    partial = listed(got.kv_num_blocks, got.kv_indices)
    assert not full & partial
    visible = listed(want.kv_num_blocks, want.kv_indices) | listed(want.full_kv_num_blocks, want.full_kv_indices)
    assert visible <= full | partial  # every tile with a visible pair is listed
    assert listed(want.full_kv_num_blocks, want.full_kv_indices) <= full
    dense = torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])
    tile = attention.BLOCK
    for b, row, col in full:
        assert dense[b, row * tile:(row + 1) * tile, col * tile:(col + 1) * tile].all()
    assert listed(got.full_q_num_blocks, got.full_q_indices) == {(b, c, r) for b, r, c in full}


@pytest.mark.parametrize("kind", ["one", "packed"])
def test_causal_document_attention_is_masked_sdpa(kind):
    n = 300
    doc = documents(kind, 2, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril() & (doc[:, None, :, None] == doc[:, None, None, :])
    against_masked_sdpa(attention.causal_document_attention, doc, mask, seed=2)
