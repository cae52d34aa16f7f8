"""bench/train_step.py on a tiny Qwen3-MoE causal LM: eager, Inductor (aot_eager here) and moe_fuse, one timed
configuration without checkpointing."""


def test_tiny_model(run_bench, check_provenance):
    run = run_bench("train_step.py", "--variants", "eager,inductor,moe_fuse", "--ckpt", "off", "--steps", "1")
    data = run.json()
    check_provenance(data["meta"], "train_step.py")
    assert {"layers", "tokens", "batch", "seq", "params", "dtype"} <= data["meta"].keys()
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "inductor", "moe_fuse"}
    for name, r in rows.items():
        assert r["status"] == "ok" and r["ckpt"] == "off", r.get("error")
        assert r["fwdbwd_ms"] > 0 and r["adamw_ms"] > 0 and r["step_ms"] == r["fwdbwd_ms"] + r["adamw_ms"]
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
    md = run.md()
    assert "| off | moe_fuse | ok |" in md
    for name, r in rows.items():  # the whole loss curve of each variant
        assert f"| off | {name} | " + " | ".join(f"{x:.4f}" for x in r["losses"]) + " |" in md
