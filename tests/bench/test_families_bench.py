"""bench/families.py on tiny blocks of three families: a sigmoid router with a shared expert (GLM-4.5), biases and
interleaved gate / up rows (gpt-oss), every token through every expert (Llama 4); and the forward alone."""

import pytest


def test_training_step(run_bench, check_provenance):
    run = run_bench("families.py", "--families", "glm4_moe,gpt_oss,llama4", "--variants", "inductor,moe_fuse")
    data = run.json()
    check_provenance(data["meta"], "families.py")
    rows = {(r["family"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(f, v) for f in ("glm4_moe", "gpt_oss", "llama4") for v in ("inductor", "moe_fuse")}
    assert rows["glm4_moe", "moe_fuse"]["rewrites"] == ["grouped_mm_experts", "sigmoid_topk_router"]
    assert rows["gpt_oss", "moe_fuse"]["rewrites"] == ["grouped_mm_experts", "topk_softmax_router"]
    assert rows["llama4", "moe_fuse"]["rewrites"] == ["dense_experts"]
    for r in rows.values():
        assert r["status"] == "ok" and r["mode"] == "fwd+bwd" and r["ms"] > 0 and r["pct_peak"] > 0
        # y, x and every parameter's gradient, within fp32 rounding of the fp32 block that routes the same way
        assert {"y", "x"} <= r["errors"].keys() and len(r["errors"]) > 4
        assert r["worst_error"] < 1e-5, (r["family"], r["variant"], r["errors"])
    assert "glm4_moe T=32: ok" in run.stdout and "llama4 T=32: ok" in run.stdout
    assert "| llama4 (Llama-4-Scout) | 32 | moe_fuse |" in run.md()


def test_inference(run_bench):
    run = run_bench("families.py", "--families", "olmoe", "--variants", "moe_fuse", "--inference")
    (r,) = run.json()["rows"]
    assert r["mode"] == "fwd" and set(r["errors"]) == {"y"} and r["worst_error"] < 1e-5
    assert r["rewrites"] == ["grouped_mm_experts", "softmax_topk_router"]


def test_unknown_family(capsys):
    import families

    with pytest.raises(SystemExit) as e:
        families.main(["--cpu-smoke", "--families", "qwen3_moe,nope"])
    assert e.value.code == 2 and "unknown families ['nope']" in capsys.readouterr().err
