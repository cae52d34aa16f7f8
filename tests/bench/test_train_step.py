"""bench/train_step.py on a tiny Qwen3-MoE causal LM: eager, Inductor (aot_eager here) and moe_fuse without
checkpointing, without an attention mask and with right padding."""


def test_tiny_model(run_bench, check_provenance):
    run = run_bench("train_step.py", "--variants", "eager,inductor,moe_fuse", "--ckpt", "off", "--steps", "1",
                    "--mask", "none,pad")
    data = run.json()
    check_provenance(data["meta"], "train_step.py")
    assert {"layers", "tokens", "batch", "seq", "params", "dtype"} <= data["meta"].keys()
    assert [(r["mask"], r["variant"]) for r in data["rows"]] == [
        (m, v) for m in ("none", "pad") for v in ("eager", "inductor", "moe_fuse")]
    padded = {r["variant"]: r for r in data["rows"] if r["mask"] == "pad"}
    rows = {r["variant"]: r for r in data["rows"] if r["mask"] == "none"}
    for name, r in [*rows.items(), *padded.items()]:
        assert r["status"] == "ok" and r["ckpt"] == "off", r.get("error")
        assert r["fwdbwd_ms"] > 0 and r["adamw_ms"] > 0 and r["step_ms"] > 0
        assert r["tok_s"] > 0 and r["x_eager"] > 0 and r["x_inductor"] > 0
        assert len(r["losses"]) == 2  # the first step, then one more
        assert r["loss_ok"] and r["first_loss_rel_diff"] <= 1e-4  # same seed, weights and ids; fp32
    # every MoE layer's experts and router rewritten, and the tiny model's constant causal SDPA mask
    assert rows["moe_fuse"]["rewrites"] == {"causal_sdpa_mask": 2, "grouped_mm_experts": 2, "softmax_topk_router": 2}
    assert rows["moe_fuse"]["graph_breaks"] == 0 and rows["moe_fuse"]["compile_s"] is not None
    # the training steps move the weights, the same way under every variant
    assert rows["eager"]["losses"][-1] < rows["eager"]["losses"][0]
    for name in ("inductor", "moe_fuse"):
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(rows[name]["losses"], rows["eager"]["losses"]))
    # padded rows: labels -100 there, the same losses under every variant; on the CPU the padded mask stays a mask
    for name in ("inductor", "moe_fuse"):
        assert padded[name]["loss_ok"], padded[name]
    assert padded["eager"]["losses"][0] != rows["eager"]["losses"][0]
    assert padded["moe_fuse"]["rewrites"] == {"grouped_mm_experts": 2, "softmax_topk_router": 2}
    md = run.md()
    assert "| none | off | moe_fuse | ok |" in md and "| pad | off | moe_fuse | ok |" in md
    for name, r in rows.items():  # the whole loss curve of each variant
        assert f"| none | off | {name} | " + " | ".join(f"{x:.4f}" for x in r["losses"]) + " |" in md
