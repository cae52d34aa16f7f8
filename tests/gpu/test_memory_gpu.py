"""What moe_fuse's memory settings save on a compiled Qwen3-30B-A3B block at T=4096, measured by the CUDA
allocator: keep_rows=False holds S (H + I) fewer elements from the forward to the backward; the backward split in
three ops frees h and aw after the first, so its peak is lower."""

import pytest
import torch

from gpu_cases import H, I, K, needs_sm90, qwen3_block

from moe_fuse import config

pytestmark = pytest.mark.gpu
T = 4096
S, BF16 = T * K, 2


def held_and_backward_peak(settings):
    """(bytes held from the forward to the backward, the backward's peak over what was allocated before it)."""
    block, x, dy = qwen3_block(T)
    x.requires_grad_()
    torch._dynamo.reset()
    with config.patch(settings):
        fn = torch.compile(block, backend="moe_fuse")
        fn(x).backward(dy)  # compile
        for t in (x, *block.parameters()):
            t.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = fn(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        y.backward(dy)
        torch.cuda.synchronize()
        return held, torch.cuda.max_memory_allocated() - start


def test_keep_rows_off_holds_less():
    needs_sm90()
    kept, _ = held_and_backward_peak({})
    lean, _ = held_and_backward_peak({"keep_rows": False})
    assert kept - lean >= 0.9 * S * (H + I) * BF16, (kept, lean)


def test_split_backward_lowers_the_peak():
    needs_sm90()
    _, split = held_and_backward_peak({})
    _, one_op = held_and_backward_peak({"split_backward": False})
    assert one_op - split >= 0.5 * S * 3 * I * BF16, (one_op, split)  # h [S, 2I] and aw [S, I]
