"""Tiny random Hugging Face MoE models for tests (no downloads: built from configs)."""

import torch


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    args = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    args.update(overrides)
    return Qwen3MoeConfig(**args)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.1):
    """Fill every weight with random values: transformers zero-initialises the router."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def qwen3_moe(dtype=torch.float32, seed=0, expert_parallel_sentinels=False, **overrides):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = randomize(Qwen3MoeForCausalLM(qwen3_moe_config(**overrides)), seed).to(dtype)
    if expert_parallel_sentinels:
        # transformers 5.17 always emits the EP sentinel ops; later 5.x only under expert parallelism.
        for module in model.modules():
            if hasattr(module, "_is_expert_parallel"):
                module._is_expert_parallel = True
    return model


def token_batch(vocab=96, batch=2, seq=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def loss_and_grads(model, ids, **kwargs):
    """Loss, logits, aux loss and every parameter gradient of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    aux = out.aux_loss.detach() if getattr(out, "aux_loss", None) is not None else None
    return out.loss.detach(), out.logits.detach(), aux, grads


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
