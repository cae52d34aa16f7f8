#!/usr/bin/env python3
"""Probe: one compiled layer step under torch.profiler: each kernel's time per step, the GPU's busy time and the span.

    python bench/probe_layer_profile.py 30b 4096 moe_fuse|inductor [fwd|fwd-train|fwd+bwd]
"""
import sys, os, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch, common, layer
from torch.profiler import profile, ProfilerActivity

shape, T, variant = sys.argv[1], int(sys.argv[2]), sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else "fwd+bwd"
common.compile_setup()
dev = torch.device("cuda")
block = layer.build_block(shape, dev, torch.bfloat16)
H = layer.SHAPES[shape][0]
x = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
if variant == "inductor":
    fn = torch.compile(block, backend="inductor", dynamic=False)
else:
    fn = torch.compile(block, backend=common.moe_fuse_backend({}), dynamic=False)
params = [x] + list(block.parameters())
def step():
    for p in params: p.grad = None
    if mode == "fwd":
        with torch.no_grad():
            fn(x)
    elif mode == "fwd-train":
        fn(x)
    else:
        (fn(x) * g).sum().backward()
for _ in range(5): step()
torch.cuda.synchronize()
N = 5
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(N): step()
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
by = {}
for e in ev:
    d = by.setdefault(e.name[:90], [0, 0.0]); d[0] += 1; d[1] += e.device_time / 1000
busy = sum(v[1] for v in by.values()) / N
t0 = min(e.time_range.start for e in ev); t1 = max(e.time_range.end for e in ev)
print(f"== {shape} T={T} {variant} {mode}: GPU busy {busy:.3f} ms/step, span {(t1 - t0) / 1000 / N:.3f} ms/step, kernels/step {len(ev) / N:.0f}")
for name, (n, ms) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"  {ms / N:8.3f} ms  x{n // N:3d}  {name}")
# gaps: sorted kernel intervals within one step span
iv = sorted((e.time_range.start, e.time_range.end) for e in ev)
gaps = []; end = iv[0][1]
for s, e in iv[1:]:
    if s > end: gaps.append(s - end)
    end = max(end, e)
gaps.sort(reverse=True)
print(f"  idle total {sum(gaps) / 1000 / N:.3f} ms/step; largest gaps us: {[round(x, 1) for x in gaps[:10]]}")
