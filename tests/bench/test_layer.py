"""bench/layer.py: one run with a config A/B variant and two rounds, and its argument checks."""

import statistics

import pytest

VARIANTS = ["eager", "inductor", "moe_fuse", "moe_fuse:ragged_min_rows=0"]
MODES = ["fwd", "fwd-train", "fwd+bwd"]


@pytest.fixture(scope="module")
def run(run_bench):
    return run_bench("layer.py", "--variants", ",".join(VARIANTS), "--rounds", "2", "--modes", ",".join(MODES))


def test_rows(run, check_provenance):
    data = run.json()
    check_provenance(data["meta"], "layer.py")
    assert data["peak"]["tflops"] > 0
    rows = {(r["variant"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(v, m) for v in VARIANTS for m in MODES}
    for (variant, mode), r in rows.items():
        assert r["status"] == "ok", r
        assert len(r["rounds_ms"]) == 2 and r["ms"] == statistics.median(r["rounds_ms"]) > 0
        assert r["tflops"] > 0 and r["pct_peak"] > 0
        assert r["x_inductor_rounds"] == [a / b for a, b in zip(rows["inductor", mode]["rounds_ms"], r["rounds_ms"])]
        assert r["err"] < 1e-5  # fp32 against eager
        if mode == "fwd+bwd":
            assert set(r["grad_errs"]) == {"x", "gate.weight", "experts.gate_up_proj", "experts.down_proj"}
            assert r["grad_err"] == max(r["grad_errs"].values()) < 1e-5
        if variant.startswith("moe_fuse"):
            assert r["rewrites"] == ["grouped_mm_experts", "softmax_topk_router"]
            assert r["compile_s"] > 0
    assert rows["inductor", "fwd"]["x_inductor"] == 1.0
    assert rows["moe_fuse:ragged_min_rows=0", "fwd"]["settings"] == {"ragged_min_rows": 0}
    assert rows["moe_fuse", "fwd"]["settings"] == {}


def test_table(run):
    md = run.md()
    assert ("| shape | T | mode | variant | status | ms | TFLOP/s | % peak | x inductor | mem MB | held MB | "
            "first call MB | host ms | queued ms | x inductor queued | mallocs / retries |") in md
    assert "| tiny | 64 | fwd+bwd | moe_fuse:ragged_min_rows=0 | ok |" in md
    assert "- tiny T=64 fwd+bwd moe_fuse: " in md  # x inductor by round
    assert "moe_fuse rewrites: moe_fuse: grouped_mm_experts, softmax_topk_router" in md
    assert md in run.stdout.replace("\r", "")
    assert (run.out / "layer_cpu.png").exists() or "(no PNG: matplotlib not importable" in run.stdout


@pytest.mark.parametrize("variants, message", [
    ("moe_fuse:no_such_setting=1", "unknown moe_fuse setting(s) ['no_such_setting']"),
    ("moe_fuse:ragged_min_rows=-1", "moe_fuse setting ragged_min_rows=-1; expected an int >= 0"),
    ("inductor:grouped_mm=False", "settings apply to the moe_fuse variants only"),
    ("moe_fuse:grouped_mm", "'grouped_mm' is not name=value"),
    ("liger", "unknown variant 'liger'"),
])
def test_bad_variant(variants, message, capsys):
    import layer

    with pytest.raises(SystemExit) as e:
        layer.parse_args(["--cpu-smoke", "--variants", variants])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--rounds", "0", "--rounds must be at least 1, got 0"),
    ("--free-gib", "0", "--free-gib must be positive, got 0.0"),
])
def test_counts_must_be_positive(flag, value, message, capsys):
    import layer

    with pytest.raises(SystemExit) as e:
        layer.parse_args(["--cpu-smoke", flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["timed", "measure"])
def test_a_row_that_fails_is_an_error_row(stage, tmp_path, monkeypatch):
    """A variant that fails while timed, or while its memory is measured after (out of memory on a full card), gives
    an error row, with its time where it was timed; the other variants' rows are whole."""
    import json

    import layer

    original = getattr(layer, stage)

    def fails_for_moe_fuse(*args):
        variant = args[1] if stage == "timed" else args[1][1]  # timed(step, v, ...), measure(row, (fn, v, grads), ...)
        if variant.base == "moe_fuse":
            raise RuntimeError("CUDA out of memory (simulated)")
        return original(*args)

    monkeypatch.setattr(layer, stage, fails_for_moe_fuse)
    assert layer.main(["--cpu-smoke", "--variants", "inductor,moe_fuse", "--modes", "fwd,fwd+bwd",
                       "--out", str(tmp_path)]) == 1
    rows = {(r["variant"], r["mode"]): r for r in json.loads((tmp_path / "layer_cpu.json").read_text())["rows"]}
    for mode in ("fwd", "fwd+bwd"):
        assert rows["inductor", mode]["status"] == "ok" and rows["inductor", mode]["ms"] > 0
        bad = rows["moe_fuse", mode]
        assert bad["status"] == "error" and bad["error"].endswith("RuntimeError: CUDA out of memory (simulated)")
        if stage == "timed":
            assert "ms" not in bad and not bad["error"].startswith("timed")
        else:
            assert bad["ms"] > 0 and bad["error"].startswith(f"timed ({bad['ms']:.3f} ms), then ")


def test_queued_ratio_and_allocator_columns():
    """The GPU-only figures (queued ms, mallocs / retries) reach the ratio and the table."""
    import layer

    def row(variant, ms, b2b):
        return dict(shape="30b", T=4096, mode="fwd+bwd", variant=variant, status="ok", flops=10**12, ms=ms,
                    rounds_ms=[ms], host_ms=1.0, b2b_ms=b2b, churn={"mallocs": 0.0, "retries": 0.5})

    rows = [row("inductor", 3.5, 3.6), row("moe_fuse", 2.9, 2.8)]
    peak = {"n": 8192, "tflops": 700.0}
    layer.derive(rows, peak)
    assert rows[1]["x_inductor_b2b"] == 3.6 / 2.8 and rows[0]["x_inductor_b2b"] == 1.0
    md = layer.markdown(rows, peak, {"dtype": "bfloat16", "free_gib": 8.0, "gpu": "H100", "commit": "c",
                                     "source_sha": "s", "torch": "t", "triton": "t", "transformers": "t",
                                     "command": "c"}, 1)
    assert "| 1.000 | 2.800 | 1.29 | 0 / 0.5 |" in md
    assert "to leave 8.0 GiB free before each case" in md
