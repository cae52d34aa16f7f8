"""spec.py: the dataclasses a match hands from describe to verify and rewrite."""

import ast
import inspect
import json
import math
import re

import pytest
import torch

from moe_fuse import reference, spec
from moe_fuse.spec import Epilogue, ExpertsSpec


def test_each_field_is_declared_once():
    """A field declared twice keeps its first place with the second default: a silent overwrite."""
    tree = ast.parse(inspect.getsource(spec))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)]
        assert len(names) == len(set(names)), f"{cls.name} declares {sorted(n for n in names if names.count(n) > 1)}"


# --------------------------------------------------------------------------- Epilogue

EVERY_KIND = {
    "silu": Epilogue(),
    "gelu_tanh": Epilogue("gelu_tanh"),
    "relu2": Epilogue("relu2"),
    "softcapped_silu(gate_cap=4.0, up_cap=25.0)": Epilogue("softcapped_silu", gate_cap=4.0, up_cap=25.0),
    "silu(swiglu_limit=7.0)": Epilogue(swiglu_limit=7.0),
    "silu(glu_alpha=1.702)": Epilogue(glu_alpha=1.702),
    "silu(interleaved=True)": Epilogue(interleaved=True),
    "silu(swiglu_limit=7.0, glu_alpha=1.702, interleaved=True)": Epilogue(swiglu_limit=7.0, glu_alpha=1.702,
                                                                         interleaved=True),
    "gelu_tanh(swiglu_limit=0.05, interleaved=True)": Epilogue("gelu_tanh", swiglu_limit=0.05, interleaved=True),
    "softcapped_silu(gate_cap=0.3333333333333333, up_cap=1e-05, swiglu_limit=1e+300, interleaved=True)":
        Epilogue("softcapped_silu", gate_cap=1 / 3, up_cap=1e-5, swiglu_limit=1e300, interleaved=True),
    "silu(glu_alpha=-2.5)": Epilogue(glu_alpha=-2.5),
    "silu(glu_alpha=0.0)": Epilogue(glu_alpha=0.0),
}


@pytest.mark.parametrize("encoded", list(EVERY_KIND))
def test_epilogue_round_trips_exactly(encoded):
    e = EVERY_KIND[encoded]
    assert e.encode() == encoded == str(e)
    assert Epilogue.decode(encoded) == e and Epilogue.decode(encoded).encode() == encoded
    back = Epilogue.decode(e.encode())
    for name in ("gate_cap", "up_cap", "swiglu_limit", "glu_alpha"):  # the very floats, bit for bit
        a, b = getattr(e, name), getattr(back, name)
        assert a == b and (a is None or math.copysign(1.0, a) == math.copysign(1.0, b)), name


def test_epilogue_floats_round_trip_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for v in (torch.rand(200, generator=gen, dtype=torch.float64) * 100).tolist() + [5e-324, 1.7976931348623157e308]:
        e = Epilogue(swiglu_limit=v, glu_alpha=-v)
        assert Epilogue.decode(e.encode()) == e and Epilogue.decode(e.encode()).swiglu_limit == v


def test_epilogue_is_canonical():
    """One value, one string: plain SwiGLU is "silu"; ints, -0.0 and the field order are normalized when it is
    made; any other spelling of a value is refused, naming the canonical one."""
    assert Epilogue().encode() == "silu" and Epilogue("silu", None, None, None, None, False).encode() == "silu"
    assert Epilogue(swiglu_limit=7) == Epilogue(swiglu_limit=7.0) and Epilogue(swiglu_limit=7).encode() == \
        "silu(swiglu_limit=7.0)"
    assert Epilogue(glu_alpha=-0.0).encode() == Epilogue(glu_alpha=0.0).encode() == "silu(glu_alpha=0.0)"
    for other, canonical in [
        ("silu()", "silu"),
        ("silu(swiglu_limit=7)", "silu(swiglu_limit=7.0)"),
        ("silu(glu_alpha=1.702, swiglu_limit=7.0)", "silu(swiglu_limit=7.0, glu_alpha=1.702)"),
        ("silu(swiglu_limit=7.00)", "silu(swiglu_limit=7.0)"),
        ("silu(glu_alpha=-0.0)", "silu(glu_alpha=0.0)"),
        ("softcapped_silu(up_cap=25.0, gate_cap=4.0)", "softcapped_silu(gate_cap=4.0, up_cap=25.0)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"epilogue {other!r} is not in canonical form; it is written "
                                                       f"{canonical!r}")):
            Epilogue.decode(other)


def test_epilogue_decode_is_cached():
    Epilogue.decode("silu(swiglu_limit=3.0)")
    assert Epilogue.decode("silu(swiglu_limit=3.0)") is Epilogue.decode("silu(swiglu_limit=3.0)")


@pytest.mark.parametrize("kwargs, message", [
    ({"activation": "gelu"}, "activation must be one of silu, gelu_tanh, relu2 or softcapped_silu"),
    ({"activation": "softcapped_silu(4.0, 25.0)"}, "activation must be one of"),  # the kernels' spelling
    ({"activation": "softcapped_silu"}, "softcapped_silu: the caps must be positive finite numbers, got None, None"),
    ({"activation": "softcapped_silu", "gate_cap": 4.0, "up_cap": 0.0}, "the caps must be positive finite numbers"),
    ({"activation": "softcapped_silu", "gate_cap": math.inf, "up_cap": 1.0}, "the caps must be positive finite"),
    ({"gate_cap": 4.0, "up_cap": 25.0}, "gate_cap and up_cap are the caps of softcapped_silu; activation 'silu' has"),
    ({"swiglu_limit": 0.0}, "swiglu_limit must be a positive finite number, got 0.0"),
    ({"swiglu_limit": -1.0}, "swiglu_limit must be a positive finite number, got -1.0"),
    ({"swiglu_limit": math.inf}, "swiglu_limit must be a positive finite number, got inf"),
    ({"swiglu_limit": math.nan}, "swiglu_limit must be a positive finite number, got nan"),
    ({"glu_alpha": math.inf}, "glu_alpha must be a finite number, got inf"),
    ({"glu_alpha": math.nan}, "glu_alpha must be a finite number, got nan"),
    ({"swiglu_limit": "7"}, "swiglu_limit must be a number, got '7'"),
    ({"glu_alpha": True}, "glu_alpha must be a number, got True"),
    ({"interleaved": 1}, "interleaved must be a bool, got 1"),
    ({"activation": "gelu_tanh", "glu_alpha": 1.702}, "glu_alpha is a gate of its own; it does not combine with "
                                                      "'gelu_tanh'"),
    ({"activation": "relu2", "swiglu_limit": 1.0}, "activation 'relu2' has no gate; swiglu_limit, glu_alpha, "
                                                   "gate_up_bias and interleaved are gate options"),
    ({"activation": "relu2", "interleaved": True}, "activation 'relu2' has no gate"),
])
def test_epilogue_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Epilogue(**kwargs)


@pytest.mark.parametrize("encoded, message", [
    ("", "is not an Epilogue encoding"),
    ("silu(", "is not an Epilogue encoding"),
    ("SiLU", "is not an Epilogue encoding"),
    ("silu(swiglu_limit=7.0))", "is not an Epilogue encoding"),
    ("silu(limit=7.0)", "'limit=7.0' is not one of the fields"),
    ("silu(swiglu_limit=7.0, swiglu_limit=7.0)", "'swiglu_limit=7.0' is not one of the fields"),
    ("silu(swiglu_limit=7.0,glu_alpha=1.0)", "swiglu_limit=7.0,glu_alpha=1.0 is not a number"),
    ("silu(interleaved=False)", "interleaved is written interleaved=True or left out"),
    ("silu(swiglu_limit=seven)", "swiglu_limit=seven is not a number"),
    ("silu(swiglu_limit=inf)", "swiglu_limit must be a positive finite number, got inf"),
    ("softcapped_silu(4.0, 25.0)", "'4.0' is not one of the fields"),
    ("gelu", "activation must be one of"),
])
def test_epilogue_decode_rejects_other_strings(encoded, message):
    with pytest.raises(ValueError, match=re.escape(f"epilogue {encoded!r}") + ".*" + re.escape(message)):
        Epilogue.decode(encoded)


def test_epilogue_gated_softcaps_and_kernel_arguments():
    assert Epilogue().gated and Epilogue("gelu_tanh").gated and not Epilogue("relu2").gated
    capped = Epilogue("softcapped_silu", gate_cap=4.0, up_cap=25.0, swiglu_limit=7.0)
    assert capped.gated and capped.softcaps == (4.0, 25.0) and Epilogue().softcaps is None
    bias = torch.zeros(2, 4)
    assert capped.kernel_kwargs(bias) == {"swiglu_limit": 7.0, "glu_alpha": None,
                                          "activation": reference.softcapped(4.0, 25.0), "gate_up_bias": bias,
                                          "interleaved": False}
    assert Epilogue(glu_alpha=1.702, interleaved=True).kernel_kwargs() == {
        "swiglu_limit": None, "glu_alpha": 1.702, "activation": "silu", "gate_up_bias": None, "interleaved": True}
    for e in EVERY_KIND.values():  # the kernels' arguments name the same epilogue
        kw = e.kernel_kwargs()
        del kw["gate_up_bias"]
        assert Epilogue.from_kernel_args(**kw) == e


def test_experts_spec_json_names_the_epilogue():
    experts = ExpertsSpec(8, 2, 32, 16, torch.bfloat16, torch.float32,
                          epilogue=Epilogue("softcapped_silu", gate_cap=4.0, up_cap=25.0, interleaved=True))
    d = experts.to_json()
    assert (d["activation"], d["gate_cap"], d["up_cap"], d["swiglu_limit"], d["glu_alpha"], d["interleaved"]) == (
        "softcapped_silu", 4.0, 25.0, None, None, True)
    assert d["epilogue"] == "softcapped_silu(gate_cap=4.0, up_cap=25.0, interleaved=True)"
    assert d["dtype"] == "bfloat16" and d["weights_dtype"] == "float32" and d["num_experts"] == 8
    json.dumps(d)
