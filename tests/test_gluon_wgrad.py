"""kernels/gluon_wgrad.py on a machine without a GPU.

Gluon has no interpreter, so the kernel's results are checked on the H200 only (bench/check_gluon_wgrad_gpu.py:
edge cases and the layer's two weight gradients bitwise against CUTLASS). Here: the kernel compiles for sm90, fits
in shared memory and ptxas spills nothing; the wrapper refuses what it cannot run, naming the problem; and
grouped_mm_path's GLUON_WGRAD wiring (tests/test_grouped_mm_path.py) takes it where it applies.
"""

import pytest
import torch

from gluon_compile import H100_SHARED_BYTES, sm90_report
from moe_fuse.kernels import gluon_wgrad


def test_compiles_for_sm90_without_spills():
    (r,) = sm90_report("moe_fuse.kernels.gluon_wgrad")
    assert r["shared"] <= H100_SHARED_BYTES, r
    assert r["wgmma"] and r["setmaxnreg"] and not r["cp_async"], r  # TMA loads only
    assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r


def test_refused_by_name():
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    p, q = torch.randn(8, 256, dtype=torch.bfloat16), torch.randn(8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gluon_wgrad.wgrad: needs Gluon and contiguous bf16 CUDA operands .*"
                                         r"got p \(8, 256\) torch.bfloat16, q \(8, 128\) torch.bfloat16"):
        gluon_wgrad.wgrad(p, q, offsets)


@pytest.mark.parametrize("M, N, ok", [(256, 128, True), (1536, 2048, True), (384, 768, True), (192, 128, False),
                                      (256, 64, False)])
def test_runs_on_by_shape(M, N, ok, monkeypatch):
    """Tiles of 128 columns on both sides (checked on meta tensors standing in for CUDA ones)."""
    p, q = torch.empty(64, M, dtype=torch.bfloat16, device="meta"), torch.empty(64, N, dtype=torch.bfloat16,
                                                                                device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert gluon_wgrad.runs_on(p, q) is (ok and gluon_wgrad.HAVE_GLUON)
