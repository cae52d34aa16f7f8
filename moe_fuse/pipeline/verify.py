"""Prove a candidate before rewriting it: run the original region and the fused op
on the same fresh random probes and compare outputs and gradients.

Probes have the region's real shapes and dtypes; parameters are the real ones
when the backend can see them (top-level graph inputs, or HOP-body inputs that
lead to them), random otherwise. An experts region whose every size-bearing
literal is its token count T or T*k is proven on ``config.verify_tokens`` tokens
instead (the same kernel path forced), so that proving a 235B-sized layer takes
a fraction of its step's memory. Any disagreement or error leaves the region
untouched, with the reason recorded.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from .. import config, dispatch
from .candidate import Candidate
from .graph import concrete, meta_value, region_graph_module

# Relative-norm tolerances: far above rounding noise of two correct
# implementations in that dtype, far below any semantic difference we probe for.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


CHUNK = 1 << 20  # elements compared in float64 at a time


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64, inf where ``got`` is not finite. A few rows at a time: a weight
    gradient made float64 whole would take four times its bf16 size, three times over (tens of GB at 235B)."""
    got, want = got.detach(), want.detach()
    if got.dim() == 0:
        got, want = got.reshape(1), want.reshape(1)
    rows = max(1, CHUNK // max(1, want[0].numel()))
    dev = got.device  # ``want`` may wait in host memory (_park): each chunk of it comes to ``got``'s device
    diff = torch.zeros((), dtype=torch.float64, device=dev)
    norm = torch.zeros((), dtype=torch.float64, device=dev)
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    for g, w in zip(got.split(rows), want.split(rows)):
        g, w = g.double(), w.to(g.device, torch.float64)
        bad |= ~torch.isfinite(g).all()
        diff += (g - w).square().sum()
        norm += w.square().sum()
    if bad.item():
        return float("inf")
    denom = norm.sqrt().item()
    return diff.sqrt().item() / (denom if denom > 0 else 1.0)


def _ints(value):
    """The int literals in a node's args / kwargs (bools are not sizes)."""
    found = []
    map_aggregate(value, lambda v: found.append(v) if isinstance(v, int) and not isinstance(v, bool) else None)
    return found


def token_sizes(cand: Candidate) -> tuple[dict[int, int] | None, str | None]:
    """({T: T', T*k: T'*k}, note) when the experts region can be proven on T' = ``config.verify_tokens`` of its T
    tokens, else (None, why not, or None where there is nothing to shrink).

    The region is re-run with every literal and size equal to T or T*k replaced. Where the hidden size H is one of
    them (a 235B layer at T=4096), no literal tells which it stands for, and H scales with the tokens: the block
    means the same at any H, and the probes' weights are then random ones of the smaller size. That is sound
    only when no other size of the block takes those values and no other literal larger than T' (an ``S - 1``, a
    slice end) could change its meaning at the smaller size; anything else is proven at the real size."""
    limit = config.verify_tokens
    shapes = {}
    for node, kind in zip(cand.region.inputs, cand.input_kinds):
        shapes.setdefault(kind, []).append(tuple(concrete(d) for d in meta_value(node).shape))
    if not limit or "expert_ids" not in shapes or len(shapes.get("hidden", ())) != 1:
        return None, None
    (hidden,), (ids,) = shapes["hidden"], shapes["expert_ids"][:1]
    if len(hidden) != 2 or len(ids) != 2 or ids[0] != hidden[0]:
        return None, None
    (T, H), k = hidden, ids[1]
    if T <= limit:
        return None, None
    sizes = {T: limit, T * k: limit * k}
    others = {k}
    for kind, found in shapes.items():
        for shape in found:
            others.update(shape[1:] if kind in ("hidden", "expert_ids", "routing_weights") else shape)
    for node in cand.region.free:
        value = meta_value(node)
        if isinstance(value, torch.Tensor):
            others.update(concrete(d) for d in value.shape)
    others -= set(sizes) & {H}  # H scales with the tokens
    clash = sorted(v for v in {T, T * k, limit, limit * k} if v in others)
    if clash:
        return None, f"proven at the real size: the token count's sizes {clash} are also other sizes of the block"
    literals = [(v, node.name) for node in cand.region.nodes for v in _ints((node.args, node.kwargs))]
    literals += [(v, "the fused op's arguments") for v in _ints([a for a in cand.op_args if not isinstance(a, fx.Node)])]
    for v, where in literals:
        if v not in sizes and abs(v) > limit and v not in others:
            return None, f"proven at the real size: literal {v} at {where} is not a size the block scales by"
    note = f"proven on {limit} of its {T} tokens (verify_tokens)"
    if H in sizes:
        note += f", the hidden size {H} as {sizes[H]} with them"
    return sizes, note


def _resized(value, sizes: dict[int, int] | None):
    if not sizes:
        return value
    return map_aggregate(value, lambda v: sizes.get(v, v) if isinstance(v, int) and not isinstance(v, bool) else v)


def _concrete_value(node, sizes=None):
    value = meta_value(node)
    if isinstance(value, torch.Tensor):  # read only for its shape and dtype (zeros_like's argument)
        shape = _resized([concrete(s) for s in value.shape], sizes)
        return torch.zeros(shape, dtype=value.dtype, device=value.device)
    if isinstance(value, (tuple, list)):
        return _resized(type(value)(concrete(v) for v in value), sizes)
    return _resized(concrete(value), sizes)


def _region_module(cand: Candidate, sizes: dict[int, int] | None) -> torch.fx.GraphModule:
    module = region_graph_module(cand.region)
    if sizes:
        for node in module.graph.nodes:
            node.args, node.kwargs = _resized(node.args, sizes), _resized(node.kwargs, sizes)
        module.recompile()
    return module


def make_probes(cand: Candidate, resolve, generator: torch.Generator, sizes=None) -> list[torch.Tensor]:
    spec = cand.spec
    probes = []
    for node, kind in zip(cand.region.inputs, cand.input_kinds):
        fake = meta_value(node)
        shape = _resized(tuple(concrete(s) for s in fake.shape), sizes)
        dev, dtype = fake.device, fake.dtype

        def rand(*size, dtype=torch.float32):
            return torch.rand(size, generator=generator).to(device=dev, dtype=dtype)

        if kind == "hidden":
            probe = torch.randn(shape, generator=generator).to(device=dev, dtype=dtype)
        elif kind == "param":
            real = resolve(node)
            if real is not None and tuple(real.shape) == shape:
                probe = real.detach()  # read only: both sides get their own leaf over the same storage
            else:
                probe = (torch.randn(shape, generator=generator) * shape[-1] ** -0.5).to(device=dev, dtype=dtype)
        elif kind == "expert_ids":  # [..., k]: k distinct experts per token, as top-k picks them
            *lead, k = shape
            T = math.prod(lead)
            probe = torch.rand(T, spec.num_experts, generator=generator).argsort(dim=-1)[:, :k]
            if spec.expert_parallel_sentinels:  # some rows routed to another rank's experts
                probe[torch.rand(T, k, generator=generator) < 0.2] = spec.num_experts
            probe = probe.reshape(shape).contiguous().to(device=dev, dtype=dtype)
        elif kind == "routing_weights":
            probe = (rand(*shape) + 0.1).to(dtype)
        else:
            raise ValueError(f"unknown probe kind {kind!r}")
        probes.append(probe)
    return probes


def _by_expert(weights, ids):
    """A top-k selection with each row ordered by expert id: equal weights may come in any order."""
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order), ids.gather(-1, order)


def _side(outputs: list, leaves: list, cotangents: list) -> list:
    """The gradients of ``leaves`` for ``cotangents`` on the outputs that have one (None where unused); frees
    the side's graph."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if c is not None]
    if not pairs:
        return []
    floats = [p for p in leaves if p.requires_grad]
    return list(torch.autograd.grad([o for o, _ in pairs], floats, [c for _, c in pairs], allow_unused=True))


def _park(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A GPU gradient of the first side moved to host memory while the second side runs (rel_err brings it
    back a chunk at a time): the GPU holds one side's weight gradients at a time, not both."""
    if grad is None or grad.device.type == "cpu":
        return grad
    return grad.to("cpu")


def verify(cand: Candidate, resolve, seed: int = 0) -> str | None:
    """None when the fused op matches the region on the probes, else why not.

    In an inference graph (``Candidate.differentiated`` False) the outputs alone are compared: no gradient
    is computed, and the op runs the forward that keeps nothing, as it will there.
    An experts region is proven on ``config.verify_tokens`` tokens where ``token_sizes`` allows it (a note on the
    candidate says so), under the kernel path its real size takes; should that run raise, at the real size.
    The original region runs forward and backward first, then the fused op: one side's saved activations are
    alive at a time, and on a GPU the first side's gradients wait in host memory (at the real sizes of a 235B
    layer, the region's activations and weight gradients are several GB each)."""
    sizes, note = token_sizes(cand)
    if sizes:
        rows = max(sizes)  # T * k routed rows: the real size's GEMM path, forced at the smaller one
        forced = 0 if dispatch.ragged(rows) else sizes[rows] + 1
        with config.patch(ragged_min_rows=forced):
            reason = _verify(cand, resolve, seed, sizes)
        if reason is None or not reason.startswith("verification raised"):
            cand.notes.append(note)
            return reason if reason is None else f"{reason} ({note})"
        note = f"proven at the real size: on {min(sizes.values())} tokens {reason}"
    if note:
        cand.notes.append(note)
    return _verify(cand, resolve, seed, None)


def _verify(cand: Candidate, resolve, seed: int, sizes: dict[int, int] | None) -> str | None:
    generator = torch.Generator().manual_seed(seed)
    grads = cand.differentiated()  # else the outputs alone: the op's backward never runs in this graph
    try:
        original = _region_module(cand, sizes)
        free = [_concrete_value(n, sizes) for n in cand.region.free]
        probes = make_probes(cand, resolve, generator, sizes)
        by_node = dict(zip(cand.region.inputs, probes))
        names = [n.name for n in cand.region.outputs]
        with torch.enable_grad():
            # The region never writes into its inputs (collect_region refuses that), so the
            # two sides can share the probes' storage: no copies of large expert weights.
            leaves_a = [p.detach().requires_grad_(grads and p.is_floating_point()) for p in probes]
            want = list(original(*leaves_a, *free))
            if cand.topk_outputs:
                wi, ii = cand.topk_outputs
                want[wi], want[ii] = _by_expert(want[wi], want[ii])
            cotangents = [torch.randn(w.shape, generator=generator).to(w) if w.requires_grad else None for w in want]
            grads_a = [_park(g) for g in _side(want, leaves_a, cotangents)]
            want = [w.detach() for w in want]
            del leaves_a

            leaves_b = [p.detach().requires_grad_(grads and p.is_floating_point()) for p in probes]
            args = [leaves_b[cand.region.inputs.index(a)] if a in by_node else _resized(a, sizes) for a in cand.op_args]
            result = cand.op(*args)
            got = [result if i is None else result[i] for i in cand.output_index]
            if cand.topk_outputs:
                wi, ii = cand.topk_outputs
                if got[wi].shape[-1] > 1 and not (got[wi][..., :-1] >= got[wi][..., 1:]).all():
                    return "fused top-k weights are not in descending order"
                got[wi], got[ii] = _by_expert(got[wi], got[ii])

            # A region computes in its least precise float dtype (bf16 experts with fp32
            # routing weights round like bf16 throughout; fp32 in and out with bf16 GEMMs
            # inside, as TorchTitan casts): judge every value by that.
            inner = [meta_value(n) for n in cand.region.nodes]
            dtypes = {t.dtype for t in [*probes, *want, *inner] if isinstance(t, torch.Tensor)}
            tol = max(TOLERANCE[d] for d in dtypes if d in TOLERANCE)
            for name, g, w, c in zip(names, got, want, cotangents):
                if g.shape != w.shape or g.dtype != w.dtype:
                    return f"output {name}: fused {g.dtype}{list(g.shape)} vs original {w.dtype}{list(w.shape)}"
                if not w.is_floating_point():
                    if not torch.equal(g, w):
                        return f"output {name} differs ({(g != w).sum().item()} of {w.numel()} elements)"
                    continue
                err = rel_err(g, w)
                if err > tol:
                    return f"output {name} differs: relative error {err:.3g} > {tol:g}"
                if (c is not None) != g.requires_grad:
                    return f"output {name}: only one side has a gradient"

            grads_b = _side(got, leaves_b, cotangents)
            inputs = [n.name for n, p in zip(cand.region.inputs, probes) if p.is_floating_point()]
            for name, ga, gb in zip(inputs, grads_a, grads_b):
                if ga is None or gb is None:
                    if (ga is None) != (gb is None):
                        return f"gradient of {name}: only one side has one"
                    continue
                err = rel_err(gb, ga)
                if err > 2 * tol:
                    return f"gradient of {name} differs: relative error {err:.3g} > {2 * tol:g}"
    except Exception as e:  # a probe that crashes either side proves nothing: leave it alone
        return f"verification raised {type(e).__name__}: {e}"
    return None
