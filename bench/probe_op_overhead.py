#!/usr/bin/env python3
"""Probe: host cost of calling an implementation through torch's custom-op machinery.

    PYTHONPATH=. python3 bench/probe_op_overhead.py [--device cuda]

One signature (router_backward's: an optional tensor, five tensors and a bool in, two tensors out)
and one trivial body (two new_empty), called directly, as a ``torch.library.custom_op`` with and
without a registered autograd formula, and as a plain ``torch.library.Library`` op; then the real
``moe_fuse::router_backward`` direct and through its op (``moe_fuse/ops.py`` registers it the plain
way, ``_op``). Microseconds per call, back to back.
"""

import argparse
import time

import torch
from torch import Tensor

import moe_fuse.ops  # noqa: F401


def per_call_us(fn, n=3000):
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    dev = ap.parse_args().device
    T, H, E, k = 4096, 2048, 128, 8
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    wr = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02
    logits, weights, ids = torch.ops.moe_fuse.router(x, wr, k, True, torch.bfloat16)
    dw = torch.randn(T, k, device=dev, dtype=torch.bfloat16)

    def body(d_logits, d_weights, x, weight, logits, ids, renorm):
        return x.new_empty(x.shape), weight.new_empty(weight.shape)

    def typed(d_logits: Tensor | None, d_weights: Tensor, x: Tensor, weight: Tensor, logits: Tensor, ids: Tensor,
              renorm: bool) -> tuple[Tensor, Tensor]:
        return body(d_logits, d_weights, x, weight, logits, ids, renorm)

    torch.library.custom_op("moe_fuse_probe::typed", typed, mutates_args=())
    with_ag = torch.library.custom_op("moe_fuse_probe::with_autograd", typed, mutates_args=())
    with_ag.register_autograd(lambda ctx, a, b: (None,) * 7, setup_context=lambda ctx, inputs, output: None)
    lib = torch.library.Library("moe_fuse_probe_lib", "DEF")  # noqa: F841 (kept alive while timing)
    lib.define("rb(Tensor? d_logits, Tensor d_weights, Tensor x, Tensor weight, Tensor logits, Tensor ids, "
               "bool renorm) -> (Tensor, Tensor)")
    lib.impl("rb", body, "CompositeExplicitAutograd")
    args = (None, dw, x, wr, logits, ids, True)
    cases = {
        "direct body": lambda: body(*args),
        "custom_op": lambda: torch.ops.moe_fuse_probe.typed.default(*args),
        "custom_op + register_autograd": lambda: torch.ops.moe_fuse_probe.with_autograd.default(*args),
        "Library.impl": lambda: torch.ops.moe_fuse_probe_lib.rb.default(*args),
        "moe_fuse router_backward direct": lambda: moe_fuse.ops.router_backward(*args),
        "moe_fuse router_backward op": lambda: torch.ops.moe_fuse.router_backward.default(*args),
    }
    print(f"{dev}: us per call")
    for name, fn in cases.items():
        print(f"  {name:<34} {per_call_us(fn):7.1f}")
        with torch.no_grad():
            print(f"  {name + ' (no_grad)':<34} {per_call_us(fn):7.1f}")


if __name__ == "__main__":
    main()
