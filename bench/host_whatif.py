#!/usr/bin/env python3
"""Host cost of each piece of a compiled moe_fuse layer step, by taking the pieces away.

    PYTHONPATH=. python3 bench/host_whatif.py [--shape 30b] [--tokens 4096]

The same compiled step (transformers' block, backend="moe_fuse", forward + backward) is timed
while the kernel entry points behind the custom ops are replaced, one after another, by stubs
that only allocate their outputs (no launches). The drop in host time per step (steps issued back
to back, timed before the final synchronize) is what that piece costs the host. Results of stubbed
steps are garbage; nothing is checked.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_profile import enqueue_ms, layer_step  # noqa: E402
from layer_bench import SHAPES, build_block, ensure_moe_fuse_backend  # noqa: E402


def stubs():
    """Stand-ins with the signatures and output shapes of the kernel entry points the ops call."""
    from moe_fuse import kernels

    def experts_backward(dy, x, ids, weights, w_gate_up, w_down, h=None, *, routing=None, xs=None, aw=None):
        return (torch.empty_like(x), torch.empty(ids.shape, dtype=weights.dtype, device=x.device),
                torch.empty_like(w_gate_up), torch.empty_like(w_down))

    def experts_forward(x, ids, weights, w_gate_up, w_down, *, save_h=False, keep_rows=False):
        y = torch.empty_like(x)
        if not save_h:
            return y
        S, E = ids.numel(), w_gate_up.shape[0]
        h = torch.empty(S, w_gate_up.shape[1], dtype=w_gate_up.dtype, device=x.device)
        routing = kernels.routing_from_buffer(
            torch.empty(kernels.routing_buffer_size(S, E), dtype=torch.int32, device=x.device), S, E)
        if not keep_rows:
            return y, h, routing
        return (y, h, routing, torch.empty(S, x.shape[1], dtype=x.dtype, device=x.device),
                torch.empty(S, w_down.shape[2], dtype=w_down.dtype, device=x.device))

    def softmax_topk(logits, top_k, renorm, weights_dtype):
        T = logits.shape[0]
        return (torch.empty(T, top_k, dtype=weights_dtype, device=logits.device),
                torch.zeros(T, top_k, dtype=torch.int64, device=logits.device))

    def softmax_topk_backward(d_logits, d_weights, logits, ids, renorm):
        return torch.empty_like(logits)

    return dict(experts_backward=experts_backward, experts_forward=experts_forward,
                softmax_topk_backward=softmax_topk_backward, softmax_topk=softmax_topk)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="30b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    ensure_moe_fuse_backend()
    from moe_fuse import kernels

    block = build_block(args.shape, "cuda", torch.bfloat16)
    x = torch.randn(1, args.tokens, SHAPES[args.shape][0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *block.parameters()]
    for backend in ("inductor", "moe_fuse"):
        step = layer_step(torch.compile(block, backend=backend), x, dy, params)
        host, wall = enqueue_ms(step, n=50)
        print(f"{backend:<9} host {host:.3f} ms/step, wall {wall:.3f} ms/step")
        if backend != "moe_fuse":
            continue
        saved = {name: getattr(kernels, name) for name in stubs()}
        for name, stub in stubs().items():  # cumulative: each line also stubs the ones above it
            setattr(kernels, name, stub)
            host, wall = enqueue_ms(step, n=50)
            print(f"  + stub {name:<22} host {host:.3f} ms/step, wall {wall:.3f} ms/step")
        for name, fn_ in saved.items():
            setattr(kernels, name, fn_)
        host, wall = enqueue_ms(step, n=50)
        print(f"  restored                      host {host:.3f} ms/step, wall {wall:.3f} ms/step")


if __name__ == "__main__":
    main()
