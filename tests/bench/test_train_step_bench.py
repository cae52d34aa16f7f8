"""bench/train_step.py --tiny end to end on the CPU (eager + moe_fuse, no checkpointing, one
timed step, with the profile split), and the profile classification rules on GPU kernel names."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "train_step.py"


def test_tiny_eager_vs_moe_fuse(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--backends", "eager,moe_fuse",
           "--ckpt", "off", "--steps", "1", "--warmup", "1", "--profile", "--out", str(tmp_path),
           # Inductor's C++ compile of the whole model takes a minute on CPU: the rewrite is the same
           "--moe-fuse-inner", "aot_eager"]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    data = json.loads((tmp_path / "train_step.json").read_text())
    assert (tmp_path / "train_step.md").exists()
    env_keys = {"torch", "triton", "transformers", "device_name", "layers", "tokens", "batch", "seq", "dtype"}
    assert env_keys <= data["env"].keys()
    # The result names the sources it ran (bench/provenance.py), not only a possibly stale git describe.
    sys.path.insert(0, str(ROOT / "bench"))
    from provenance import source_sha

    assert data["env"]["source_sha"] == source_sha() and data["env"]["git"]
    rows = {r["backend"]: r for r in data["variants"]}
    assert set(rows) == {"eager", "moe_fuse"}
    for r in rows.values():
        assert r["status"] == "ok", r.get("error")
        assert r["ckpt"] == "off"
        for key in ("fwdbwd_ms", "opt_ms", "step_ms", "tok_s_fwdbwd", "tok_s_step", "first_loss", "losses",
                    "first_fwdbwd_s", "x_eager", "loss_rel_diff_vs_eager", "loss_ok", "profile"):
            assert key in r, key
        assert r["fwdbwd_ms"] > 0 and r["opt_ms"] > 0
        assert len(r["losses"]) == 2  # the untimed first step + one timed step
        prof = r["profile"]
        assert set(prof["split_ms"]) == {"moe", "attention", "dense_gemm", "optimizer", "rest"}
        assert prof["top10"] and prof["split_ms"]["optimizer"] > 0 and prof["split_ms"]["moe"] > 0
    assert rows["moe_fuse"]["compile_s"] is not None
    # the tiny model uses SDPA: its constant causal mask is rewritten too (passes/causal_mask.py)
    assert rows["moe_fuse"]["moe_fuse_matches"] == {"grouped_mm_experts": 2, "softmax_topk_router": 2, "causal_sdpa_mask": 2}
    # same seed, same weights, same ids: the first losses agree (fp32 on CPU)
    a, b = rows["eager"]["first_loss"], rows["moe_fuse"]["first_loss"]
    assert abs(a - b) <= 1e-4 * abs(a), (a, b)
    assert rows["moe_fuse"]["loss_ok"]
    # the markdown lists the whole loss curve of each variant, not only its first and last loss
    md = (tmp_path / "train_step.md").read_text()
    for name in ("eager", "moe_fuse"):
        assert f"| off | {name} | " + " | ".join(f"{x:.4f}" for x in rows[name]["losses"]) + " |" in md, md


def _load():
    spec = importlib.util.spec_from_file_location("train_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_classify_rules():
    ts = _load()
    c = ts.classify
    assert c("_gate_up_kernel", []) == "moe"
    assert c("_wgrad_kernel", ["moe_fuse::experts_backward"]) == "moe"
    assert c("_softmax_topk_kernel", ["moe_fuse::router"]) == "moe"
    assert c("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", []) == "attention"
    assert c("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0", []) == "attention"
    assert c("void at::native::elementwise_kernel<128, 4>", ["aten::copy_", "aten::_scaled_dot_product_cudnn_attention"]) == "attention"
    # the experts' grouped GEMMs: by the op that launched them, whatever the kernel is called
    assert c("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...KernelPtrArrayTmaWarpSpecialized>>",
             ["aten::_grouped_mm"]) == "moe"
    assert c("triton_tem_fused__grouped_mm_3", []) == "moe"
    # plain GEMMs are dense, the router's logits GEMM too (in every backend)
    assert c("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", ["aten::mm", "aten::linear"]) == "dense_gemm"
    assert c("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ["aten::mm", "moe_fuse::router"]) == "dense_gemm"
    # elementwise kernels: by the op on the launch chain, or by Inductor's fused-op name
    assert c("void at::native::vectorized_elementwise_kernel<4, silu>", ["aten::silu"]) == "moe"
    assert c("void at::native::vectorized_elementwise_kernel<4, mul>", ["aten::mul"]) == "rest"
    assert c("void at::native::vectorized_elementwise_kernel<4, mul>", ["aten::mul"], True) == "moe"
    assert c("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel", ["aten::sort", "aten::argsort"]) == "moe"
    assert c("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel", ["aten::embedding_dense_backward"]) == "rest"
    assert c("triton_poi_fused_index_mul_silu_4", ["triton_poi_fused_index_mul_silu_4"]) == "moe"
    assert c("triton_red_fused__log_softmax_nll_loss_forward_7", []) == "rest"
    assert c("triton_red_fused__softmax_topk_2", []) == "moe"
    assert c("triton_poi_fused_embedding_dense_backward_0", []) == "rest"
    assert c("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", []) == "rest"
