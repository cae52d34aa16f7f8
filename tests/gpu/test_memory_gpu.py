"""What moe_fuse's memory settings save on a compiled Qwen3-30B-A3B block at T=4096, measured by the CUDA
allocator: keep_activation (off by default) holds S I more elements from the forward to the backward, keep_rows=False
S H fewer; the backward split in three ops frees h and aw after the first, so its peak is lower."""

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
    both, _ = held_and_backward_peak({"keep_activation": True})
    rows, _ = held_and_backward_peak({})  # the default: the sorted rows, not the weighted activation
    lean, _ = held_and_backward_peak({"keep_rows": False})
    assert both - rows >= 0.9 * S * I * BF16, (both, rows)
    assert rows - lean >= 0.9 * S * H * BF16, (rows, lean)


def test_split_backward_lowers_the_peak():
    needs_sm90()
    _, split = held_and_backward_peak({"keep_activation": True})
    _, one_op = held_and_backward_peak({"keep_activation": True, "split_backward": False})
    assert one_op - split >= 0.5 * S * 3 * I * BF16, (one_op, split)  # h [S, 2I] and aw [S, I]


def first_step_peak(backend, tokens, hidden, intermediate):
    """The allocator's peak over compiling and the first forward + backward (from before torch.compile), and the
    patterns rewritten."""
    from moe_fuse.debug import collect_reports

    block, x, dy = qwen3_block(tokens, hidden=hidden, intermediate=intermediate)
    x.requires_grad_()
    torch._dynamo.reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with collect_reports() as reports:
        torch.compile(block, backend=backend)(x).backward(dy)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, sorted(m["pattern"] for r in reports for m in r.matches)


@pytest.mark.parametrize("tokens, hidden, intermediate", [(4096, H, I), (16384, H, I), (4096, 4096, 1536)])
def test_the_first_step_needs_about_inductors_memory(tokens, hidden, intermediate):
    # Verification proves the experts block on config.verify_tokens tokens (235B-A22B's at T=4096: T == H, the
    # hidden size scaled with them): compiling costs no more than the step itself.
    needs_sm90()
    inductor, _ = first_step_peak("inductor", tokens, hidden, intermediate)
    fused, patterns = first_step_peak("moe_fuse", tokens, hidden, intermediate)
    assert patterns == ["grouped_mm_experts", "softmax_topk_router"]
    assert fused <= 1.1 * inductor, (fused / 2**20, inductor / 2**20)
