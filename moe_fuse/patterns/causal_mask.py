"""A materialised plain causal mask handed to SDPA -> ``is_causal=True``.

Under torch.compile, transformers cannot prove that a batch has no padding and no packed
sequences (its checks are data-dependent), so instead of eager's
``sdpa(q, k, v, attn_mask=None, is_causal=True)`` the graph builds an [B, 1, L, S] boolean mask
from ``arange``s (through ``position_ids``) and calls ``sdpa(q, k, v, attn_mask=mask)``. The
attention kernels then run every block of the square and read the mask: on the H200 the cuDNN
forward + backward of 6 Qwen3-30B-A3B layers at 8192 tokens took 75 ms compiled vs 20 ms eager
(docs/performance.md).

Proof, not probing: a mask whose computation reads no graph input (no placeholder, no
parameter) and has static shapes is a constant; it is evaluated once here, and the rewrite
happens only when it equals ``ones(L, S).tril()`` broadcast over batch and heads with L == S,
which is exactly what ``is_causal=True`` means.

A mask that reads a graph input is proved another way, on a GPU (``config.causal_sdpa_flex``): causal AND a key
padding (a tokenizer's attention_mask) becomes ``attention.causal_padded_attention``, and transformers' mask of
sequences packed into rows (position_ids restarting) ``attention.causal_document_attention``, each one
FlexAttention call (``_why_not_padded``, ``_packed_documents``). Anything else (sliding windows, other masks,
symbolic sizes) is left as it is, with the reason in the report.

With a mask, transformers also repeats each key / value head for its group of query heads
(``repeat_kv``) before SDPA: a copy of K and V at the query's head count, kept for the backward,
whose gradient is then summed back. Once the mask is gone, a call whose key and value are such
repeats reads the unrepeated ones with ``enable_gqa=True`` instead, which is eager's own call for
an unmasked batch: the same attention (query head h reads key / value head h // n_rep in both),
and the fused kernel (flash or cuDNN attention on the GPU) takes the groups itself. On GLM-4.5-Air's 96 query and 8 key / value heads
the repeats are 12 times K and V.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import attention, config, dispatch
from ..pipeline.candidate import GraphRewrite
from ..pipeline.graph import is_op, meta_value

NAME = "causal_sdpa_mask"
PADDED = "causal_padded_sdpa_mask"
PACKED = "causal_packed_sdpa_mask"
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


_AND = (operator.and_, torch.logical_and, torch.bitwise_and, torch.Tensor.__and__, torch.Tensor.logical_and,
         torch.Tensor.bitwise_and)
_AND_METHODS = ("__and__", "logical_and", "bitwise_and", "__rand__")


def _is_bool(node) -> bool:
    value = meta_value(node)
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _and_factors(node: fx.Node, outer: dict) -> list[fx.Node]:
    """The operands of the tree of boolean ANDs that computes ``node``, through broadcasts (``expand``), device
    moves and copies of a bool tensor, and out of a HOP body (``outer``). A node that is none of those is one
    factor."""
    if node.op == "placeholder" and node in outer:
        return _and_factors(outer[node], outer)
    if not _is_bool(node):
        return [node]
    if node.op == "call_function" and node.target in _AND or node.op == "call_method" and node.target in _AND_METHODS:
        operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(operands) == 2 and not node.kwargs and all(_is_bool(a) for a in operands):
            return _and_factors(operands[0], outer) + _and_factors(operands[1], outer)
        return [node]
    if is_op(node, "expand", "contiguous", "clone") or is_op(node, "to") and not [
            a for a in list(node.args[1:]) + list(node.kwargs.values())
            if not isinstance(a, torch.device) and a != torch.bool and a is not False]:
        source = node.args[0] if node.args else None
        if isinstance(source, fx.Node) and _is_bool(source):
            return _and_factors(source, outer)
    return [node]


def _why_not_padded(mask: fx.Node, q, k, outer: dict) -> str | None:
    """None when ``mask`` is provably ``causal AND key_padding``: mask[b, 0, i, j] = (j <= i) & P[b, j].

    The proof: the mask is an AND of factors (``_and_factors``); those that read no graph input are constants,
    evaluated here, and their AND must be the plain causal mask; every other factor has size 1 along the head and
    the query axes, so it cannot depend on anything but the batch row and the key position, whatever computes
    it (a tokenizer's attention_mask, all ones or padded on either side). Then row L - 1 of the mask, where the
    causal part is all True, is the key padding itself.
    """
    value = meta_value(mask)
    L, S = q.shape[-2], k.shape[-2]
    if L != S:
        return f"query length {L} != key length {S}"
    if not _is_bool(mask) or value.dim() != 4 or value.shape[1] != 1 or tuple(value.shape[-2:]) != (L, S):
        return f"mask {getattr(value, 'dtype', None)} {tuple(getattr(value, 'shape', ()))} is not bool [B, 1, {L}, {S}]"
    constants, padding = [], []
    for factor in _and_factors(mask, outer):
        known, why = _constant_value(factor, outer)
        if why is None:
            constants.append(known)
            continue
        shape = getattr(meta_value(factor), "shape", None)
        if shape is None or len(shape) != 4 or shape[1] != 1 or shape[2] != 1 or shape[3] != S:
            return f"{factor.name} {tuple(shape or ())} varies along the query axis: not a key padding"
        padding.append(factor)
    if not constants:
        return "no constant causal part in the mask"
    causal = constants[0]
    for more in constants[1:]:
        causal = causal & more
    if not isinstance(causal, torch.Tensor) or causal.dtype != torch.bool or causal.dim() > 4:
        return "the mask's constant part is not a bool tensor"
    causal = causal.reshape((1,) * (4 - causal.dim()) + tuple(causal.shape))
    if causal.shape[1] != 1 or tuple(causal.shape[-2:]) != (L, S):
        return f"the mask's constant part {tuple(causal.shape)} is not [B, 1, {L}, {S}]"
    tril = torch.ones(L, S, dtype=torch.bool, device=causal.device).tril()
    if not torch.equal(causal, tril.expand_as(causal)):
        return "the mask's constant part is not the plain causal mask (sliding window or packed sequences)"
    return None


def _rewrite_flex(node: fx.Node, q: torch.Tensor, k: torch.Tensor, fn, operand) -> dict | str:
    """Replace the masked SDPA call by ``fn(q, k, v, operand(graph), scale)`` (``attention``'s FlexAttention
    functions; ``operand`` inserts the node of the key padding or the document ids); returns the report's detail,
    or why the call stays."""
    why = dispatch.padded_attention_applies(q, k)
    if why is not None:
        return why
    dropout = node.kwargs.get("dropout_p", 0.0)
    if dropout != 0.0:
        return f"attention dropout {dropout}"
    scale = node.kwargs.get("scale")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not isinstance(scale, (int, float)):
        return f"the scale {scale!r} is not a number"
    graph = node.graph
    key, value = node.args[1], node.args[2]
    info = {"query_length": q.shape[-2],
            "kernel": "sdpa_causal_prefix+flex_attention" if fn is attention.causal_prefix_padded_attention
            else "flex_attention"}
    if config.causal_sdpa_grouped_heads and "enable_gqa" not in node.kwargs and key is not value:
        src = [_repeat_kv_source(key), _repeat_kv_source(value)]
        if None not in src and src[0][1] == src[1][1]:
            key, value = src[0][0], src[1][0]
            info["gqa_group"] = src[0][1]
    with graph.inserting_before(node):
        fused = graph.call_function(fn, (node.args[0], key, value, operand(graph), float(scale)))
    fused.meta = dict(node.meta)
    node.replace_all_uses_with(fused)
    return info


def _documents_in_body(mask: fx.Node):
    """Document ids of a proved packed-sequence mask that a HOP body reads whole (it was built outside): a
    document starts at query q where q cannot see key q - 1, so the count of starts up to each position,
    ``pad(cumsum(~mask[:, 0].diagonal(-1)), (1, 0))``, is equal at two positions exactly where the documents are."""
    def operand(graph):
        call = graph.call_function
        below = call(torch.diagonal, (mask,), {"offset": -1, "dim1": -2, "dim2": -1})  # [B, 1, L - 1]
        starts = call(torch.logical_not, (call(operator.getitem, (below, (slice(None), 0))),))
        return call(torch.nn.functional.pad, (call(torch.cumsum, (starts, -1)), (1, 0)))
    return operand


def _last_row(mask: fx.Node):
    """The key padding of a proved causal AND padding mask: its last query row."""
    return lambda graph: graph.call_function(operator.getitem, (mask, (slice(None), 0, -1, slice(None))))


_LE = (operator.le, torch.le, torch.Tensor.le, torch.Tensor.__le__)
_GE = (operator.ge, torch.ge, torch.Tensor.ge, torch.Tensor.__ge__)
_EQ = (operator.eq, torch.eq, torch.Tensor.eq, torch.Tensor.__eq__)


def _is(node, functions, methods) -> bool:
    return isinstance(node, fx.Node) and (node.op == "call_function" and node.target in functions
                                          or node.op == "call_method" and node.target in methods)


def _unexpanded(node):
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target == "expand":
        node = node.args[0]
    return node


def _indexed(node, index: dict) -> tuple[fx.Node, str] | None:
    """(X, axis) when ``node`` is ``X[batch_indices, axis_indices]`` with the constant index tensors of
    ``index`` ({node: "batch" | "query" | "key"}), axis "query" or "key"; else None."""
    if not (_is(node, (operator.getitem,), ()) and isinstance(node.args[1], tuple) and len(node.args[1]) == 2):
        return None
    b, i = (index.get(a) if isinstance(a, fx.Node) else None for a in node.args[1])
    if b != "batch" or i not in ("query", "key"):
        return None
    return node.args[0], i


def _index_kinds(nodes, batch: int, length: int) -> dict:
    """{node: "batch" | "query" | "key"} for the constant index tensors among ``nodes``: arange(B) over the first
    of four axes, arange(L) over the third (queries) or the fourth (keys)."""
    want = {"batch": torch.arange(batch).view(batch, 1, 1, 1), "query": torch.arange(length).view(1, 1, length, 1),
            "key": torch.arange(length).view(1, 1, 1, length)}
    kinds = {}
    for n in nodes:
        value, why = _constant_value(n, {})
        if why is not None or not isinstance(value, torch.Tensor) or value.is_floating_point():
            continue
        for kind, w in want.items():
            if value.shape == w.shape and torch.equal(value.cpu().long(), w):
                kinds[n] = kind
    return kinds


def _packed_documents(mask: fx.Node, q, k) -> tuple[fx.Node | None, str | None]:
    """(D, None) when ``mask`` is transformers' mask of sequences packed into rows, computed in this graph:
    ``pos[b, kv] <= pos[b, q] AND D[b, q] == D[b, kv]`` (AND constants that are all True or causal) with
    ``D = cumsum(diff(pos, dim=-1) != 1, -1)`` of the same positions ``pos``; else (None, why not).

    Then the mask is ``kv <= q AND D[b, q] == D[b, kv]``: D never decreases, so between two positions of one
    document every step of pos is +1 (else D would grow there), and pos[kv] <= pos[q] there exactly when
    kv <= q, whatever value diff prepends."""
    if mask.op == "placeholder":
        return None, "the mask comes from outside this graph"
    L = q.shape[-2]
    factors = _and_factors(mask, {})
    nodes = {a for f in factors for a in f.all_input_nodes for a in [a, *a.all_input_nodes]}
    index = _index_kinds([n for n in nodes if isinstance(n, fx.Node)], meta_value(mask).shape[0], L)
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    order = positions = documents = None
    for factor in factors:
        known, why = _constant_value(factor, {})
        if why is None:
            if not (isinstance(known, torch.Tensor) and known.dtype == torch.bool and known.dim() <= 4 and (
                    bool(known.all()) or torch.equal(known.cpu().expand(*known.shape[:-2], L, L), tril.expand(
                        *known.shape[:-2], L, L)))):
                return None, "a constant factor is neither all True nor causal"
        elif _is(factor, _LE + _GE, ("le", "__le__", "ge", "__ge__")) and order is None:
            a, b = (_indexed(x, index) for x in factor.args[:2])
            small, big = (a, b) if _is(factor, _LE, ("le", "__le__")) else (b, a)
            if small is None or big is None or (small[1], big[1]) != ("key", "query") or small[0] is not big[0]:
                return None, f"{factor.name} is not positions[b, key] <= positions[b, query]"
            order, positions = factor, _unexpanded(small[0])
        elif _is(factor, _EQ, ("eq", "__eq__")) and documents is None:
            a, b = (_indexed(x, index) for x in factor.args[:2])
            if a is None or b is None or {a[1], b[1]} != {"query", "key"} or a[0] is not b[0]:
                return None, f"{factor.name} is not documents[b, query] == documents[b, key]"
            documents = a[0]
        else:
            return None, f"{factor.name} is not part of a packed-sequence mask"
    if order is None or documents is None:
        return None, "no position order and document equality"
    cumsum = documents
    if not (cumsum.op == "call_method" and cumsum.target == "cumsum" and cumsum.args[1:] in ((-1,), (1,))
            and not cumsum.kwargs):
        return None, f"the document ids {cumsum.name} are not a cumsum over the last axis"
    ne = cumsum.args[0]
    if not (_is(ne, (operator.ne, torch.ne), ("ne", "__ne__")) and ne.args[1:] == (1,)):
        return None, "the document ids do not count position steps other than +1"
    diff = ne.args[0]
    if not (_is(diff, (torch.diff,), ("diff",)) and set(diff.kwargs) <= {"prepend", "dim", "n"}
            and diff.kwargs.get("n", 1) == 1 and diff.kwargs.get("dim", -1) in (-1, 1) and len(diff.args) == 1):
        return None, "the document ids are not over diff(positions, dim=-1)"
    if _unexpanded(diff.args[0]) is not positions:
        return None, "the document ids come from other positions than the order"
    pos, ids = meta_value(positions), meta_value(cumsum)
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] != L or pos.is_floating_point():
        return None, f"positions {tuple(getattr(pos, 'shape', ()))} are not [B, {L}] integers"
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[-1] != L:  # diff prepends one value
        return None, f"document ids {tuple(getattr(ids, 'shape', ()))} are not [B, {L}]"
    return cumsum, None


def _flex(node, mask, q, k, outer) -> tuple[str | None, dict | str]:
    """(pattern, detail) of the FlexAttention rewrite of a mask that is causal AND key padding, or packed
    sequences; else (None, why not)."""
    why_padded = _why_not_padded(mask, q, k, outer)
    if why_padded is None:
        return PADDED, _rewrite_flex(node, q, k, dispatch.padded_attention(), _last_row(mask))
    source = outer.get(mask, mask) if mask.op == "placeholder" else mask  # checkpointing builds it outside
    documents, why_packed = _packed_documents(source, q, k) if q.shape[-2] == k.shape[-2] else (None, "")
    value = meta_value(mask)
    if documents is not None and source is not mask and (
            not _is_bool(mask) or value.dim() != 4 or value.shape[1] != 1 or value.shape[-1] != value.shape[-2]):
        documents, why_packed = None, f"the mask {tuple(value.shape)} read in the body is not bool [B, 1, L, L]"
    if documents is not None:
        operand = (lambda graph: documents) if source is mask else _documents_in_body(mask)
        return PACKED, _rewrite_flex(node, q, k, attention.causal_document_attention, operand)
    return None, f"as causal AND key padding: {why_padded}" + (f"; as packed sequences: {why_packed}"
                                                               if why_packed else "")


def _erase_call(node: fx.Node):
    """Erase a replaced SDPA call, and the repeats of its key and value that nothing else reads."""
    graph, repeated = node.graph, node.args[1:3]
    graph.erase_node(node)
    for r in repeated:
        if _repeat_kv_source(r) is None:
            continue
        for n in (r, r.args[0], r.args[0].args[0]):  # reshape <- expand <- x[:, :, None]
            if not n.users:
                graph.erase_node(n)


def _repeat_kv_source(node) -> tuple[fx.Node, int] | None:
    """(x, n_rep) when ``node`` is transformers' ``repeat_kv(x, n_rep)``, n_rep > 1, whose inner steps nothing else
    reads: ``x[:, :, None, :, :].expand(B, KVH, n_rep, S, D).reshape(B, KVH * n_rep, S, D)``; else None."""
    if not is_op(node, "reshape") or not node.args:
        return None
    grown = node.args[0]
    if not is_op(grown, "expand") or len(grown.users) != 1 or not grown.args:
        return None
    spread = grown.args[0]
    if is_op(spread, "getitem") and len(spread.args) == 2:
        full = slice(None)
        if spread.args[1] != (full, full, None, full, full) or len(spread.users) != 1:
            return None
    elif is_op(spread, "unsqueeze") and len(spread.args) == 2:
        if spread.args[1] != 2 or len(spread.users) != 1:
            return None
    else:
        return None
    x = spread.args[0]
    shapes = [getattr(meta_value(n), "shape", None) for n in (x, grown, node)]
    if any(s is None or any(not isinstance(d, int) for d in s) for s in shapes):
        return None
    (xs, gs, out) = (tuple(s) for s in shapes)
    if len(xs) != 4 or len(gs) != 5:
        return None
    B, kvh, S, D = xs
    n_rep = gs[2]
    if gs != (B, kvh, n_rep, S, D) or out != (B, kvh * n_rep, S, D) or n_rep < 2:
        return None
    return x, n_rep


def _fused_with_groups(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether SDPA here runs a fused kernel for a causal call with grouped heads of these kinds, asked of
    torch's own choice on tiny tensors of the same device, dtype and head counts. Its math fallback (no
    flash attention: an fp32 model, an old GPU, a large head) would build the whole attention matrix: there
    the repeated heads stay."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return False
    try:
        tq = torch.zeros(1, q.shape[1], 16, q.shape[-1], dtype=q.dtype, device=q.device, requires_grad=q.requires_grad)
        tk = torch.zeros(1, kv.shape[1], 16, kv.shape[-1], dtype=kv.dtype, device=kv.device)
        return choose(tq, tk, tk, None, 0.0, True, enable_gqa=True) not in (_MATH, _NO_KERNEL)
    except Exception:  # an unknown device or signature: leave the call as it is
        return False


_MATH, _NO_KERNEL = 0, -1  # torch.nn.attention.SDPBackend.MATH / ERROR


def _read_groups(node: fx.Node) -> int | None:
    """After the mask's rewrite: a call whose key and value are repeat_kv's reads them unrepeated, with
    enable_gqa=True (``config.causal_sdpa_grouped_heads``). Returns the group size, or None where the call stays
    as it is."""
    if not config.causal_sdpa_grouped_heads or len(node.args) < 3 or "enable_gqa" in node.kwargs:
        return None
    k, v = node.args[1], node.args[2]
    src = [_repeat_kv_source(k), _repeat_kv_source(v)]
    if None in src or src[0][1] != src[1][1] or k is v:
        return None
    q, kv = meta_value(node.args[0]), meta_value(src[0][0])
    if not (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor)) or not _fused_with_groups(q, kv):
        return None
    node.update_arg(1, src[0][0])
    node.update_arg(2, src[1][0])
    node.update_kwarg("enable_gqa", True)
    for repeated in (k, v):  # reshape <- expand <- x[:, :, None]: read by nothing else now
        chain = [repeated, repeated.args[0], repeated.args[0].args[0]]
        for n in chain:
            if not n.users:
                n.graph.erase_node(n)
    return src[0][1]


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
            report.reject(NAME, "attn_mask passed positionally or with is_causal=True", where, node)
            continue
        q, k = (meta_value(a) for a in node.args[:2])
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
            report.reject(NAME, "query or key has no tensor metadata", where, node)
            continue
        if mask not in cache:
            cache[mask] = _constant_value(mask, outer or {})
        value, reason = cache[mask]
        if reason is None:
            reason = _why_not_causal(value, q, k)
        elif config.causal_sdpa_flex:
            name, done = _flex(node, mask, q, k, outer or {})
            if isinstance(done, dict):
                report.rewrite(name, where, node, done)
                _erase_call(node)
                changed = True
                continue
            reason = f"{reason}; {done}"
        if reason is not None:
            report.reject(NAME, reason, where, node)
            continue
        node.update_kwarg("attn_mask", None)
        node.update_kwarg("is_causal", True)
        dropped.append(mask)
        info = {"query_length": q.shape[-2], "mask_shape": list(value.shape)}
        groups = _read_groups(node)
        if groups is not None:
            info["gqa_group"] = groups
        report.rewrite(NAME, where, node, info)
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


def run(module, report, where: str, values) -> bool:
    """The rewrite of one graph or HOP body, after the patterns (``config.causal_sdpa``)."""
    if not config.causal_sdpa:
        return False
    return rewrite_graph(module.graph, report, where, values.alias)


REWRITE = GraphRewrite(NAME, run)
