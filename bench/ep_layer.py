#!/usr/bin/env python3
"""Expert parallelism: one Qwen3-30B-A3B experts layer sharded over the ranks of torchrun, forward + backward.

    torchrun --nproc-per-node 2 bench/ep_layer.py [--tokens 16384] [--chunks 2,4] [--out DIR]
    torchrun --nproc-per-node 2 bench/ep_layer.py --cpu-smoke      # CPU, gloo, tiny shapes, fp32

Every rank routes its own T tokens (softmax top-k of random logits, renormalised) to E experts, E / world of them
local. Variants, on the same inputs in one process:

    unfused      TorchTitan's shape: the count exchange, host splits, all_to_all of the permuted rows, a second
                 permutation by local expert, torch._grouped_mm (a per-expert loop off the GPU), the reverse
                 all-to-all, fp32 routing weights and a scatter_add into the tokens
    moe_fuse     moe_fuse.parallel.ep.ep_experts (the fused experts op between the two exchanges)
    chunked N    the same with dispatch and combine pipelined over N expert groups
    graph op N   torch.ops.moe_fuse.ep_experts (first N of --chunks): what the TorchTitan graph pass installs

Times: CUDA events around a step, every rank entering it together (barrier), the median over steps, then the
slowest rank. Errors: output and the gradients of x, the routing weights, gate_up and down against the unfused path
and against an fp32 per-expert reference of the whole batch; the largest over ranks (over 2e-2 in bf16: exit
status 1). Rank 0 writes ep_layer_<gpu>.{md,json,png}.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the checkout on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed._functional_collectives import all_to_all_single_autograd  # noqa: E402

SHAPES = {"30b": (2048, 768, 128, 8), "tiny": (64, 32, 8, 2)}  # H, I, E, k
NAMES = ("y", "dx", "d_weights", "d_gate_up", "d_down")


def grouped_mm(a, b, offs):
    """a [R, K] rows grouped by expert (offs: cumulative ends, int32), b [L, K, N] -> [R, N]."""
    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(a[start:end] @ b[e])
        start = end
    return torch.cat(out) if out else a.new_empty((0, b.shape[2]))


def unfused_experts(x, ids, weights, gate_up, down, ep):
    T, H = x.shape
    k = ids.shape[1]
    W, L, E = ep.world, ep.local_experts, ep.num_experts
    I = down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    counts_recv = torch.empty_like(counts)
    dist.all_to_all_single(counts_recv, counts, group=ep.group)
    splits = torch.cat([counts.view(W, L).sum(1), counts_recv.view(W, L).sum(1)]).tolist()
    send, recv = splits[:W], splits[W:]
    rows = all_to_all_single_autograd(x.index_select(0, order // k), recv, send, ep.group)
    # received by source rank, then local expert: regroup by local expert for the grouped GEMMs
    local = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(W), counts_recv, output_size=sum(recv))
    regroup = torch.argsort(local, stable=True)
    xs = rows.index_select(0, regroup)
    offs = torch.cumsum(counts_recv.view(W, L).sum(0), 0).to(torch.int32)
    w1, w3 = gate_up[:, :I], gate_up[:, I:]
    h = F.silu(grouped_mm(xs, w1.transpose(-2, -1), offs)) * grouped_mm(xs, w3.transpose(-2, -1), offs)
    ys = grouped_mm(h, down.transpose(-2, -1), offs)
    back = torch.empty_like(regroup)
    back[regroup] = torch.arange(regroup.numel(), device=x.device)
    ys = all_to_all_single_autograd(ys.index_select(0, back), send, recv, ep.group)
    ys = (ys.float() * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).scatter_add(0, (order // k).unsqueeze(1).expand(-1, H), ys)


def reference(x, ids, weights, gate_up, down, dy):
    """y and every input's gradient in fp32, one GEMM per expert, over the whole (gathered) batch."""
    x, weights, gate_up, down = (t.detach().float().requires_grad_() for t in (x, weights, gate_up, down))
    k, I = ids.shape[1], down.shape[2]
    flat = ids.reshape(-1)
    toks, outs = [], []
    for e in range(gate_up.shape[0]):
        slot = (flat == e).nonzero().squeeze(1)
        h = x[slot // k] @ gate_up[e].t()
        toks.append(slot // k)
        outs.append((F.silu(h[:, :I]) * h[:, I:]) @ down[e].t() * weights.reshape(-1)[slot].unsqueeze(1))
    y = torch.zeros_like(x).index_add(0, torch.cat(toks), torch.cat(outs))
    return (y.detach(), *torch.autograd.grad(y, (x, weights, gate_up, down), dy.float()))


def max_over_ranks(values, dev):
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 16384; --cpu-smoke 48)")
    ap.add_argument("--chunks", default="2,4", help="chunk counts of the chunked variant")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 30; --cpu-smoke 3)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, tiny shapes, fp32 (checks the script)")
    ap.add_argument("--out", default=str(common.RESULTS), help="folder for ep_layer_<gpu>.{md,json,png}")
    args = ap.parse_args(argv)
    from moe_fuse.parallel.ep import _EPInfo, ep_experts

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=5))
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    H, I, E, k = SHAPES["tiny" if args.cpu_smoke else "30b"]
    T = args.tokens or (48 if args.cpu_smoke else 16384)
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    iters = args.iters or (3 if args.cpu_smoke else 30)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if E % world:
        raise SystemExit(f"E={E} experts do not divide over {world} ranks")
    L = E // world

    # the same weights on every rank (each keeps its slice), other tokens on each
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up_full = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
    down_full = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
    gen.manual_seed(1 + rank)
    x = torch.randn(T, H, device=dev, generator=gen).to(dtype).requires_grad_()
    top, ids = torch.softmax(torch.randn(T, E, device=dev, generator=gen), dim=-1).topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).requires_grad_()  # fp32, as TorchTitan keeps its scores
    dy = torch.randn(T, H, device=dev, generator=gen).to(dtype)
    gate_up = gate_up_full[rank * L:(rank + 1) * L].clone().requires_grad_()
    down = down_full[rank * L:(rank + 1) * L].clone().requires_grad_()
    inputs = (x, weights, gate_up, down)

    def ep(n):
        return _EPInfo(group=dist.group.WORLD, world=world, rank=rank, num_experts=E, first_expert=rank * L, chunks=n)

    variants = {"unfused": lambda: unfused_experts(x, ids, weights, gate_up, down, ep(None)),
                "moe_fuse": lambda: ep_experts(x, ids, weights, gate_up, down, ep(None))}
    for n in chunks:
        variants[f"chunked {n}"] = lambda n=n: ep_experts(x, ids, weights, gate_up, down, ep(n))
    if chunks:
        import moe_fuse.parallel.ep_ops  # noqa: F401  (registers torch.ops.moe_fuse.ep_experts)

        group_name = dist.group.WORLD.group_name
        variants[f"graph op {chunks[0]}"] = \
            lambda: torch.ops.moe_fuse.ep_experts(x, ids, weights, gate_up, down, group_name, chunks[0])[0]

    def gather(t):
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous())
        return torch.cat(out)

    ref = reference(gather(x.detach()), gather(ids), gather(weights.detach()), gate_up_full, down_full, gather(dy))
    mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * L, (rank + 1) * L)
    ref = (ref[0][mine], ref[1][mine], ref[2][mine], ref[3][experts], ref[4][experts])

    def barrier():
        dist.barrier()
        common.sync(dev)

    results, rows = {}, []
    for name, fn in variants.items():
        y = fn()
        results[name] = (y.detach(), *torch.autograd.grad(y, inputs, dy))
        del y
        step = lambda fn=fn: torch.autograd.grad(fn(), inputs, dy)  # noqa: E731
        forward = torch.no_grad()(fn)
        timing = {m: common.time_ms(f, dev, reps=iters, warmup=1 if args.cpu_smoke else 5, before=barrier)["ms"]
                  for m, f in (("fwd+bwd", step), ("fwd", forward))}
        fwd_bwd, fwd = max_over_ranks([timing["fwd+bwd"], timing["fwd"]], dev)
        vs_unfused = max_over_ranks([common.rel_err(a, b) for a, b in zip(results[name], results["unfused"])], dev)
        vs_ref = max_over_ranks([common.rel_err(a, b) for a, b in zip(results[name], ref)], dev)
        rows.append(dict(variant=name, fwd_bwd_ms=fwd_bwd, fwd_ms=fwd, err_vs_unfused=dict(zip(NAMES, vs_unfused)),
                         err_vs_fp32=dict(zip(NAMES, vs_ref))))
        if rank == 0:
            print(f"{name}: fwd+bwd {fwd_bwd:.3f} ms, fwd {fwd:.3f} ms", flush=True)
    for r in rows:
        r["x_unfused"] = rows[0]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    if rank == 0:
        meta = dict(common.provenance(dev), shape=dict(H=H, I=I, E=E, k=k), tokens_per_rank=T, world=world,
                    dtype=str(dtype).replace("torch.", ""), backend=dist.get_backend(), iters=iters)
        meta["command"] = meta["command"].replace("python ", f"torchrun --nproc-per-node {world} ", 1)
        errs = lambda e: " / ".join(f"{e[n]:.1e}" for n in NAMES)  # noqa: E731
        md = "\n".join([
            f"# ep_layer: H={H} I={I} E={E} k={k}, {T} tokens per rank x {world} ranks, {meta['dtype']}, "
            f"{meta['backend']}", "", common.header(meta), "",
            "ms: median over steps, slowest rank. x unfused: unfused fwd+bwd ms / this one's. Errors: relative, "
            "largest over ranks, of y / dx / d_weights / d_gate_up / d_down.", "",
            common.md_table(["variant", "fwd+bwd ms", "fwd ms", "x unfused", "err vs unfused", "err vs fp32 reference"],
                            [[r["variant"], f"{r['fwd_bwd_ms']:.3f}", f"{r['fwd_ms']:.3f}", f"{r['x_unfused']:.2f}",
                              errs(r["err_vs_unfused"]), errs(r["err_vs_fp32"])] for r in rows])])
        print("\n" + md)

        def draw(plt):
            ax = plt.subplots(figsize=(7, 4.5))[1]
            pos = range(len(rows))
            ax.bar([p - 0.2 for p in pos], [r["fwd_bwd_ms"] for r in rows], 0.4, label="fwd+bwd")
            ax.bar([p + 0.2 for p in pos], [r["fwd_ms"] for r in rows], 0.4, label="fwd")
            ax.set_xticks(list(pos), [r["variant"] for r in rows])
            ax.set_ylabel(f"ms (slowest of {world} ranks)")
            ax.legend()

        common.write_results("ep_layer", dev, args.out, dict(meta=meta, rows=rows), md, draw)
    dist.barrier()
    dist.destroy_process_group()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    return 1 if any(max(r["err_vs_fp32"].values()) > tol for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
