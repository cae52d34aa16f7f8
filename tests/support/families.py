"""Every transformers model family with a Mixture-of-Experts block, built tiny from its config.

``FAMILIES`` lists them: the families whose modeling file uses transformers'
experts interface (``use_experts_implementation``) and the ones with an MoE
block of their own (Mixtral-era module lists, Switch/NLLB routers, ...).
``build(name)`` returns a small fp32 CPU model with random weights (router
included) and a ``step(model)`` that runs one forward and returns
``(loss, outputs)``; ``loss.backward()`` is left to the caller.

``UNBUILDABLE`` names the families that cannot be built tiny on a CPU machine
at all, with the reason; ``FAMILIES`` does not hold them.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import torch

from .models import randomize

VOCAB = 128
BATCH, SEQ = 2, 12

# Every knob that sizes a model, under every name the families use for it. A
# key is set only where the config class has that field (after its
# attribute_map), so one table serves all of them.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # = heads: multi-head latent attention needs it
    head_dim=8,
    # experts: E = 4, k = 2, I = 16 (few experts: fewer graphs where a family loops over them)
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_topk=2,
    top_k_experts=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    shared_intermediate_size=16,
    moe_shared_expert_intermediate_size=16,
    n_shared_experts=1,
    num_shared_experts=1,
    moe_num_shared_experts=1,
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
    router_jitter_noise=0.0,
    # dense layers before the first MoE layer: none, both layers are MoE
    first_k_dense_replace=0,
    num_dense_layers=0,
    decoder_sparse_step=1,
    # grouped (DeepSeek-V3) routing: one group
    n_group=1,
    topk_group=1,
    # multi-head latent attention
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    # sparse-attention indexers
    index_topk=4,
    index_head_dim=8,
    index_n_heads=2,
    # linear attention / short convolutions
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_head_dim=8,
    linear_num_heads=4,
    # no dropout anywhere: eager and compiled must see the same function
    attention_dropout=0.0,
    hidden_dropout=0.0,
    dropout=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    dropout_rate=0.0,
    activation_dropout=0.0,
    moe_token_dropout=0.0,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass
class Family:
    name: str
    overrides: dict = field(default_factory=dict)
    config: str | None = None  # config class (default: the family's text config, else its config)
    model: str | None = None  # model class (default: XForCausalLM for that config, else XTextModel/XModel)
    inputs: str = "lm"  # "lm": input_ids (+ labels with an LM head); "seq2seq"; "pixels"


def _fam(name, inputs="lm", config=None, model=None, **overrides):
    return Family(name, overrides, config, model, inputs)


# Families using transformers' experts interface (``use_experts_implementation``).
INTERFACE_FAMILIES = [
    _fam("afmoe"),
    _fam("aria"),
    _fam("axk1", mlp_layer_types=["sparse", "sparse"]),
    _fam("axk2", mlp_layer_types=["sparse", "sparse"]),
    _fam("bailing_hybrid", layer_types=["full_attention", "full_attention"]),  # its linear attention alone takes 20 s to compile
    _fam("beam", mlp_layer_types=["sparse", "sparse"]),
    _fam("cohere2_moe"),
    _fam("deepseek_ocr2", mlp_layer_types=["sparse", "sparse"]),
    _fam("deepseek_v2"),
    _fam("deepseek_v3"),
    _fam("deepseek_v32"),
    _fam(
        "deepseek_v4",
        mlp_layer_types=["hash_moe", "moe"],  # one hash-routed, one top-k routed layer
        o_groups=2,
        o_lora_rank=16,
        # transformers 5.24: the router-logits recorder collects nothing for this model and
        # load_balancing_loss_func fails on the empty tuple (IndexError), so no aux loss here.
        output_router_logits=False,
    ),
    _fam("diffusion_gemma", global_head_dim=8),
    _fam("dots1"),
    _fam("dots3_note", mlp_layer_types=["sparse", "sparse"], shared_experts_intermediate_size=16),
    _fam("ernie4_5_moe", moe_layer_start_index=0),
    _fam(
        "ernie4_5_vl_moe",
        moe_intermediate_size=[16, 16],  # text experts, vision experts
        mlp_layer_types=["sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    ),
    _fam("exaone_moe"),
    _fam("flex_olmo"),
    _fam(
        "flint",
        mlp_only_layers=[],
        # transformers 5.24: same empty router-logits recorder as deepseek_v4 (IndexError in the aux loss).
        output_router_logits=False,
    ),
    _fam("gemma4", enable_moe_block=True, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, global_head_dim=8),
    _fam("glm4_moe"),
    _fam("glm4_moe_lite", mlp_layer_types=["sparse", "sparse"]),
    _fam("glm4v_moe", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]}),
    _fam("glm5_next", layer_types=["full_attention", "full_attention"], index_kpool=2, qk_rope_head_dim=0, mlp_layer_types=["sparse", "sparse"]),  # NoPE attention
    _fam("glm_moe_dsa"),
    _fam("gpt_oss"),
    _fam("granitemoe"),
    _fam("granitemoe_swa"),
    _fam(
        "granitemoehybrid",
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_state=8,
        mamba_chunk_size=8,
    ),
    _fam("granitemoeshared"),
    _fam("hunyuan_v1_moe"),
    _fam("hy_v3", mlp_layer_types=["sparse", "sparse"]),
    _fam("hy_v4", mlp_layer_types=["sparse", "sparse"]),
    _fam("hy_v4_vl", mlp_layer_types=["sparse", "sparse"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
    _fam("inkling", swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8),
    _fam("inkling2", unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8),
    _fam("inkling2_loop", unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8),
    _fam("jamba", expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1),
    _fam("kimi_linear", layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"]),
    _fam("kolibri1"),
    _fam("laguna", mlp_layer_types=["sparse", "sparse"]),
    _fam("lara_mini"),
    _fam("lfm2_moe", layer_types=["conv", "full_attention"]),
    _fam("mellum"),
    _fam("mimo_v2_flash", num_key_value_heads=2, mlp_layer_types=["sparse", "sparse"]),  # SWA layers double the kv heads
    _fam("minimax"),
    _fam("minimax_m2"),
    _fam("minimax_m3_vl"),
    _fam("mistral4"),
    _fam("mistral_large4"),
    _fam("mixtral"),
    _fam("muse_spark", moe_hidden_size=32),
    _fam(
        "nemotron_h",
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"],  # mamba, MoE, attention, MoE
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=8,
    ),
    _fam("olmoe"),
    _fam("openai_privacy_filter"),
    _fam("phimoe"),
    _fam("qwen2_moe"),
    _fam("qwen3_5_moe", layer_types=["linear_attention", "full_attention"]),
    _fam("qwen3_moe"),
    _fam("qwen3_next", layer_types=["linear_attention", "full_attention"]),
    _fam("qwen3_omni_moe"),
    _fam("qwen3_vl_moe"),
    _fam("qwen4_exp"),
    _fam("solar_open"),
    _fam("unlimited_ocr", mlp_layer_types=["sparse", "sparse"]),
    _fam("zaya", num_experts_per_tok=1, router_hidden_size=16),  # ZAYA supports top-1 routing only
]

# Families with an MoE block of their own (no experts interface).
OTHER_FAMILIES = [
    _fam(
        "dbrx",
        d_model=32,
        n_heads=4,
        n_layers=2,
        # DbrxAttentionConfig() has no rope_theta by default and the attention reads it; clip_qkv=None
        # makes the attention call clamp(min=None, max=None), an error.
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    _fam(
        "doge",
        is_moe=True,
        num_experts=16,  # product-key experts: E is a square
        # transformers 5.24: renormalising divides the softmax output in place, which eager autograd
        # rejects ("modified by an inplace operation"), so the renorm stays off.
        norm_topk_prob=False,
    ),
    _fam("jetmoe"),
    _fam("llama4"),
    _fam("longcat_flash", num_layers=2, zero_expert_num=2, ffn_hidden_size=64, expert_ffn_hidden_size=16),
    _fam(
        "nllb_moe",
        inputs="seq2seq",
        d_model=32,
        encoder_layers=1,  # one MoE layer each side: 2 layers in all
        decoder_layers=1,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    ),
    _fam("step3p7", mlp_layer_types=["sparse", "sparse"], sliding_window=16, share_expert_dim=16),
    _fam(
        "switch_transformers",
        inputs="seq2seq",
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_heads=4,
        num_layers=1,  # one MoE layer each side: 2 layers in all
        num_decoder_layers=1,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        expert_capacity=64,
        decoder_start_token_id=0,
    ),
    _fam(
        "vitpose_backbone",
        inputs="pixels",
        model="VitPoseBackbone",
        image_size=[32, 24],
        patch_size=[8, 8],
        num_hidden_layers=2,
        part_features=8,
        mlp_ratio=2,
        out_indices=[2],
    ),
]

# Families that cannot be built tiny on this CPU machine at all: name -> why. (None today:
# every family builds from its config class with the overrides above.)
UNBUILDABLE: dict[str, str] = {}

# Families whose training step fails under plain ``torch.compile(backend="aot_eager")``, with no
# moe_fuse involved (torch 2.13, transformers 5.24): the AOT backward graph reshapes the gradient of
# the named projection with ``aten.view``, which a non-contiguous gradient does not allow ("view size
# is not compatible with input tensor's size and stride"). Inductor compiles the same graphs fine.
# For these, moe_fuse's rewritten graph runs with ``moe_fuse.inner="eager"`` (our ops and their
# autograd formulas still run; only AOTAutograd is skipped), and test_families checks that plain
# aot_eager still fails, so an upstream fix shows up as a failing test that says to drop the entry.
_AOT_VIEW = "torch 2.13 aot_eager backward: aten.view of the non-contiguous gradient of {}"
AOT_EAGER_BROKEN: dict[str, str] = {
    "doge": _AOT_VIEW.format("self_attn.dt_proj (DogeAttention)"),
    "lara_mini": _AOT_VIEW.format("linear_attn.in_proj_a (gated delta net)"),
    "qwen3_5_moe": _AOT_VIEW.format("linear_attn.in_proj_a (gated delta net)"),
    "qwen3_next": _AOT_VIEW.format("linear_attn.in_proj_ba (gated delta net)"),
    "qwen4_exp": _AOT_VIEW.format("linear_attn.in_proj_a (gated delta net)"),
}


def inner_backend(name: str) -> str:
    """The ``moe_fuse.inner`` the sweep uses for a family: aot_eager, unless that is broken upstream."""
    return "eager" if name in AOT_EAGER_BROKEN else "aot_eager"

FAMILIES = {f.name: f for f in INTERFACE_FAMILIES + OTHER_FAMILIES if f.name not in UNBUILDABLE}


# --------------------------------------------------------------------------- building


def _module(family: str, kind: str):
    return importlib.import_module(f"transformers.models.{family}.{kind}_{family}")


def _config_class(fam: Family):
    cm = _module(fam.name, "configuration")
    if fam.config:
        return getattr(cm, fam.config)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    names = [n for n in dir(cm) if n.endswith("TextConfig") and not n.startswith("_")]
    texts = [n for n in names if not any(s in n for s in ("Talker", "Thinker"))]
    if texts:
        return getattr(cm, sorted(texts, key=len)[0])
    name = CONFIG_MAPPING_NAMES.get(fam.name)
    if name is None:
        name = next(n for n in dir(cm) if n.endswith("Config") and n != "PreTrainedConfig" and "Pretrained" not in n)
    return getattr(cm, name)


def _model_class(fam: Family, config_cls):
    mm = _module(fam.name, "modeling")
    if fam.model:
        return getattr(mm, fam.model)
    candidates = [getattr(mm, n) for n in dir(mm) if not n.startswith("_") and isinstance(getattr(mm, n), type)]
    candidates = [c for c in candidates if issubclass(c, torch.nn.Module) and getattr(c, "config_class", None) is config_cls]
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        for c in sorted(candidates, key=lambda c: len(c.__name__)):
            if c.__name__.endswith(suffix) and not c.__name__.endswith("PreTrainedModel"):
                return c
    raise LookupError(f"{fam.name}: no model class takes {config_cls.__name__}")


def _field_names(config_cls) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(config_cls)}
    except TypeError:
        import inspect

        return set(inspect.signature(config_cls.__init__).parameters)


def tiny_config(fam: Family):
    config_cls = _config_class(fam)
    fields = _field_names(config_cls)
    amap = getattr(config_cls, "attribute_map", {}) or {}
    kwargs: dict = {}
    for key, value in {**COMMON, **fam.overrides}.items():
        real = next((n for n in (key, amap.get(key)) if n in fields), None)
        if key in fam.overrides:
            kwargs[real or key] = value
        elif real is not None and real not in kwargs:
            kwargs[real] = value
    return config_cls(**kwargs)


def build(name: str, seed: int = 0, **overrides):
    """A tiny fp32 model of family ``name`` with random weights, and its inputs."""
    fam = FAMILIES[name]
    if overrides:
        fam = dataclasses.replace(fam, overrides={**fam.overrides, **overrides})
    config = tiny_config(fam)
    model_cls = _model_class(fam, type(config))
    torch.manual_seed(seed)
    model = model_cls(config)
    randomize(model, seed)
    _randomize_hash_tables(model, seed)
    model.train()
    return model, make_inputs(fam, model)


def _randomize_hash_tables(model, seed: int):
    """Token -> experts tables of hash routers (DeepSeek-V4's ``tid2eid``) start as zeros: every token on
    expert 0 in both slots, routing weights that do not depend on the router (its true gradient is 0, and
    eager and compiled would compare rounding noise). Distinct random experts per token instead."""
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor) and table.dim() == 2 and not table.is_floating_point():
            experts = module.num_experts
            rows = [torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows).to(table.dtype))


def make_inputs(fam: Family, model) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    if fam.inputs == "lm":
        inputs = {"input_ids": ids, "use_cache": False}
        if type(model).__name__.endswith("ForCausalLM"):
            inputs["labels"] = ids
        return inputs
    if fam.inputs == "seq2seq":
        dec = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=gen)
        return {"input_ids": ids, "decoder_input_ids": dec, "use_cache": False}
    if fam.inputs == "pixels":
        cfg = model.config
        size = cfg.image_size if isinstance(cfg.image_size, (tuple, list)) else (cfg.image_size, cfg.image_size)
        pixels = torch.randn((BATCH, cfg.num_channels, *size), generator=gen)
        return {"pixel_values": pixels, "dataset_index": torch.zeros(BATCH, dtype=torch.long)}
    raise ValueError(fam.inputs)


def _first_tensor(out):
    for key in ("logits", "last_hidden_state", "feature_maps"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    raise TypeError(f"no output tensor in {type(out).__name__}")


def step(model, inputs):
    """One forward: (loss, main output, aux loss or None)."""
    out = model(**inputs)
    main = _first_tensor(out)
    loss = getattr(out, "loss", None)
    if loss is None:
        # No LM head: a fixed random projection of the output, so every element matters.
        gen = torch.Generator().manual_seed(2)
        weights = torch.randn(main.shape, generator=gen).to(main)
        loss = (main * weights).sum() / main.numel() ** 0.5
        aux = getattr(out, "aux_loss", None)
        if isinstance(aux, torch.Tensor):
            loss = loss + aux
    aux = getattr(out, "aux_loss", None)
    return loss, main, aux if isinstance(aux, torch.Tensor) else None


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss, main, aux = step(model, inputs)
    loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    return loss.detach(), main.detach(), None if aux is None else aux.detach(), grads


def interface_experts(model) -> list:
    """The experts modules that dispatch through transformers' experts interface."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")]


def experts_implementation(model) -> str:
    """What runs the experts: transformers' experts interface setting, or the family's own module."""
    for module in interface_experts(model):
        return getattr(module.config, "_experts_implementation", None) or "grouped_mm"
    return "own module"


def layout_reasons(modules) -> list[str]:
    """Why these experts modules are not the layout moe_fuse.experts computes (one per such module)."""
    from moe_fuse.integrations.transformers import unsupported_reason

    return [r for m in modules if (r := unsupported_reason(m))]


# --------------------------------------------------------------------------- eager vs moe_fuse

TOLERANCE = 1e-4  # fp32, relative norm


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@dataclass
class Result:
    family: str
    model: str
    experts_implementation: str
    errors: dict  # what -> relative error, for everything compared
    reports: list  # report.json of every graph moe_fuse compiled
    experts_modules: int  # interface experts modules the input reaches (0 for families with their own)
    layout_reasons: list  # why those modules are not the standard layout, one per such module
    fused_experts_calls: int = 0  # moe_fuse.experts calls in one more compiled forward (fused blocks that ran)

    @property
    def worst(self) -> tuple[str, float]:
        return max(self.errors.items(), key=lambda kv: kv[1])

    @property
    def matches(self) -> list[dict]:
        return [m for r in self.reports for m in r["matches"]]

    @property
    def rejected(self) -> list[dict]:
        return [x for r in self.reports for x in r["rejected"]]


def run_family(name: str, debug_dir, inner: str | None = None) -> Result:
    """Eager and ``backend="moe_fuse"`` forward + backward on the same tiny model; every difference."""
    import json
    from pathlib import Path

    model, inputs = build(name)
    ran = set()  # the experts modules this input reaches (e.g. not the vision experts of a text batch)
    hooks = [m.register_forward_hook(lambda mod, *_: ran.add(mod)) for m in interface_experts(model)]
    eager = loss_and_grads(model, inputs)
    for hook in hooks:
        hook.remove()
    torch._dynamo.reset()
    options = {"moe_fuse.inner": inner or inner_backend(name), "moe_fuse.debug_dir": str(debug_dir)}
    try:
        compiled = torch.compile(model, backend="moe_fuse", options=options)
        fused = loss_and_grads(compiled, inputs)
        calls = count_fused_experts_calls(compiled, inputs)
    finally:
        torch._dynamo.reset()
    errors = {"loss": rel_err(fused[0], eager[0]), "output": rel_err(fused[1], eager[1])}
    if eager[2] is not None or fused[2] is not None:
        errors["aux_loss"] = rel_err(fused[2], eager[2]) if eager[2] is not None and fused[2] is not None else float("inf")
    for pname in eager[3].keys() | fused[3].keys():
        if pname in eager[3] and pname in fused[3]:
            errors[f"grad {pname}"] = rel_err(fused[3][pname], eager[3][pname])
        else:
            errors[f"grad {pname}"] = float("inf")  # a gradient on one side only
    reports = [json.loads(p.read_text()) for p in sorted(Path(debug_dir).glob("graph_*/report.json"))]
    return Result(name, type(model).__name__, experts_implementation(model), errors, reports,
                  len(ran), layout_reasons([m for m in interface_experts(model) if m in ran]), calls)


def count_fused_experts_calls(compiled, inputs) -> int:
    """How many fused experts blocks one more forward of the compiled model runs: calls of the experts op's
    CPU implementation, after the first step compiled and verified everything (no probes in this count).
    One compiled graph can serve several layers (glm5_next: a graph break inside the layer), so this
    counts blocks where the reports count matches."""
    from unittest import mock

    from moe_fuse import reference

    calls = []
    real = reference.experts_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(reference, "experts_forward", counting):  # grad mode as compiled: no recompile
        step(compiled, inputs)
    return len(calls)
