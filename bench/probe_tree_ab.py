"""Same-harness A/B of two moe_fuse trees (PYTHONPATH picks the tree): a probe, kept in history only.

python bench/probe_tree_ab.py layers TAG            # 30b/235b x 4096/16384 fwd+bwd, inductor + moe_fuse, first-call peak
python bench/probe_tree_ab.py model TAG [inductor]  # 6-layer Qwen3-30B-shaped model fwd+bwd, 8192 tokens
python bench/probe_tree_ab.py fill TAG              # 235B T=16384 layer on an empty card vs ~90% full card
"""
import json
import os
import statistics
import sys
import time

import torch

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}
dev = torch.device("cuda")
flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)


def backend_fn():
    from moe_fuse.backend import moe_fuse_backend
    return moe_fuse_backend


def compile_(mod, variant):
    if variant == "inductor":
        return torch.compile(mod, backend="inductor", dynamic=False)
    return torch.compile(mod, backend=backend_fn(), dynamic=False)


def time_ms(fn, leaves, n=None, warm=3):
    def call():
        for p in leaves:
            p.grad = None
        fn()
    for _ in range(warm):
        call()
    torch.cuda.synchronize()
    if n is None:
        t0 = time.perf_counter(); call(); torch.cuda.synchronize()
        n = int(min(200, max(5, 0.4 / (time.perf_counter() - t0))))
    ms = []
    for _ in range(n):
        flush_buf.zero_()
        for p in leaves:
            p.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ms.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ms)


def block(shape):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    H, I, E, k = SHAPES[shape]
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(dev):
        b = Qwen3MoeSparseMoeBlock(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0.0, 0.02)
    return b


def first_call(fn, step):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t0


def layers(tag, cases, variants=("inductor", "moe_fuse"), rounds=3):
    out = []
    for shape, T in cases:
        torch._dynamo.reset()
        b = block(shape)
        H = SHAPES[shape][0]
        g = torch.Generator().manual_seed(T)
        x = torch.randn(1, T, H, generator=g).to(dev, torch.bfloat16).requires_grad_()
        gy = torch.randn(1, T, H, generator=g).to(dev, torch.bfloat16)
        leaves = [x] + list(b.parameters())
        fns, rec = {}, {}
        for v in variants:
            fn = compile_(b, v)
            step = lambda fn=fn: (fn(x) * gy).sum().backward()
            mb, s = first_call(fn, step)
            for p in leaves:
                p.grad = None
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(); torch.cuda.synchronize()
            steady = (torch.cuda.max_memory_allocated() - base) / 2**20
            for p in leaves:
                p.grad = None
            fns[v] = step
            rec[v] = dict(first_mb=mb, steady_mb=steady, compile_s=s, ms=[])
        for r in range(rounds):
            order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
            for v in order:
                rec[v]["ms"].append(time_ms(fns[v], leaves))
        for v in variants:
            d = rec[v]
            d.update(tag=tag, shape=shape, T=T, variant=v, med=statistics.median(d["ms"]))
            print(json.dumps(d), flush=True)
            out.append(d)
        del fns, b, x, gy, leaves
        torch.cuda.empty_cache()
    return out


def model(tag, variants):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(num_hidden_layers=6, use_cache=False, output_router_logits=False,
                         hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                         num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        m = Qwen3MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    m.train()
    if getattr(m.config, "_experts_implementation", None) != "grouped_mm":
        m.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, cfg.vocab_size, (1, 8192), generator=torch.Generator().manual_seed(1)).to(dev)
    leaves = list(m.parameters())
    for v in variants:
        torch._dynamo.reset()
        fn = compile_(m, v)
        step = lambda fn=fn: fn(input_ids=ids, labels=ids).loss.backward()
        mb, s = first_call(fn, step)
        for p in leaves:
            p.grad = None
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(); torch.cuda.synchronize()
        steady = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = [time_ms(step, leaves, n=10) for _ in range(3)]
        d = dict(tag=tag, case="model6", variant=v, first_mb=mb, steady_mb=steady, compile_s=s, ms=ms,
                 med=statistics.median(ms))
        print(json.dumps(d), flush=True)
        del fn
        torch.cuda.empty_cache()


def fill(tag, shape="235b", T=16384, frac=0.9):
    from moe_fuse import config  # noqa: F401  (the after tree)
    res = []
    b = block(shape)
    H = SHAPES[shape][0]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(1, T, H, generator=g).to(dev, torch.bfloat16).requires_grad_()
    gy = torch.randn(1, T, H, generator=g).to(dev, torch.bfloat16)
    leaves = [x] + list(b.parameters())
    total = torch.cuda.get_device_properties(dev).total_memory
    for phase in ("empty", "full"):
        filler = None
        if phase == "full":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            filler = torch.empty(int(free - (1 - frac) * total), dtype=torch.int8, device=dev)
        for v in ("inductor", "moe_fuse"):
            torch._dynamo.reset()
            fn = compile_(b, v)
            step = lambda fn=fn: (fn(x) * gy).sum().backward()
            try:
                mb, s = first_call(fn, step)
                ms = [time_ms(step, leaves) for _ in range(3)]
                d = dict(tag=tag, case=f"fill-{phase}", variant=v, first_mb=mb, ms=ms, med=statistics.median(ms),
                         allocated_gb=torch.cuda.memory_allocated() / 2**30)
            except torch.OutOfMemoryError as e:
                d = dict(tag=tag, case=f"fill-{phase}", variant=v, error=str(e)[:200])
            for p in leaves:
                p.grad = None
            print(json.dumps(d), flush=True)
            res.append(d)
            del fn, step
            torch.cuda.empty_cache()
        del filler
        torch.cuda.empty_cache()


if __name__ == "__main__":
    what, tag = sys.argv[1], sys.argv[2]
    print(tag, "moe_fuse from", __import__("moe_fuse").__file__, torch.cuda.get_device_name(), flush=True)
    if what == "layers":
        cases = [(s, int(t)) for s in os.environ.get("SHAPES", "30b,235b").split(",")
                 for t in os.environ.get("TOKENS", "4096,16384").split(",")]
        layers(tag, cases, rounds=int(os.environ.get("ROUNDS", "3")))
    elif what == "model":
        model(tag, sys.argv[3].split(",") if len(sys.argv) > 3 else ["moe_fuse"])
    elif what == "fill":
        fill(tag)
