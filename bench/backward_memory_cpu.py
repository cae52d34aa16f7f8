#!/usr/bin/env python3
"""Peak memory of one MoE layer's training step, from the CPU allocator's reports (no GPU needed).

    python bench/backward_memory_cpu.py [--shapes 30b,235b] [--tokens 4096,16384] [--inner inductor] [--out DIR]

A Qwen3-MoE sparse block in bf16, forward + backward, at the sizes of a Qwen3 layer shrunk so that every tensor
of the step is 1/512 of its full size: H, I and E an eighth, the tokens a 64th ([T*k, H], [E, 2I, H], [T, E] all
shrink by 512). The peaks then scale by 512 exactly, and the table gives them at full size beside layer_bench's
GPU figures. Variants:

- hf_inductor: transformers' grouped_mm experts compiled by Inductor (the layer bench's peer);
- moe_fuse: the experts op on grouped_mm_path, its backward as three ops (``ops.SPLIT_BACKWARD``);
- moe_fuse_one_op: the same with the backward as one op;
- moe_fuse_lean (on request): moe_fuse with ``moe_fuse.keep_rows=False``.

--shapes also takes glm4_moe: families_layer_bench.py's GLM-4.5-Air block (sigmoid router, a shared expert) with its
sizes shrunk the same way (that bench runs it at --tokens 8192).

grouped_mm_path runs on the CPU as it would on the GPU (``applies`` forced on; the grouped GEMMs one torch.mm per
expert into their output, the Triton kernels in the interpreter, TRITON_INTERPRET=1). Inductor's code for the peer
calls aten's grouped GEMM itself. torch.profiler's "[memory]"
events list every allocation and free of the step; the peak of the bytes live above the step's start is what
layer_bench's ``peak_mem_mb`` (torch.cuda.max_memory_allocated over the base) measures on the GPU, less the CUDA
caching allocator's rounding. Each variant's gradients are checked against eager's (relative error) and the
moe_fuse variants' against each other (bitwise). --cpu-smoke: a tiny shape, aot_eager (the tests).
"""
import argparse, json, os, sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch._subclasses import FakeTensor  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from moe_fuse import ops  # noqa: E402
from moe_fuse.kernels import grouped_mm_path  # noqa: E402

VARIANTS = ["hf_inductor", "moe_fuse", "moe_fuse_one_op"]
SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}  # H, I, E, top-k of the full layer
# Other families' blocks (families_layer_bench.FAMILIES) whose E divides by 8, their size fields shrunk by 8
FAMILY_SHAPES = ("glm4_moe",)
SHRUNK_FIELDS = ("hidden_size", "moe_intermediate_size", "intermediate_size", "n_routed_experts", "num_experts")
SCALE = 512  # H, I, E / 8 and T / 64: every tensor of the step / 512
REAL_GROUPED_MM = torch._grouped_mm


def collect_after_interpreted_launches():
    """The Triton interpreter leaves reference cycles that keep a launch's tensor storages alive until the next
    garbage collection (the freed rows of x or dy showed up one kernel later); the GPU has no such thing, so each
    interpreted launch is followed by a collection here."""
    import gc

    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def launch_then_collect(self, *args, **kwargs):
        out = launch(self, *args, **kwargs)
        gc.collect()
        return out

    interpreter.GridExecutor.__call__ = launch_then_collect


def build(H, I, E, k, dtype):
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    with torch.no_grad():  # the router starts at zeros in transformers: never measure on zeros
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def peak_mib(step):
    """MiB live at the step's peak above what was live when it started: the allocator's own reports (torch.profiler's
    "[memory]" events, + on allocation and - on free, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak / 2**20


def run(name, block, x, dy, inner):
    torch._dynamo.reset()
    params = list(block.parameters())
    if name == "hf_inductor":
        fn = torch.compile(block, backend="inductor", dynamic=False)
    else:
        ops.SPLIT_BACKWARD = name != "moe_fuse_one_op"
        # verify off: its probes run at compile time, outside the measured step, and only cost time here
        fn = torch.compile(block, backend="moe_fuse", dynamic=False,
                           options={"moe_fuse.inner": inner, "moe_fuse.verify": False,
                                    "moe_fuse.keep_rows": name != "moe_fuse_lean"})

    def step():
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_()
        fn(xg).backward(dy)
        return [xg.grad] + [p.grad for p in params]

    step()  # compile (Dynamo must see torch's op to match transformers' experts)
    torch._grouped_mm = grouped_mm_out_only
    try:
        grads = step()
        return peak_mib(step), grads
    finally:
        torch._grouped_mm = REAL_GROUPED_MM


def grouped_mm_out_only(a, b, offs=None, **kw):
    """torch._grouped_mm's result, one torch.mm per group into the output: the GEMMs allocate their output and
    nothing else, as CUTLASS does on the GPU, whatever torch's CPU fallback does in a given version (torch 2.13's
    gave the same moe_fuse peaks at 30B T=16384). Where autograd or a trace needs the op itself, torch's. Set only after
    compiling: Dynamo must see torch's op in transformers' experts."""
    if isinstance(a, FakeTensor) or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return REAL_GROUPED_MM(a, b, offs=offs, **kw)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # row-ragged: a [S, K], b [E, K, N] -> [S, N]
        out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype)
        for e, (lo, hi) in enumerate(zip(starts, ends)):
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
        return out
    # K-ragged: a [M, S], b [S, N] -> [E, M, N]
    out = torch.empty(len(ends), a.shape[0], b.shape[1], dtype=a.dtype)
    for e, (lo, hi) in enumerate(zip(starts, ends)):
        torch.mm(a[:, lo:hi], b[lo:hi], out=out[e])
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(shape, tokens, args):
    """Rows of one shape: each variant's peak (MiB here, and x SCALE: at full size) and gradient errors."""
    if tokens % 64:
        raise ValueError(f"--tokens: {tokens} is not a multiple of 64")
    T = tokens // 64
    if shape == "tiny":
        (H, I, E, k), T = (64, 24, 8, 4), 64
    elif shape in FAMILY_SHAPES:
        import families_layer_bench as fam  # bench/, this script's directory

        fields = {n: v // 8 if n in SHRUNK_FIELDS else v for n, v in fam.FAMILIES[shape][3].items()}
        H, k = fields["hidden_size"], fields["num_experts_per_tok"]
        I, E = fields["moe_intermediate_size"], fields["n_routed_experts"]
        with mock.patch.dict(fam.FAMILIES, {shape: (*fam.FAMILIES[shape][:3], fields)}):
            block = fam.build(shape, torch.device("cpu"), torch.bfloat16)
    elif shape in SHAPES:
        (H, I, E), k = (n // 8 for n in SHAPES[shape][:3]), SHAPES[shape][3]
    else:
        raise ValueError(f"--shapes: unknown {shape!r}; known: {', '.join([*SHAPES, *FAMILY_SHAPES])}")
    torch.manual_seed(0)
    if shape not in FAMILY_SHAPES:
        block = build(H, I, E, k, torch.bfloat16)
    x = torch.randn(1, T, H, dtype=torch.bfloat16)
    dy = torch.randn(1, T, H, dtype=torch.bfloat16)
    params = list(block.parameters())
    for p in params:
        p.grad = None
    xg = x.detach().requires_grad_()
    block(xg).backward(dy)
    want = [xg.grad] + [p.grad for p in params]
    rows, first = [], None
    for name in args.variants:
        peak, grads = run(name, block, x, dy, args.inner)
        row = {"shape": shape, "tokens": tokens, "variant": name, "sizes": {"H": H, "I": I, "E": E, "k": k, "T": T},
               "peak_mib": round(peak, 4), "worst_grad_err_vs_eager": max(rel_err(g, w) for g, w in zip(grads, want))}
        if shape != "tiny":
            row["peak_mib_full_size"] = round(peak * SCALE)
        if name.startswith("moe_fuse"):
            first = grads if first is None else first
            row["grads_bitwise_equal_to_first_moe_fuse"] = all(torch.equal(a, b) for a, b in zip(grads, first))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows):
    lines = ["| layer | T | variant | peak MiB at full size (the CPU run x 512) | worst grad err vs eager |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r.get('peak_mib_full_size', r['peak_mib'])} | "
                     f"{r['worst_grad_err_vs_eager']:.1e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="30b,235b")
    ap.add_argument("--tokens", default="4096,16384", help="tokens of the full-size layer (a multiple of 64)")
    ap.add_argument("--inner", default="inductor", help="moe_fuse.inner: inductor or aot_eager")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    cases = [(s, int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    if args.cpu_smoke:
        cases, args.inner = [("tiny", 64)], "aot_eager"
    # grouped_mm_path where CUDA would take it (bf16, sm90): the CPU computes the same steps
    grouped_mm_path.applies = lambda *a: True
    ops._on_kernels = lambda *a, **kw: True
    collect_after_interpreted_launches()
    rows = [r for shape, tokens in cases for r in measure(shape, tokens, args)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"inner": args.inner, "torch": torch.__version__, "dtype": "bf16", "scale": SCALE}
    (out / "backward_memory_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "backward_memory_cpu.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
