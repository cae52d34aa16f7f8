#!/usr/bin/env python3
"""The experts op's kernels one by one, each beside the torch code it replaces: the router, the experts forward
and backward on both kernel paths, and the row-ragged GEMMs against torch._grouped_mm.

    python bench/kernels.py [--shapes 30b,235b] [--tokens 4096,16384] [--rounds 3] [--out DIR]
    python bench/kernels.py --cpu-smoke      # tiny fp32 shapes on the CPU, the Triton kernels interpreted

Balanced routing (T k / E rows per expert), random weights. Per case, every row is timed (bench/common.py), the
rows in turn for --rounds rounds (ms: the median). TFLOP/s count the GEMMs' FLOPs (forward 6 S H I, backward
12 S H I, S = T k); % of the matmul peak measured in the same run. "x torch": the torch row's ms / this row's;
"err": the relative difference to the torch row's output (the worst gradient for the backward); over 2e-2 in bf16
(1e-4 in fp32) the row FAILs and the exit status is 1. Writes kernels_<gpu>.{md,json,png}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the checkout on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from moe_fuse import config  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8), "tiny": (32, 16, 4, 2)}  # H, I, E, k


def make_case(shape, T, dev, dtype, seed=0):
    H, I, E, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    # balanced: token t takes experts t + j E / k (mod E), relabelled and shuffled
    base = (torch.arange(T)[:, None] + torch.arange(k)[None, :] * (E // k)) % E
    ids = torch.randperm(E, generator=gen)[base][torch.randperm(T, generator=gen)]
    scores = torch.rand(T, k, generator=gen) + 0.05
    weights = scores / scores.sum(-1, keepdim=True)
    wgu = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    wd = torch.randn(E, H, I, generator=gen) * I ** -0.5
    w_router = torch.randn(E, H, generator=gen) * H ** -0.5
    dy = torch.randn(T, H, generator=gen)
    cast = lambda t: t.to(dev, dtype)  # noqa: E731
    return cast(x), ids.to(dev), cast(weights), cast(wgu), cast(wd), cast(w_router), cast(dy)


def torch_experts(x, ids, weights, wgu, wd):
    """transformers' grouped_mm experts forward in torch ops: sort, gather, two grouped GEMMs, weighted sum."""
    T, k = ids.shape
    E = wgu.shape[0]
    eid, perm = torch.sort(ids.reshape(-1))
    counts = torch.histc(eid.int() if eid.is_cuda else eid.float(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x[perm // k], wgu.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, wd.transpose(-2, -1), offs=offs) * weights.reshape(-1)[perm, None]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=x.device)
    return out[inv].view(T, k, -1).sum(1).to(x.dtype)


def rows_of_case(shape, T, dev, dtype):
    """[(group, name, fn, flops, the torch row's name or None, config settings while it runs)] of one case."""
    from moe_fuse import dispatch
    from moe_fuse.kernels import route, softmax_topk
    from moe_fuse.kernels.permute import expand_rows
    from moe_fuse.kernels.ragged_gemm import ragged_gemm, tile_map

    H, I, E, k = SHAPES[shape]
    S = T * k
    x, ids, w, wgu, wd, w_router, dy = make_case(shape, T, dev, dtype)
    args = (x, ids, w, wgu, wd)
    logits = x @ w_router.t()

    def torch_router():
        top, top_ids = torch.softmax(logits.float(), -1).topk(k, dim=-1)
        return (top / top.sum(-1, keepdim=True)).to(dtype), top_ids

    leaves = [t.detach().clone().requires_grad_() for t in (x, w, wgu, wd)]
    y_torch = torch_experts(leaves[0], ids, *leaves[1:])
    y, h, routing, xs, aw = dispatch.experts_forward(*args, save_h=True, keep_rows=True)
    r = route(ids, E)
    ends, tiles = r.offsets[1:], tile_map(r.offsets, S)
    xs_ = expand_rows(x, r.pos.view(T, k))
    dys = expand_rows(dy, r.pos.view(T, k))
    a = torch.randn(S, I, device=dev, dtype=dtype) * 0.1
    dh = torch.randn(S, 2 * I, device=dev, dtype=dtype) * 0.1
    unit = 2 * S * H * I
    items = [
        ("router", "softmax_topk kernel", lambda: softmax_topk(logits, k, True, dtype)[0], 0, "torch softmax + topk", {}),
        ("router", "torch softmax + topk", lambda: torch_router()[0], 0, None, {}),
        ("forward", "fused Triton GEMMs (keeps nothing)", lambda: dispatch.experts_forward(*args), 3 * unit,
         "torch grouped_mm experts", {"inference_grouped_mm": False}),
        ("forward", "grouped_mm path (keeps nothing)", lambda: dispatch.experts_forward(*args), 3 * unit,
         "torch grouped_mm experts", {"inference_grouped_mm": True}),
        ("forward", "grouped_mm path (keeps h for the backward)",
         lambda: dispatch.experts_forward(*args, save_h=True, keep_rows=True)[0], 3 * unit, "torch grouped_mm experts",
         {}),
        ("forward", "torch grouped_mm experts", lambda: torch_experts(*args), 3 * unit, None, {}),
        ("backward", "grouped_mm path (reads h)",
         lambda: dispatch.experts_backward(dy, *args, h, routing=routing, xs=xs, aw=aw), 6 * unit,
         "torch autograd", {}),
        ("backward", "fused Triton (recomputes h)", lambda: dispatch.experts_backward(dy, *args), 6 * unit,
         "torch autograd", {"grouped_mm": False}),
        ("backward", "torch autograd", lambda: torch.autograd.grad(y_torch, leaves, dy, retain_graph=True), 6 * unit,
         None, {}),
    ]
    for name, lhs, rhs, kmajor, flops in (("gate_up", xs_, wgu, True, 2 * unit), ("down", a, wd, True, unit),
                                          ("dgrad", dys, wd, False, unit), ("dx", dh, wgu, False, 2 * unit)):
        items.append(("GEMM", f"ragged GEMM {name}",
                      lambda lhs=lhs, rhs=rhs, kmajor=kmajor: ragged_gemm(lhs, rhs, tiles, b_kmajor=kmajor), flops,
                      f"torch._grouped_mm {name}", {}))
        items.append(("GEMM", f"torch._grouped_mm {name}",
                      lambda lhs=lhs, rhs=rhs, kmajor=kmajor: torch._grouped_mm(
                          lhs, rhs.transpose(1, 2) if kmajor else rhs, offs=ends), flops, None, {}))
    items.append(("GEMM", "torch._grouped_mm dW_gate_up", lambda: torch._grouped_mm(dh.t(), xs_, offs=ends),
                  2 * unit, None, {}))
    items.append(("GEMM", "torch._grouped_mm dW_down", lambda: torch._grouped_mm(dys.t(), a, offs=ends), unit, None, {}))
    return items


def outputs(out) -> list:
    """What a row's output is compared by: its tensor, or its tensors (a backward's gradients)."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_case(shape, T, dev, dtype, args, rows):
    H, I, E, k = SHAPES[shape]
    print(f"\n=== {shape} (H={H} I={I} E={E} k={k}) T={T}", flush=True)
    items = rows_of_case(shape, T, dev, dtype)
    outs, case_rows = {}, []
    for group, name, fn, flops, peer, settings in items:
        with config.patch(settings):
            out = fn()
        outs[name] = outputs(out)
        case_rows.append(dict(shape=shape, T=T, group=group, kernel=name, flops=flops, peer=peer, settings=settings))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for row in case_rows:
        if row["peer"]:
            row["err"] = max(common.rel_err(a, b) for a, b in zip(outs[row["kernel"]], outs[row["peer"]]))
        row["status"] = "FAIL" if row.get("err", 0.0) > tol else "ok"

    def timer(fn, settings):
        def run():
            with config.patch(settings):
                return common.time_ms(fn, dev, **common.timing(args.cpu_smoke, 200))
        return run

    readings = common.in_turn({it[1]: timer(it[2], it[5]) for it in items}, args.rounds)
    for row in case_rows:
        row["rounds_ms"] = [r["ms"] for r in readings[row["kernel"]]]
        row["ms"] = statistics.median(row["rounds_ms"])
        print(f"  {row['group']:8s} {row['kernel']:44s} {row['ms']:9.3f} ms", flush=True)
    rows += case_rows


def derive(rows, peak):
    by = {(r["shape"], r["T"], r["kernel"]): r for r in rows}
    for r in rows:
        if r["flops"]:
            r["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
            r["pct_peak"] = 100 * r["tflops"] / peak["tflops"]
        p = by.get((r["shape"], r["T"], r["peer"]))
        r["x_torch"] = p["ms"] / r["ms"] if p else None


def markdown(rows, peak, meta, rounds):
    f = common.fmt
    lines = [f"# kernels: the experts op's kernels beside torch, {meta['dtype']}", "", common.header(meta), "",
             f"ms: median of {rounds} round(s), the rows in turn. TFLOP/s: the GEMMs' FLOPs (forward 6 S H I, backward "
             f"12 S H I, S = T k); % of the {peak['n']}^3 matmul measured in the same run ({peak['tflops']:.1f} "
             "TFLOP/s). x torch: the torch row's ms / this one's; err: relative difference to the torch row's output "
             "(worst gradient for the backward).", ""]
    lines.append(common.md_table(
        ["shape", "T", "group", "kernel", "status", "ms", "TFLOP/s", "% peak", "x torch", "err"],
        [[r["shape"], r["T"], r["group"], r["kernel"], r["status"], f(r["ms"], ".3f"), f(r.get("tflops"), ".1f"),
          f(r.get("pct_peak"), ".1f"), f(r.get("x_torch"), ".2f"), f(r.get("err"), ".1e")] for r in rows]))
    return "\n".join(lines)


def plot(rows):
    def draw(plt):
        cases = list(dict.fromkeys((r["shape"], r["T"]) for r in rows))
        fig, axes = plt.subplots(1, len(cases), figsize=(8 * len(cases), 6), squeeze=False)
        for ax, case in zip(axes[0], cases):
            rs = [r for r in rows if (r["shape"], r["T"]) == case and r.get("tflops")]
            ax.barh(range(len(rs)), [r["tflops"] for r in rs],
                    color=["tab:orange" if r["kernel"].startswith("torch") else "tab:blue" for r in rs])
            ax.set_yticks(range(len(rs)), [f"{r['group']}: {r['kernel']}" for r in rs], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("TFLOP/s (orange: torch)")
            ax.set_title(f"{case[0]} T={case[1]}")
    return draw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="30b,235b", help="of 30b, 235b")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--rounds", type=int, default=3, help="time every row this many times, the rows in turn")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 shapes on the CPU (checks the script)")
    ap.add_argument("--out", default=str(common.RESULTS), help="folder for kernels_<gpu>.{md,json,png}")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
        dev, dtype, shapes, tokens = torch.device("cpu"), torch.float32, ["tiny"], [32]
    elif torch.cuda.is_available():
        dev, dtype = torch.device("cuda"), torch.bfloat16
        shapes, tokens = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
        if set(shapes) - set(SHAPES):
            ap.error(f"unknown shapes {sorted(set(shapes) - set(SHAPES))}")
    else:
        sys.exit("no CUDA device: use --cpu-smoke")
    meta = dict(common.provenance(dev), dtype=str(dtype).replace("torch.", ""), rounds=args.rounds)
    peak = common.matmul_peak(dev, dtype)
    print(f"kernels: {common.header(meta)}\nmatmul peak {peak['tflops']:.1f} TFLOP/s", flush=True)
    rows = []
    for shape in shapes:
        for T in tokens:
            run_case(shape, T, dev, dtype, args, rows)
    derive(rows, peak)
    md = markdown(rows, peak, meta, args.rounds)
    print("\n" + md)
    common.write_results("kernels", dev, args.out, dict(meta=meta, peak=peak, rows=rows), md, plot(rows))
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
