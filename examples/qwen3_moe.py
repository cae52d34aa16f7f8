"""Demo: compile an unmodified Hugging Face Qwen3-MoE with backend="moe_fuse".

Builds a tiny random Qwen3-MoE (no download), runs one training step eagerly
and one through torch.compile(backend="moe_fuse"), prints what was rewritten
and the parity of loss, logits and gradients, and leaves the debug dumps in a
folder. Runs on CPU by default and on the GPU when one is present.

    python examples/qwen3_moe.py [--debug-dir DIR] [--inner inductor|aot_eager|eager]
"""

import argparse
import copy
import os

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def tiny_model(device, dtype):
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # transformers starts the router at zero: make routing non-trivial
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    return model.to(device=device, dtype=dtype)


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug-dir", default="moe_fuse_debug")
    cuda = torch.cuda.is_available()
    # On CPU, Inductor's C++ compile of the whole model takes a minute: aot_eager shows the same rewrite.
    parser.add_argument("--inner", default="inductor" if cuda else "aot_eager")
    args = parser.parse_args()

    if "moe_fuse" not in torch._dynamo.list_backends(exclude_tags=()):
        # A source checkout that was not pip-installed has no entry point: register by hand.
        from moe_fuse.backend import moe_fuse_backend

        torch._dynamo.register_backend(moe_fuse_backend, "moe_fuse")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = tiny_model(device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device=device)
    print(f"tiny Qwen3-MoE on {device} ({dtype}), inner backend {args.inner}")

    loss, logits, grads = step(model, ids)
    options = {"moe_fuse.inner": args.inner, "moe_fuse.debug_dir": args.debug_dir}
    compiled = torch.compile(model, backend="moe_fuse", options=options)
    loss2, logits2, grads2 = step(compiled, ids)

    with open(os.path.join(args.debug_dir, "summary.txt")) as f:
        print(f.read().rstrip())
    if dtype == torch.float32:
        print(f"loss   eager {loss.item():.6f}  moe_fuse {loss2.item():.6f}")
        print(f"logits relative error vs eager {rel(logits2, logits):.2e}")
        worst = max(grads, key=lambda n: rel(grads2[n], grads[n]))
        print(f"gradients: {len(grads)} tensors, worst relative error {rel(grads2[worst], grads[worst]):.2e} ({worst})")
    else:
        # In bf16 two correct implementations differ by rounding, and a rounding difference can
        # flip a near-tie in a later layer's top-k: judge both against the same model in fp32.
        loss32, logits32, grads32 = step(copy.deepcopy(model).float(), ids)
        print(f"loss   fp32 {loss32.item():.6f}  eager bf16 {loss.item():.6f}  moe_fuse bf16 {loss2.item():.6f}")
        print("relative error vs fp32 eager        eager bf16   moe_fuse bf16")
        print(f"  logits                            {rel(logits, logits32):.2e}     {rel(logits2, logits32):.2e}")
        for name in grads32:
            if "mlp" in name:
                print(f"  grad {name:<30} {rel(grads[name], grads32[name]):.2e}     {rel(grads2[name], grads32[name]):.2e}")
    print(f"debug dumps (before.py, after.py, report.json, summary.txt) in {os.path.abspath(args.debug_dir)}/")


if __name__ == "__main__":
    main()
