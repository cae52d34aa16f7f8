"""bench/kernels.py on a tiny shape, the Triton kernels interpreted: every kernel beside its torch row, the same
results."""


def test_kernels(run_bench, check_provenance):
    run = run_bench("kernels.py", "--rounds", "1")
    data = run.json()
    check_provenance(data["meta"], "kernels.py")
    rows = {r["kernel"]: r for r in data["rows"]}
    assert {r["group"] for r in rows.values()} == {"router", "forward", "backward", "GEMM"}
    for name in ("gate_up", "down", "dgrad", "dx"):
        assert rows[f"ragged GEMM {name}"]["peer"] == f"torch._grouped_mm {name}"
    for r in rows.values():
        assert r["ms"] > 0 and len(r["rounds_ms"]) == 1
        if r["peer"]:
            assert r["err"] < 1e-5 and r["x_torch"] > 0, r  # fp32: the kernels compute what torch does
        else:
            assert r["kernel"].startswith("torch")
        assert (r["group"] == "router") == ("tflops" not in r)
    assert "| tiny | 32 | backward | fused Triton (recomputes h) | ok |" in run.md()
    assert all(r["status"] == "ok" for r in rows.values())
