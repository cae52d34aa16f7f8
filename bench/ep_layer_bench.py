#!/usr/bin/env python3
"""Expert-parallel layer benchmark: one Qwen3-30B-A3B experts layer sharded over the ranks of torchrun.

    torchrun --nproc-per-node 2 bench/ep_layer_bench.py --out DIR [--tokens 16384] [--chunks 2,4]
    torchrun --nproc-per-node 2 bench/ep_layer_bench.py --out DIR --smoke      # CPU, gloo, tiny shapes

Every rank routes its own T tokens (softmax top-k of random logits, renormalised) to E experts, E / world
of them local. Variants, on the same inputs in one process, forward + backward:

    unfused      TorchTitan's shape: count exchange, .tolist() splits, all_to_all_single of the permuted
                 rows, a second permutation to group them by local expert, three torch._grouped_mm
                 (gate, up, down; a per-expert loop where _grouped_mm is unavailable), the reverse
                 all-to-all, routing weights in fp32 and a scatter_add into the tokens
    moe_fuse     moe_fuse.parallel.ep.ep_experts: today's shard_experts path (fused experts op)
    chunked N    the same with dispatch / combine pipelined over N expert groups (moe_fuse.parallel.overlap)
    graph op N   torch.ops.moe_fuse.ep_experts (first N of --chunks), what the TorchTitan graph pass
                 installs: the chunked pipeline as one op; its backward sends the token rows again

Times: CUDA events around one forward + backward (torch.autograd.grad), every rank entering each iteration
together (barrier); the median over iterations, then the slowest rank. Errors: each variant's output and
gradients (x, routing weights, gate_up, down) against the unfused path, and every variant against an fp32
per-expert reference of the whole batch (all ranks' tokens, computed on every rank); the largest over ranks.
Writes ep_layer_bench.md and ep_layer_bench.json to --out.
"""
import argparse, datetime, json, os, platform, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's moe_fuse wins, installed or not

from provenance import code_version  # noqa: E402  (bench/ is this script's directory)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

from moe_fuse.parallel.ep import _EPInfo, ep_experts

SHAPES = {"30b": (2048, 768, 128, 8), "smoke": (64, 32, 8, 2)}  # H, I, E, k


# ---------------------------------------------------------------- the unfused peer
def grouped_mm(a, b, offs):
    """a [R, K] rows grouped by expert (offs: cumulative ends, int32), b [L, K, N] -> [R, N]."""
    if a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):  # fallback: one GEMM per expert (host sync, but only off-GPU)
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
    rows = x.index_select(0, order // k)
    rows = all_to_all_single_autograd(rows, recv, send, ep.group)
    # Received: by source rank, then local expert. Regroup by local expert for the grouped GEMMs.
    local = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(W), counts_recv, output_size=sum(recv))
    regroup = torch.argsort(local, stable=True)
    xs = rows.index_select(0, regroup)
    offs = torch.cumsum(counts_recv.view(W, L).sum(0), 0).to(torch.int32)
    w1, w3 = gate_up[:, :I], gate_up[:, I:]  # views: their gradients land in gate_up.grad
    h = F.silu(grouped_mm(xs, w1.transpose(-2, -1), offs)) * grouped_mm(xs, w3.transpose(-2, -1), offs)
    ys = grouped_mm(h, down.transpose(-2, -1), offs)
    back = torch.empty_like(regroup)
    back[regroup] = torch.arange(regroup.numel(), device=x.device)
    ys = all_to_all_single_autograd(ys.index_select(0, back), send, recv, ep.group)
    ys = (ys.float() * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).scatter_add(0, (order // k).unsqueeze(1).expand(-1, H), ys)


# ---------------------------------------------------------------- fp32 reference of the whole batch
def reference_grads(x, ids, weights, gate_up, down, dy):
    """y and the gradients of every input, fp32, one GEMM per expert, over the whole (gathered) batch."""
    x, weights, gate_up, down = (t.detach().float().requires_grad_() for t in (x, weights, gate_up, down))
    T, H = x.shape
    k = ids.shape[1]
    I = down.shape[2]
    flat = ids.reshape(-1)
    toks, outs = [], []
    for e in range(gate_up.shape[0]):
        slot = (flat == e).nonzero().squeeze(1)
        tok = slot // k
        h = x[tok] @ gate_up[e].t()
        out = (F.silu(h[:, :I]) * h[:, I:]) @ down[e].t()
        toks.append(tok)
        outs.append(out * weights.reshape(-1)[slot].unsqueeze(1))
    y = torch.zeros(T, H, device=x.device).index_add(0, torch.cat(toks), torch.cat(outs))
    grads = torch.autograd.grad(y, (x, weights, gate_up, down), dy.float())
    return y.detach(), grads


# ---------------------------------------------------------------- measuring
def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_over_ranks(values, dev):
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_ms(fn, dev, warmup, iters):
    """Median ms of fn over iters, each started by every rank together; the slowest rank's median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return max_over_ranks([statistics.median(times)], dev)[0]


def print_profile(name, fn, inputs, dy, rank, steps=3, top=12):
    """Kernel time per step on this rank (all ranks run the steps: the collectives need them)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and dy.is_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    dist.barrier()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            torch.autograd.grad(fn(), inputs, dy)
        if dy.is_cuda:
            torch.cuda.synchronize()
    if rank != 0:
        return
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"== profile {name}: kernels {busy:.3f} ms per step (streams overlap: can exceed the step)")
    for e in events[:top]:
        print(f"   {e.device_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<4} {e.key[:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for ep_layer_bench.md / .json")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 16384; 48 with --smoke)")
    ap.add_argument("--chunks", default="2,4", help="chunk counts of the chunked variant, comma separated")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes, fp32 (checks it runs end to end)")
    ap.add_argument("--profile", action="store_true",
                    help="then 3 more steps of each variant under torch.profiler: rank 0 prints where its GPU time goes")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=5))
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    H, I, E, k = SHAPES["smoke" if args.smoke else "30b"]
    T = args.tokens or (48 if args.smoke else 16384)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    iters = args.iters if args.iters is not None else (3 if args.smoke else 30)
    chunk_counts = [int(c) for c in args.chunks.split(",") if c]
    if E % world:
        raise ValueError(f"E={E} experts are not divisible by the world size {world}")
    L = E // world

    # Same weights on every rank (each keeps its slice), different tokens per rank.
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up_full = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
    down_full = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
    gen.manual_seed(1 + rank)
    x = torch.randn(T, H, device=dev, generator=gen).to(dtype).requires_grad_()
    logits = torch.randn(T, E, device=dev, generator=gen)
    top, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).requires_grad_()  # fp32, as TorchTitan keeps its scores
    dy = torch.randn(T, H, device=dev, generator=gen).to(dtype)
    gate_up = gate_up_full[rank * L:(rank + 1) * L].clone().requires_grad_()
    down = down_full[rank * L:(rank + 1) * L].clone().requires_grad_()
    inputs = (x, weights, gate_up, down)

    def ep_info(chunks):
        return _EPInfo(group=dist.group.WORLD, world=world, rank=rank, num_experts=E, first_expert=rank * L, chunks=chunks)

    variants = {"unfused": lambda: unfused_experts(x, ids, weights, gate_up, down, ep_info(None)),
                "moe_fuse": lambda: ep_experts(x, ids, weights, gate_up, down, ep_info(None))}
    for n in chunk_counts:
        variants[f"chunked {n}"] = (lambda n=n: ep_experts(x, ids, weights, gate_up, down, ep_info(n)))
    if chunk_counts:
        # What a compiled graph runs after the TorchTitan dispatch pass: the same pipeline as one custom op,
        # whose backward sends the token rows again instead of keeping them (moe_fuse/parallel/ep_ops.py).
        import moe_fuse.parallel.ep_ops  # noqa: F401

        n, group_name = chunk_counts[0], dist.group.WORLD.group_name
        variants[f"graph op {n}"] = (
            lambda n=n: torch.ops.moe_fuse.ep_experts(x, ids, weights, gate_up, down, group_name, n)[0]
        )

    # fp32 reference of the whole batch (every rank's tokens): every rank computes it, keeps its part.
    def gather(t):
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous())
        return torch.cat(out)

    ref_y, (ref_dx, ref_dw, ref_dgu, ref_dd) = reference_grads(
        gather(x.detach()), gather(ids), gather(weights.detach()), gate_up_full, down_full, gather(dy))
    mine = slice(rank * T, (rank + 1) * T)
    reference = (ref_y[mine], ref_dx[mine], ref_dw[mine], ref_dgu[rank * L:(rank + 1) * L], ref_dd[rank * L:(rank + 1) * L])
    del ref_y, ref_dx, ref_dw, ref_dgu, ref_dd

    names = ("y", "dx", "d_weights", "d_gate_up", "d_down")
    results, rows = {}, []
    for name, fn in variants.items():
        y = fn()
        results[name] = (y.detach(), *torch.autograd.grad(y, inputs, dy))
        del y

        def step(fn=fn):
            torch.autograd.grad(fn(), inputs, dy)

        def forward(fn=fn):
            with torch.no_grad():
                fn()

        fwd_bwd = time_ms(step, dev, warmup, iters)
        fwd = time_ms(forward, dev, warmup, iters)
        vs_unfused = max_over_ranks([rel_err(a, b) for a, b in zip(results[name], results["unfused"])], dev)
        vs_ref = max_over_ranks([rel_err(a, b) for a, b in zip(results[name], reference)], dev)
        rows.append(dict(variant=name, fwd_bwd_ms=fwd_bwd, fwd_ms=fwd, err_vs_unfused=dict(zip(names, vs_unfused)),
                         err_vs_fp32=dict(zip(names, vs_ref))))
        if rank == 0:
            print(f"{name}: fwd+bwd {fwd_bwd:.3f} ms, fwd {fwd:.3f} ms", flush=True)
    if args.profile:
        for name, fn in variants.items():
            print_profile(name, fn, inputs, dy, rank)
    base = rows[0]["fwd_bwd_ms"]
    for r in rows:
        r["x_unfused"] = base / r["fwd_bwd_ms"]

    if rank == 0:
        meta = dict(shape=dict(H=H, I=I, E=E, k=k), tokens_per_rank=T, world=world, dtype=str(dtype),
                    backend=dist.get_backend(), device=torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
                    torch=torch.__version__, grouped_mm=cuda and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"),
                    warmup=warmup, iters=iters, **code_version(), command=" ".join(sys.argv))
        lines = [
            f"EP layer, H={H} I={I} E={E} k={k}, {T} tokens per rank x {world} ranks, {dtype}, {meta['backend']}, "
            f"{meta['device']}, torch {meta['torch']}, git {meta['git']}, sources {meta['source_sha']}",
            "",
            "time: median over iterations, slowest rank; x_unfused = unfused fwd+bwd / this; errors: relative "
            "L2, largest over ranks (y / dx / d_weights / d_gate_up / d_down)",
            "",
            "| variant | fwd+bwd ms | fwd ms | x_unfused | err vs unfused | err vs fp32 reference |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            fmt = lambda errs: " / ".join(f"{errs[n]:.1e}" for n in names)
            lines.append(f"| {r['variant']} | {r['fwd_bwd_ms']:.3f} | {r['fwd_ms']:.3f} | {r['x_unfused']:.2f} | "
                         f"{fmt(r['err_vs_unfused'])} | {fmt(r['err_vs_fp32'])} |")
        table = "\n".join(lines)
        print("\n" + table)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ep_layer_bench.md").write_text(table + "\n")
        (out / "ep_layer_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"\nwrote {out / 'ep_layer_bench.md'} and {out / 'ep_layer_bench.json'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
