"""Causal attention over padded keys, or within packed sequences, as one FlexAttention call.

``causal_padded_attention(q, k, v, key_valid, scale)`` computes exactly what

    mask = ones(L, L, dtype=bool).tril() & key_valid[:, None, None, :]
    scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

computes, without building the [B, 1, L, L] mask: a block mask of 128 x 128 tiles is derived from
``key_valid`` on the device (no host sync), and FlexAttention's fused kernel skips the tiles that are
above the diagonal or hold only padding, and reads the mask element-wise only on the diagonal tiles and
the tiles that hold some padding. A query row with no valid key at all (left padding) comes out as zeros
with zero gradients, as SDPA's.

``causal_prefix_padded_attention`` computes what ``causal_padded_attention`` does in two kernels (flash attention
for the queries before their row's first padded key, FlexAttention for the rest); the rewrite calls it unless
``config.flash_prefix`` is off.

``causal_document_attention(q, k, v, document, scale)`` does the same for sequences packed into one row
(document ids that never decrease along it): query q reads key kv <= q of its own document.

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


def _causal_valid_past_prefix(b, h, q, kv, key_valid, prefix):
    return (kv <= q) & key_valid[b, kv] & (q >= prefix[b])


def _causal_in_document(b, h, q, kv, document):
    return (kv <= q) & (document[b, q] == document[b, kv])


def _listed(tiles):
    """(count, indices) of the tiles marked in each [batch, query tile] row, as BlockMask lists them."""
    tiles = tiles[:, None].to(torch.int32)  # [B, 1, query tiles, key tiles]
    count = tiles.sum(-1).to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order


def block_mask(key_valid: torch.Tensor | None, length: int, document: torch.Tensor | None = None,
               prefix: torch.Tensor | None = None):
    """The block mask of ``causal AND key_valid[b, kv]`` (``document`` None), or of ``causal AND document[b, q] ==
    document[b, kv]`` (``key_valid`` None; ``document`` [B, length], non-decreasing along each row: packed
    sequences), for ``length`` queries and keys, per batch row (the mask does not depend on the head). With
    ``prefix`` [B] (padding only), the queries before ``prefix[b]`` see nothing: ``AND q >= prefix[b]``."""
    from torch.nn.attention.flex_attention import BlockMask

    ref = key_valid if key_valid is not None else document
    batch, dev = ref.shape[0], ref.device
    blocks = -(-length // BLOCK)
    pad = blocks * BLOCK - length
    qb = torch.arange(blocks, device=dev)[:, None]
    kb = torch.arange(blocks, device=dev)[None, :]
    below = (kb < qb)[None]  # every key of the tile precedes every query of the query tile
    reached = (kb <= qb)[None]  # some key of the tile precedes some query of the query tile
    if document is None:
        valid = torch.nn.functional.pad(key_valid, (0, pad), value=False)
        per_block = valid.reshape(batch, blocks, BLOCK).sum(-1)[:, None, :]  # valid keys in each key tile
        full = below & (per_block == BLOCK)
        partial = reached & (per_block > 0)
        mask_mod = _causal_and_valid
        if prefix is not None:  # the query tiles with some / every query at or past the prefix
            first = qb[None] * BLOCK
            full = full & (first >= prefix[:, None, None])
            partial = partial & ((first + BLOCK - 1).clamp(max=length - 1) >= prefix[:, None, None])
            mask_mod = _causal_valid_past_prefix
        partial = partial & ~full
    else:  # rows past the length: a document of their own, after the last
        doc = torch.cat([document, (document[:, -1:] + 1).expand(batch, pad)], dim=1).reshape(batch, blocks, BLOCK)
        first, last = doc[..., 0], doc[..., -1]  # a tile's documents: first..last (the ids never decrease)
        meet = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])
        one = first == last
        same = one[:, :, None] & one[:, None, :] & (first[:, :, None] == first[:, None, :])
        full = below & same
        partial = reached & meet & ~full
        mask_mod = _causal_in_document
    kv_count, kv_order = _listed(partial)
    full_count, full_order = _listed(full)
    return BlockMask.from_kv_blocks(kv_count, kv_order, full_count, full_order, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


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


def causal_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """As ``causal_padded_attention``, causal within documents instead: query q reads key kv <= q where
    ``document[b, q] == document[b, kv]`` (``document`` [B or 1, L] integer ids, non-decreasing along each row:
    the sequences packed into a row)."""
    from torch._higher_order_ops.flex_attention import flex_attention

    length = q.shape[-2]
    document = document.expand(q.shape[0], length)
    mask = block_mask(None, length, document)
    tail = -length % BLOCK  # evaluated up to the last tile's end: a document of its own there
    padded = torch.cat([document, (document[:, -1:] + 1).expand(q.shape[0], tail)], dim=1)
    out = flex_attention(q, k, v, _keep_score, mask.as_tuple(), scale, _kernel_options(q, k, v), (), (padded,))
    return out[0]


def causal_prefix_padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                                   scale: float) -> torch.Tensor:
    """``causal_padded_attention`` in two kernels: a query before the first padded key of its row (a tokenizer's
    all-ones mask: every query; right padding: every real token) sees exactly the causal keys, so those rows come
    from SDPA with ``is_causal=True`` (flash attention on a GPU), and FlexAttention computes only the rows past
    that prefix, the rest of its tiles skipped; a ``where`` keeps each row from its kernel. The prefix is counted
    on the device: no host sync. Under left padding the prefix is empty and the SDPA call is wasted."""
    from torch._higher_order_ops.flex_attention import flex_attention

    length = q.shape[-2]
    key_valid = key_valid.expand(q.shape[0], length)
    prefix = key_valid.to(torch.int32).cumprod(-1).sum(-1, dtype=torch.int32)  # [B] keys valid from the first
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                              enable_gqa=q.shape[1] != k.shape[1])
    mask = block_mask(key_valid, length, prefix=prefix)
    padded = torch.nn.functional.pad(key_valid, (0, -length % BLOCK), value=False)
    rest = flex_attention(q, k, v, _keep_score, mask.as_tuple(), scale, _kernel_options(q, k, v), (),
                          (padded, prefix))[0]
    in_prefix = torch.arange(length, device=q.device) < prefix[:, None]  # [B, L]
    return torch.where(in_prefix[:, None, :, None], causal, rest)
