"""bench/ep_layer.py under torchrun, two CPU ranks (gloo): every variant timed and against the fp32 reference."""

import sys


def test_two_ranks(run_bench, check_provenance):
    run = run_bench("ep_layer.py", "--iters", "2",
                    launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"))
    data = run.json()
    check_provenance(data["meta"], "ep_layer.py")
    assert data["meta"]["world"] == 2 and data["meta"]["command"].startswith("torchrun --nproc-per-node 2 ")
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["unfused", "moe_fuse", "chunked 2", "chunked 4", "graph op 2"]
    for r in rows.values():
        assert r["fwd_bwd_ms"] > 0 and r["fwd_ms"] > 0 and r["x_unfused"] > 0
        assert max(r["err_vs_fp32"].values()) < 1e-5 and max(r["err_vs_unfused"].values()) < 1e-5, r
    assert "| graph op 2 |" in run.md()
