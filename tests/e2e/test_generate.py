"""Generation: ``torch.compile(model)`` compiles ``forward``, which ``generate`` goes around, so the way to compile
for generation is ``model.forward = torch.compile(model.forward, ...)``, with a static cache (one shape per
phase: the prompt, then every decode step). Greedy tokens equal eager's, and both phases run rewritten."""

import collections

import torch

from moe_fuse.debug import collect_reports
from support.models import qwen3_moe, token_batch


def test_generate_with_a_compiled_forward_and_a_static_cache():
    model = qwen3_moe(attn_implementation="sdpa", output_router_logits=False).eval()
    ids = token_batch(batch=2, seq=6)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0  # a left-padded prompt, as a tokenizer pads for generation
    want = model.generate(ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    model.forward = torch.compile(model.forward, backend="moe_fuse", options={"moe_fuse.inner": "aot_eager"})
    with collect_reports() as reports:
        got = model.generate(ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False,
                             cache_implementation="static")
    assert torch.equal(got, want)
    assert len(reports) == 2  # the prompt's graph and the decode step's, compiled once each
    for report in reports:
        patterns = collections.Counter(m["pattern"] for m in report.matches)
        assert patterns == {"grouped_mm_experts": 2, "softmax_topk_router": 2}, patterns
