"""A materialised plain causal mask handed to SDPA -> ``is_causal=True``.

Under torch.compile, transformers cannot prove that a batch has no padding and no packed
sequences (its checks are data-dependent), so instead of eager's
``sdpa(q, k, v, attn_mask=None, is_causal=True)`` the graph builds an [B, 1, L, S] boolean mask
from ``arange``s (through ``position_ids``) and calls ``sdpa(q, k, v, attn_mask=mask)``. The
attention kernels then run every block of the square and read the mask: on the H200 the cuDNN
forward + backward of 6 Qwen3-30B-A3B layers at 8192 tokens took 75 ms compiled vs 20 ms eager
(bench/results/train_step_ckpt_off_2026-11-30.md).

Proof, not probing: a mask whose computation reads no graph input (no placeholder, no
parameter) and has static shapes is a constant; it is evaluated once here, and the rewrite
happens only when it equals ``ones(L, S).tril()`` broadcast over batch and heads with L == S,
which is exactly what ``is_causal=True`` means. Anything else (a user attention_mask, sliding
windows, packed sequences, symbolic sizes) is left as it is, with the reason in the report.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph import is_op, meta_value

PATTERN = "causal_sdpa_mask"
SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]  # graph order


def _constant_value(mask: fx.Node, outer: dict):
    """(value, None) when ``mask`` is a constant of the graph, else (None, why not).

    ``outer`` maps a HOP body's placeholders to the values the enclosing graph passes in
    (activation checkpointing builds the mask outside the checkpointed layer): those count
    as constant when their outer node is.
    """
    nodes = _ancestors(mask)
    inputs = []
    for n in nodes:
        if n.op == "placeholder" and n in outer:
            inputs.append(n)
            continue
        if n.op in ("placeholder", "get_attr"):
            return None, f"the mask reads graph input {n.name!r} (a user attention_mask or cache): not provably causal"
        if n.op == "call_module":
            return None, f"the mask calls module {n.target!r}"
        value = meta_value(n)
        if isinstance(value, torch.Tensor) and any(not isinstance(s, int) for s in value.shape):
            return None, f"{n.name} has symbolic sizes {tuple(value.shape)}: the mask is not one constant"
        if is_op(n, "rand", "randn", "randint", "bernoulli", "dropout", "normal", "uniform"):
            return None, f"{n.name} is random"
    args = []
    for n in inputs:
        value, reason = _constant_value(outer[n], outer)
        if reason is not None:
            return None, f"{reason} (outside the body, as {n.name!r})"
        args.append(value)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = sub.placeholder(n.name) if n in inputs else sub.node_copy(n, lambda x: env[x])
    sub.output(env[mask])
    try:
        with torch.no_grad():
            return fx.GraphModule(torch.nn.Module(), sub)(*args), None
    except Exception as e:  # evaluation failed: leave the call alone
        return None, f"evaluating the mask failed: {type(e).__name__}: {e}"


def _why_not_causal(mask, q, k) -> str | None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return f"the mask is {getattr(mask, 'dtype', type(mask))}, not bool"
    L, S = q.shape[-2], k.shape[-2]
    if L != S:
        return f"query length {L} != key length {S}"
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (L, S) or mask.shape[1] != 1:
        return f"mask shape {tuple(mask.shape)} is not [B, 1, {L}, {S}]"
    causal = torch.ones(L, S, dtype=torch.bool, device=mask.device).tril()
    if not torch.equal(mask, causal.expand_as(mask)):
        return "the mask is not the plain causal mask (padding, sliding window or packed sequences)"
    return None


def rewrite_graph(graph: fx.Graph, report, where: str, outer: dict | None = None) -> bool:
    """Rewrite every provably plain-causal SDPA mask in ``graph``; returns whether anything changed.

    ``outer``: body placeholder -> the enclosing graph's node for it (``RealValues.alias``).
    """
    changed = False
    cache: dict[fx.Node, tuple] = {}
    dropped: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if not isinstance(mask, fx.Node):
            continue
        if len(node.args) > 3 or node.kwargs.get("is_causal", False):
            report.reject(PATTERN, "attn_mask passed positionally or with is_causal=True", where, node)
            continue
        q, k = (meta_value(a) for a in node.args[:2])
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
            report.reject(PATTERN, "query or key has no tensor metadata", where, node)
            continue
        if mask not in cache:
            cache[mask] = _constant_value(mask, outer or {})
        value, reason = cache[mask]
        if reason is None:
            reason = _why_not_causal(value, q, k)
        if reason is not None:
            report.reject(PATTERN, reason, where, node)
            continue
        node.update_kwarg("attn_mask", None)
        node.update_kwarg("is_causal", True)
        dropped.append(mask)
        report.rewrite(PATTERN, where, node, {"query_length": q.shape[-2], "mask_shape": list(value.shape)})
        changed = True
    # Erase the mask computations nobody reads any more, and nothing else: a graph-wide dead-code pass
    # would also drop unused results of in-place ops elsewhere (their mutation is the point).
    for mask in dropped:
        for n in reversed(_ancestors(mask)):
            if not n.users and n.op in ("call_function", "call_method") and not _mutates(n):
                graph.erase_node(n)
    return changed


def _mutates(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    schema = getattr(node.target, "_schema", None)
    return name.endswith("_") or bool(schema is not None and schema.is_mutable)
