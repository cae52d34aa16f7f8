"""moe_fuse.config: one object holds every setting; patches are checked and undone; options reach it."""

import pytest
import torch

from moe_fuse import backend, config, debug


def test_every_setting_has_a_default_value_and_a_doc():
    assert config.values() == {name: s.default for name, s in config.SETTINGS.items()}
    assert all(s.doc and s.check(s.default) for s in config.SETTINGS.values())
    assert config.changed() == {}


def test_patch_sets_and_restores_also_on_error():
    with pytest.raises(RuntimeError):
        with config.patch(ragged_min_rows=0, verify=False):
            assert config.ragged_min_rows == 0 and config.verify is False
            assert config.changed() == {"ragged_min_rows": 0, "verify": False}
            raise RuntimeError
    assert config.ragged_min_rows == 65536 and config.verify is True


def test_patch_as_decorator_and_nested():
    @config.patch(split_backward=False)
    def read():
        with config.patch({"split_backward": True}):
            inner = config.split_backward
        return inner, config.split_backward

    assert read() == (True, False)
    assert config.split_backward is True


@pytest.mark.parametrize("changes, message", [
    ({"ragged_rows": 1}, r"unknown moe_fuse setting\(s\) \['ragged_rows'\]; the settings are:\n  inner:"),
    ({"ragged_min_rows": -1}, "moe_fuse setting ragged_min_rows=-1; expected an int >= 0"),
    ({"grouped_mm": 1}, "moe_fuse setting grouped_mm=1; expected True or False"),
    ({"inference_grouped_mm": "yes"}, "inference_grouped_mm='yes'; expected True, False or None"),
])
def test_patch_checks_names_and_values(changes, message):
    with pytest.raises(ValueError, match=message):
        config.patch(changes)
    assert config.changed() == {}


def test_options_are_the_user_facing_settings_only():
    with pytest.raises(ValueError, match=r"(?s)unknown moe_fuse option\(s\) \['moe_fuse.ragged_gemm'\].*ragged_gemm: "
                                         r"kernel settings, .* moe_fuse.config.patch"):
        config.from_options({"moe_fuse.ragged_gemm": False})
    with pytest.raises(ValueError, match=r"option\(s\) \['verify'\] look like moe_fuse's; moe_fuse options take the "
                                         r"prefix 'moe_fuse.' \(moe_fuse.verify\)"):
        config.from_options({"verify": False})
    assert config.from_options({"moe_fuse.keep_rows": False, "max_autotune": True}) == (
        {"keep_rows": False}, {"max_autotune": True})


def test_every_setting_is_in_the_cache_tag():
    base = backend.cache_tag()
    tags = {base}
    for name, s in config.SETTINGS.items():
        other = {"inner": "eager", "mode": "reduce-overhead", "ragged_min_rows": 1, "debug_dir": "somewhere",
                 "ep_chunks": 2, "inference_grouped_mm": True, "small_step_tokens": 0,
                 "verify_tokens": 0, "inference_min_width": 0}.get(name, not s.default)
        with config.patch({name: other}):
            tags.add(backend.cache_tag())
    assert len(tags) == len(config.SETTINGS) + 1
    assert backend.cache_tag() == base


def test_the_compile_runs_under_its_options_and_reports_them(tmp_path):
    seen = []

    def model(x):
        seen.append((config.verify, config.keep_rows))
        return x * 2

    torch._dynamo.reset()
    with debug.collect_reports() as reports:
        compiled = torch.compile(model, backend="moe_fuse", options={"moe_fuse.verify": False,
                                                                      "moe_fuse.inner": "eager"})
        compiled(torch.randn(3))
    torch._dynamo.reset()
    assert config.verify is True  # restored after the compile
    (report,) = reports
    assert report.settings["verify"] is False and report.settings["inner"] == "eager"
    assert report.to_json()["settings"]["verify"] is False
    assert "settings: inner='eager', verify=False (config)" in report.summary()
    assert "moe_fuse settings:\n" in str(debug.Explanation([report]))
