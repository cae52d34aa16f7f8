"""The grouped_mm path's entry points called as moe_fuse's dispatch calls them: the ragged-GEMM choice from
``config.ragged_gemm`` and ``config.ragged_min_rows`` (which the tests patch)."""

from moe_fuse import dispatch
from moe_fuse.kernels import grouped_mm_path


def grouped_mm_forward(x, ids, *args, **kwargs):
    return grouped_mm_path.experts_forward(x, ids, *args, ragged=dispatch.ragged(ids.numel()), **kwargs)


def grouped_mm_backward(dy, x, ids, *args, **kwargs):
    return grouped_mm_path.experts_backward(dy, x, ids, *args, ragged=dispatch.ragged(ids.numel()), **kwargs)
