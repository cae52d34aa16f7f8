"""What the tests of the experts op's gates share (test_swiglu_limit.py, test_gelu_gate.py, test_ungated.py,
test_softcapped_swiglu.py): the clamp bound ``LIMIT`` and a bound clear of every |h| (``clear_limit``), the
naive float64 definition of gated experts, the small kernel cases with their tolerances, and ``check``, the
kernels' outputs against the float64 reference.
"""

import torch
import torch.nn.functional as F

from moe_fuse import reference

from .cases import rel_err

LIMIT = 0.6  # h ~ N(0, 1) in these cases: about half of the up values and a quarter of the gates are clamped
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def naive_experts(x, ids, weights, w_gate_up, w_down, limit, alpha=None, glu=None):
    """Token by token, slot by slot; ``glu(gate, up)`` replaces the gated activation when given (the gate tests')."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            if glu is not None:
                act = glu(gate, up)
            else:
                act = F.silu(gate) * up if alpha is None else gate * torch.sigmoid(gate * alpha) * (up + 1)
            acc = acc + weights[t, j] * (w_down[e] @ act)
        rows.append(acc)
    return torch.stack(rows)


def exact_h(x, ids, w_gate_up):
    return torch.einsum("th,tjnh->tjn", x.double().cpu(), w_gate_up.double().cpu()[ids.cpu()])


def clear_limit(args, dtype):
    """LIMIT, or for a 2-byte dtype a bound near it that no |h| lies within 1% of (bf16 rounds h by <= 0.4%).

    A value on the other side of the bound in the float64 reference than in the kernels' rounded h gets
    or loses its whole gradient (clamp is a step there), so near-bound values would make the comparison
    measure rounding luck. With none near the bound, both sides make the same decisions.
    """
    if dtype == torch.float32:
        return LIMIT
    E = args[3].shape[0]
    h = exact_h(args[0], args[1].clamp(max=E - 1), args[3]).abs().flatten()
    for step in range(200):
        limit = reference.limit_in(dtype, LIMIT + 0.002 * step)
        if not bool(((h - limit).abs() < 0.01 * limit).any()):
            return limit
    raise AssertionError("no clear bound near LIMIT for this case")


KERNEL_CASES = {
    # name: (T, k, E, H, I, dtype, mode)
    "uneven_fp32": (24, 3, 5, 40, 24, torch.float32, "skewed"),
    "uneven_bf16": (12, 2, 5, 40, 8, torch.bfloat16, "skewed"),  # few values: a clear bound exists (clear_limit)
    "ep_sentinels_fp32": (20, 2, 4, 32, 16, torch.float32, "sentinels"),
}


def check(got, want, tol, what):
    for name, g, r in zip(what, got, want):
        assert bool(torch.isfinite(g).all()), f"{name}: some element was never written"
        err = rel_err(g.cpu(), r)
        assert err < tol, f"{name}: rel. error {err:.2e} >= {tol:.0e}"
