"""Causal attention over padded keys, as one FlexAttention call.

``causal_padded_attention(q, k, v, key_valid, scale)`` computes exactly what

    mask = ones(L, L, dtype=bool).tril() & key_valid[:, None, None, :]
    scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

computes, without building the [B, 1, L, L] mask: a block mask of 128 x 128 tiles is derived from
``key_valid`` on the device (no host sync), and FlexAttention's fused kernel skips the tiles that are
above the diagonal or hold only padding, and reads the mask element-wise only on the diagonal tiles and
the tiles that hold some padding. A query row with no valid key at all (left padding) comes out as zeros
with zero gradients, as SDPA's.

This module knows nothing of FX: ``patterns/causal_mask.py`` proves that a graph's mask is of this form
and calls this function; AOTAutograd traces it into the graph as torch's own ``flex_attention`` operator,
which Inductor compiles into its Triton attention kernels, forward and backward.
"""

from __future__ import annotations

import inspect

import torch

BLOCK = 128  # FlexAttention's default tile, query and key


def _keep_score(score, b, h, q, kv):
    return score


def _causal_and_valid(b, h, q, kv, key_valid):
    return (kv <= q) & key_valid[b, kv]


def block_mask(key_valid: torch.Tensor, length: int):
    """The block mask of ``causal AND key_valid[b, kv]`` for ``length`` queries and keys, per batch row
    (one head row: the mask does not depend on the head)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch = key_valid.shape[0]
    blocks = -(-length // BLOCK)
    pad = blocks * BLOCK - length
    valid = torch.nn.functional.pad(key_valid, (0, pad), value=False)
    per_block = valid.reshape(batch, blocks, BLOCK).sum(-1)  # valid keys in each key tile
    qb = torch.arange(blocks, device=key_valid.device)[:, None]
    kb = torch.arange(blocks, device=key_valid.device)[None, :]
    below = kb < qb  # every key of the tile precedes every query of the query tile
    reached = kb <= qb  # some key of the tile precedes some query of the query tile
    full = below[None] & (per_block[:, None, :] == BLOCK)
    partial = reached[None] & (per_block[:, None, :] > 0) & ~full

    def listed(tiles):
        tiles = tiles[:, None].to(torch.int32)  # [B, 1, query tiles, key tiles]
        count = tiles.sum(-1).to(torch.int32)
        order = torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32)
        return count, order

    kv_count, kv_order = listed(partial)
    full_count, full_order = listed(full)
    return BlockMask.from_kv_blocks(kv_count, kv_order, full_count, full_order, BLOCK_SIZE=BLOCK,
                                    mask_mod=_causal_and_valid, seq_lengths=(length, length))


def _kernel_options(q, k, v) -> dict:
    """FlexAttention's own defaults for these inputs (whether it must keep the logsumexp for a backward)."""
    from torch.nn.attention import flex_attention as fa

    given = {"query": q, "key": k, "value": v, "return_lse": False, "kernel_options": None, "return_aux": None}
    names = inspect.signature(fa._apply_kernel_options).parameters
    return fa._apply_kernel_options(**{n: given[n] for n in names if n in given})


def causal_padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, L, D] over ``k``, ``v`` [B, Hkv, L, D] (Hq a multiple of Hkv: query head h
    reads key / value head h // (Hq // Hkv)), causal and restricted to the keys where ``key_valid`` [B or 1, L]
    (bool) is True."""
    from torch._higher_order_ops.flex_attention import flex_attention

    length = q.shape[-2]
    key_valid = key_valid.expand(q.shape[0], length)
    mask = block_mask(key_valid, length)
    # the mask function may be evaluated up to the last tile's end: False past the keys
    padded = torch.nn.functional.pad(key_valid, (0, -length % BLOCK), value=False)
    out = flex_attention(q, k, v, _keep_score, mask.as_tuple(), scale, _kernel_options(q, k, v), (), (padded,))
    return out[0]

