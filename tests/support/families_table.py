"""Print a Markdown table of what moe_fuse fuses in every transformers MoE family.

    python tests/families_table.py                 # every family in tests/families.py (minutes)
    python tests/families_table.py qwen3_moe gpt_oss

For each family: the experts implementation the model runs, whether its routers and experts
were fused, and, where not, why: the reasons moe_fuse recorded in report.json (rejections), or,
where it recorded none (nothing in the graph looked like a pattern it knows), what the model does
instead, read from the model itself.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import families as F  # noqa: E402


def _short(reason: str) -> str:
    """A rejection reason without graph node names (``L_self_modules_..._gate_up_proj_`` -> gate_up_proj)."""
    reason = re.sub(r"L_self_modules_\w*?_parameters_(\w+?)_\b", r"\1", reason)
    reason = re.sub(r"<built-in function (\w+)>|<function (\w+) at 0x[0-9a-f]+>", lambda m: m.group(1) or m.group(2), reason)
    reason = re.sub(r"\b([a-z_]+?)_\d+\b", r"\1", reason)  # gate_1 -> gate
    if reason.startswith("transformers' 'eager' experts implementation loops"):
        reason = "a Python loop over experts; Dynamo splits it at nonzero()/where(), no graph holds the block"
    elif "runs its experts as a Python loop in its own modeling code" in reason:
        reason = ("a Python loop over experts in its own modeling code; Dynamo splits it at nonzero()/where(), "
                  "no graph holds the block; no experts implementation to switch")
    return reason.strip().rstrip(".")


def _unique(items):
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _methods(cls) -> str:
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
    return re.sub(r"def __init__.*?(?=\n    def |\Z)", "", src, flags=re.S)  # methods, not set-up


def _router_source(model) -> str:
    """Source of what routes tokens in the first MoE block: its router module and the block itself."""
    import torch

    for module in model.modules():
        for name, child in module.named_children():
            if name in ("gate", "router", "gating", "router_gate", "switch") or "router" in type(child).__name__.lower():
                router = "" if type(child) is torch.nn.Linear else _methods(type(child))
                return router + "\n" + _methods(type(module))
    return ""


def describe_router(model) -> str:
    """What the family's router computes, where it is not linear -> softmax -> top-k (read from its code)."""
    src = _router_source(model)
    if not src:
        return "no router: " + ("experts picked by dataset_index" if "dataset_index" in _methods(type(model))
                                else "no router module found")
    body = re.sub(r'"""(?:.|\n)*?"""', "", src)  # no docstrings
    body = "\n".join(line.split("#")[0] for line in body.splitlines())  # no comments
    parts = []
    select_at = min((body.find(s) for s in ("topk(", ".topk", "argmax(") if s in body), default=-1)
    if "hash" in body:
        parts.append("hash routing for some layers")
    if "sparsemixer" in body:
        parts.append("sparsemixer routing")
    if "sigmoid" in body:
        parts.append("sigmoid scores")
    elif "softplus" in body:
        parts.append("softplus scores")
    elif "softmax" in body and 0 <= select_at < body.find("softmax"):
        parts.append("softmax over the selected logits (top-k first)")
    elif "softmax" in body:
        parts.append("softmax scores")
    elif re.search(r"score_fn|scoring_function", body):
        parts.append("a configurable scoring function")
    if "argmax(" in body:
        parts.append("experts picked by argmax")
    if "num_keys" in body:
        parts.append("product-key experts")
    if re.search(r"correction_bias|expert_bias|score_bias|\be_score|moe_statics|balancing_bias", body):
        parts.append("a bias added for the selection")
    if re.search(r"n_group|topk_group|num_expert_group", body):
        parts.append("group-limited top-k")
    if re.search(r"jitter", body):
        parts.append("jitter noise")
    if re.search(r"capacity", body):
        parts.append("expert capacity")
    if re.search(r"zero_expert", body):
        parts.append("zero (identity) experts")
    return ", ".join(parts) or "another scoring"


def _softmax_of_graph_input(debug_dir: str) -> bool:
    """A graph that starts at softmax -> top-k: the router's linear ran in an earlier graph."""
    import glob

    for path in glob.glob(os.path.join(debug_dir, "graph_*", "before.py")):
        with open(path) as f:
            text = f.read()
        for m in re.finditer(r"(\w+)[^=\n]*= torch\.nn\.functional\.softmax\((l_\w+),", text):
            if re.search(rf"torch\.topk\({m.group(1)}\b", text):
                return True
    return False


def row(name: str, debug_dir: str) -> dict:
    result = F.run_family(name, debug_dir)
    model, _ = F.build(name)
    blocks = result.experts_modules
    experts = sum(m["pattern"].endswith("_experts") for m in result.matches)
    # dense_experts takes the router's top-k and scores into the experts' region (Llama 4)
    routers = sum(m["pattern"].endswith("_router") or m["pattern"] == "dense_experts" for m in result.matches)
    # The aux loss's top-k (outside any module) is no router; the eager loop is reported where it breaks.
    in_blocks = [r for r in result.rejected if "(" in r["where"] or r["pattern"].startswith("eager")]
    reasons = []
    if experts < max(blocks, 1):
        why = [_short(r["reason"]) for r in in_blocks if r["pattern"].endswith("_experts") or r["pattern"].startswith("eager")]
        why = why or [f"layout: {r}" for r in result.layout_reasons]
        if not why and blocks == 0:
            why = ["its own experts module, not transformers' experts interface: no known pattern in the graph"]
        reasons += [f"experts: {w}" for w in _unique(why)]
    if routers < max(blocks, 1):
        why = [_short(r["reason"]) for r in in_blocks if r["pattern"].endswith("_router")]
        if not why and _softmax_of_graph_input(debug_dir):
            why = ["a graph break between the router's linear and its softmax/top-k (no graph holds both)"]
        why = why or [f"not linear→softmax→top-k ({describe_router(model)})"]
        reasons += [f"router: {w}" for w in _unique(why)]

    def fused(n):
        if blocks:
            return f"{'yes' if n >= blocks else 'partly' if n else 'no'} ({n}/{blocks})"
        return f"yes ({n})" if n else "no"

    worst = result.worst
    return {
        "family": name,
        "implementation": result.experts_implementation,
        "router": fused(routers),
        "experts": fused(experts),
        "reason": "; ".join(reasons),
        "parity": f"{worst[1]:.1e}",
        "inner": F.inner_backend(name),
    }


def table(rows: list[dict]) -> str:
    lines = ["| family | experts implementation | router fused? | experts fused? | reason if not |",
             "|---|---|---|---|---|"]
    for r in rows:
        reason = r["reason"].replace("|", "\\|")
        lines.append(f"| {r['family']} | {r['implementation']} | {r['router']} | {r['experts']} | {reason} |")
    return "\n".join(lines)


def main(names: list[str]) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch._logging.set_logs(dynamo=50)  # graph-break notes go to stderr otherwise
    rows = []
    for name in names or sorted(F.FAMILIES):
        with tempfile.TemporaryDirectory() as debug_dir:
            rows.append(row(name, debug_dir))
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
