"""The fixture that test_keep_rows.py and test_backward_split.py share."""

import pytest

from moe_fuse import config, dispatch


@pytest.fixture
def on_grouped_mm_path(monkeypatch):
    """The op on its CUDA kernels path where this machine has none: grouped_mm_path's functions run on the CPU
    (torch's grouped GEMM fallback, the Triton kernels in the interpreter)."""
    monkeypatch.setattr(dispatch, "grouped_mm_applies", lambda *a: True)
    monkeypatch.setattr(config, "ragged_min_rows", 0)
    monkeypatch.setattr(dispatch, "on_kernels", lambda *a, **k: True)
