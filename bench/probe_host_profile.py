#!/usr/bin/env python3
"""Probe: host time and back-to-back wall time of one compiled 30B layer fwd+bwd step (Inductor, moe_fuse), and a
cProfile of moe_fuse's host work.

    python bench/probe_host_profile.py 4096        # GPU
    TRITON_INTERPRET=1 python bench/probe_host_profile.py --smoke
"""
import cProfile, pstats, io, sys, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch, common, layer

smoke = "--smoke" in sys.argv
shape, T = ("tiny", 64) if smoke else ("30b", int(sys.argv[1]))
dev = torch.device("cpu" if smoke else "cuda")
dtype = torch.float32 if smoke else torch.bfloat16
common.compile_setup()
block = layer.build_block(shape, dev, dtype)
H = layer.SHAPES[shape][0]
x = torch.randn(1, T, H, device=dev, dtype=dtype, requires_grad=True)
g = torch.randn(1, T, H, device=dev, dtype=dtype)
params = [x] + list(block.parameters())
opts = {"moe_fuse.inner": "aot_eager"} if smoke else None
for name in ("inductor", "moe_fuse"):
    torch._dynamo.reset()
    if name == "inductor":
        fn = torch.compile(block, backend="aot_eager" if smoke else "inductor", dynamic=False)
    else:
        fn = torch.compile(block, backend=common.moe_fuse_backend({}), dynamic=False, options=opts)
    def step():
        for p in params: p.grad = None
        (fn(x) * g).sum().backward()
    for _ in range(5): step()
    common.sync(dev)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n): step()
    host = (time.perf_counter() - t0) * 1e3 / n
    common.sync(dev)
    wall = (time.perf_counter() - t0) * 1e3 / n
    print(f"== {name} T={T}: host {host:.3f} ms/step, wall {wall:.3f} ms/step", flush=True)
    if name == "moe_fuse":
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n): step()
        pr.disable()
        common.sync(dev)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
            out = s.getvalue()
            out = out[out.index("ncalls"):] if "ncalls" in out else out
            print(f"-- by {key} ({n} steps)\n" + "\n".join(l[:170] for l in out.splitlines()[:32]), flush=True)
