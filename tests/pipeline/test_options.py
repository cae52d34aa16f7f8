"""torch.compile(..., options=...) handling: moe_fuse's own keys are checked, the rest go to Inductor."""

import pytest
import torch

from moe_fuse import config
from moe_fuse.backend import parse_options


def test_defaults(monkeypatch):
    monkeypatch.delenv("MOE_FUSE_DEBUG_DIR", raising=False)
    settings, rest = parse_options(None)
    assert rest == {}
    assert settings == {name: s.default for name, s in config.SETTINGS.items()}
    assert settings["inner"] == "inductor" and settings["verify"] is True and settings["debug_dir"] is None


def test_own_keys_are_taken_out_and_the_rest_passed_on():
    settings, rest = parse_options({"moe_fuse.inner": "inductor", "moe_fuse.verify": False, "max_autotune": True})
    assert settings["inner"] == "inductor" and settings["verify"] is False
    assert rest == {"max_autotune": True}
    assert config.verify is True  # parsing changes nothing; the backend patches config for the compile


def test_debug_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_FUSE_DEBUG_DIR", str(tmp_path))
    assert parse_options({})[0]["debug_dir"] == str(tmp_path)
    assert parse_options({"moe_fuse.debug_dir": "elsewhere"})[0]["debug_dir"] == "elsewhere"


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        parse_options({"moe_fuse.debugdir": "x"})
    message = str(err.value)
    assert "unknown moe_fuse option(s) ['moe_fuse.debugdir']" in message
    for key in ("moe_fuse.inner", "moe_fuse.debug_dir", "moe_fuse.verify", "moe_fuse.causal_sdpa", "moe_fuse.ep_chunks",
                "moe_fuse.keep_rows"):
        assert key in message


@pytest.mark.parametrize(
    "options, message",
    [
        ({"moe_fuse.inner": "tvm"}, "moe_fuse.inner='tvm'; expected one of"),
        ({"moe_fuse.verify": "yes"}, "moe_fuse.verify='yes'; expected True or False"),
        ({"moe_fuse.causal_sdpa": 1}, "moe_fuse.causal_sdpa=1; expected True or False"),
        ({"moe_fuse.ep_chunks": 0}, "moe_fuse.ep_chunks=0; expected a positive int or None"),
        ({"moe_fuse.ep_chunks": True}, "moe_fuse.ep_chunks=True; expected a positive int or None"),
        ({"moe_fuse.inner": "eager", "max_autotune": True}, "are for Inductor, but moe_fuse.inner='eager'"),
    ],
)
def test_bad_values(options, message):
    with pytest.raises(ValueError, match=message):
        parse_options(options)


def test_error_reaches_the_user_through_torch_compile():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="moe_fuse", options={"moe_fuse.nope": 1})
    with pytest.raises(Exception, match="unknown moe_fuse option"):
        compiled(torch.randn(2, 4))


def test_mode_needs_inductor():
    from moe_fuse.backend import moe_fuse_backend

    with pytest.raises(ValueError, match="mode='max-autotune' is an Inductor mode, but moe_fuse.inner='eager'"):
        moe_fuse_backend(None, [], mode="max-autotune", options={"moe_fuse.inner": "eager"})


@pytest.mark.parametrize("user_tag", ["", "mine"])
def test_inner_compile_tags_the_compile_caches(monkeypatch, user_tag):
    """A graph cached by another moe_fuse version (other op schemas) must not be reused: the inner
    compile runs with our tag in torch.compile's cache keys, after the user's own, and restores it."""
    import torch._inductor.compile_fx as compile_fx_module

    from moe_fuse import backend

    seen, per_graph = [], []

    def fake_compile_fx(model_, example_inputs_, inner_compile=None, config_patches=None):
        seen.append(torch.compiler.config.cache_key_tag)
        per_graph.append(inner_compile)
        return model_.forward

    def fake_compile_fx_inner(gm, example_inputs, **kwargs):
        seen.append((torch.compiler.config.cache_key_tag, kwargs))

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", fake_compile_fx_inner)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with torch.compiler.config.patch(cache_key_tag=user_tag):
        backend.inner_compile(gm, [torch.randn(2)], None, {})
        assert torch.compiler.config.cache_key_tag == user_tag
        tag = backend.cache_tag()
        # AOTAutograd compiles the backward graph later, outside the backend (here under other settings): it
        # still gets the tag of the compile that made it
        with config.patch(split_backward=False):
            per_graph[0](gm, [torch.randn(2)], is_backward=True)
        assert torch.compiler.config.cache_key_tag == user_tag
    assert tag.startswith("moe_fuse-") and len(tag) == len("moe_fuse-") + 16 + 1 + 12  # sources, settings
    want = f"{user_tag}+{tag}" if user_tag else tag
    assert seen == [want, (want, {"is_backward": True})]


def inductor_config(mode, options=None):
    """What torch.compile(mode=..., options=...) gives Inductor's compile_fx (it refuses both at once for a
    backend other than Inductor)."""
    wrapper = torch._TorchCompileInductorWrapper(mode, None, None)
    wrapper.apply_options(options)
    return wrapper.config


@pytest.mark.parametrize("mode", config.MODES)
@pytest.mark.parametrize("given", ["moe_fuse.mode", "mode="])
def test_mode_reaches_inductor_as_torch_compile_gives_it(monkeypatch, mode, given):
    """moe_fuse.mode, or torch.compile's own mode= with no options (as before), gives the inner Inductor compile
    the settings torch.compile(mode=...) gives Inductor, and the compile's report says so."""
    import torch._inductor.compile_fx as compile_fx_module

    from moe_fuse import debug

    seen = []

    def fake_compile_fx(model_, example_inputs_, inner_compile=None, config_patches=None):
        seen.append(config_patches or {})
        return model_.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    kwargs = {"options": {"moe_fuse.mode": mode}} if given == "moe_fuse.mode" else {"mode": mode}
    with debug.collect_reports() as reports:
        out = torch.compile(lambda x: x * 2, backend="moe_fuse", **kwargs)(torch.ones(3))
    torch._dynamo.reset()
    assert torch.equal(out, torch.full((3,), 2.0))
    assert seen == [inductor_config(mode)]
    assert [r.settings["mode"] for r in reports] == [None if given == "mode=" and mode == "default" else mode]
    assert config.mode is None


def test_mode_with_inductor_options(monkeypatch):
    """The mode's settings first, the compile's Inductor options over them, as torch.compile's own Inductor."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda model_, example_inputs_, inner_compile=None,
                        config_patches=None: seen.append(config_patches) or model_.forward)
    torch._dynamo.reset()
    options = {"moe_fuse.mode": "max-autotune", "coordinate_descent_tuning": False}
    torch.compile(lambda x: x + 1, backend="moe_fuse", options=options)(torch.ones(3))
    torch._dynamo.reset()
    assert seen == [inductor_config("max-autotune", {"coordinate_descent_tuning": False})]
    assert seen == [{"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": False}]


def test_reduce_overhead_is_in_effect_in_the_inner_compile(monkeypatch):
    """Inductor's real compile: its per-graph compile runs with CUDA graphs on (skipped on the CPU) and the
    compiled graph computes the same."""
    import torch._inductor.compile_fx as compile_fx_module

    real, seen = compile_fx_module.compile_fx_inner, []

    def spy(gm, example_inputs, **kwargs):
        seen.append(torch._inductor.config.triton.cudagraphs)
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", spy)
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    compiled = torch.compile(lambda x: torch.relu(x) * 3, backend="moe_fuse", options={"moe_fuse.mode": "reduce-overhead"})
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        torch.testing.assert_close(compiled(x), torch.relu(x) * 3)  # compiled, not read from a cache
    torch._dynamo.reset()
    assert seen == [True]
    assert torch._inductor.config.triton.cudagraphs is False


@pytest.mark.parametrize("options, mode, message", [
    ({"moe_fuse.mode": "fast"}, None, "moe_fuse.mode='fast'; expected one of 'default', 'reduce-overhead', "
                                      "'max-autotune', 'max-autotune-no-cudagraphs' or None"),
    ({}, "fast", "^mode='fast'; expected one of 'default', 'reduce-overhead', 'max-autotune', "
                 "'max-autotune-no-cudagraphs' or None"),
    ({"moe_fuse.mode": "max-autotune"}, "reduce-overhead",
     "mode='reduce-overhead' and moe_fuse.mode='max-autotune': give one"),
    ({"moe_fuse.mode": "reduce-overhead", "moe_fuse.inner": "aot_eager"}, None,
     "mode='reduce-overhead' is an Inductor mode, but moe_fuse.inner='aot_eager'"),
    ({"mode": "reduce-overhead"}, None,  # not Inductor's option: torch.compile's mode= is moe_fuse.mode here
     r"option\(s\) \['mode'\] look like moe_fuse's; moe_fuse options take the prefix 'moe_fuse.' \(moe_fuse.mode\)"),
])
def test_bad_modes(options, mode, message):
    with pytest.raises(ValueError, match=message):
        parse_options(options, mode)


def test_bad_mode_reaches_the_user_through_torch_compile():
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="moe_fuse", mode="fast")
    with pytest.raises(Exception, match="mode='fast'; expected one of 'default', 'reduce-overhead'"):
        compiled(torch.randn(2, 4))
    torch._dynamo.reset()
