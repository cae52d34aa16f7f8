#!/usr/bin/env python3
"""Which experts blocks backend="moe_fuse" fuses on this GPU, per dtype, for the spellings that only the kernels'
grouped_mm path computes (CUDA sm90+, bf16): GPT-OSS's biases and interleaved rows, Nemotron-H's experts without a
gate. On such a GPU in bf16 they should be fused; in fp32 (or before sm90) left alone with the reason, since the
op would run its reference loop over the experts there.

    PYTHONPATH=. python3 bench/check_pattern_gates_gpu.py

Small random blocks (H 512, 16 experts, top-4), bf16, fp32, and bf16 with a symbolic token count; prints the fused /
left-alone lines of ``moe_fuse.explain``.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_fuse  # noqa: E402


def blocks():
    from transformers import GptOssConfig, NemotronHConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    gpt_oss = GptOssConfig(hidden_size=512, intermediate_size=512, num_local_experts=16, num_experts_per_tok=4)
    nemotron = NemotronHConfig(hidden_size=512, moe_intermediate_size=256, n_routed_experts=16, num_experts_per_tok=4,
                               moe_shared_expert_intermediate_size=512, n_group=1, topk_group=1,
                               mlp_hidden_act="relu2")
    for config in (gpt_oss, nemotron):
        config._experts_implementation = "grouped_mm"
    yield "gpt_oss", lambda: GptOssMLP(gpt_oss)
    yield "nemotron_h", lambda: NemotronHMoE(nemotron, layer_idx=0)


def main():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    for dtype, dynamic in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        for name, build in blocks():
            with torch.device("cuda"):
                block = build().to(dtype)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, 0.02)
            x = torch.randn(1, 256, 512, device="cuda", dtype=dtype, requires_grad=True)
            if dynamic:  # a symbolic token count
                torch._dynamo.mark_dynamic(x, 1)
            report = str(moe_fuse.explain(block, x)).splitlines()
            lines = [line.strip()[:220] for line in report if "fused" in line or "left" in line or "reason" in line]
            print(f"{name} {dtype}{', dynamic tokens' if dynamic else ''}:")
            for line in lines:
                print("   ", line)


if __name__ == "__main__":
    main()
