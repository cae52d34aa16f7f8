"""The experts kernels at Qwen3-30B-A3B's layer size on the GPU, both kernel paths, against float64."""

import pytest
import torch

from gpu_cases import H, check, forward_backward, make_case, needs_sm90, poisoned, ref64

from moe_fuse import config, dispatch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["grouped_mm", "triton"])
@pytest.mark.parametrize("T, routing, weights_dtype", [
    (4096, "uneven", None),            # torch._grouped_mm for the row-ragged GEMMs (below ragged_min_rows)
    (16384, "uneven", None),           # the Triton ragged GEMM
    (4096, "sentinels", None),         # expert parallelism: slots of other ranks skipped
    (4096, "uneven", torch.float32),   # routing weights kept in fp32 (Mixtral, DeepSeek, GLM)
    (1, "uneven", None),               # decode
])
def test_training_forward_backward(path, T, routing, weights_dtype, monkeypatch):
    if path == "grouped_mm":
        needs_sm90()
    case = make_case(T, routing, weights_dtype=weights_dtype, seed=T)
    want = ref64(*case)
    with config.patch(grouped_mm=path == "grouped_mm"):
        assert dispatch.uses_grouped_mm(*case[:2], *case[3:5]) == (path == "grouped_mm")
        with poisoned(monkeypatch):
            got = forward_backward(*case)
        check(got, want, forward_backward(*case))


@pytest.mark.parametrize("inference_grouped_mm", [False, True])
def test_forward_keeping_nothing(inference_grouped_mm, monkeypatch):
    """The forward of inference and checkpointed layers: the fused Triton GEMMs, or the grouped_mm path."""
    needs_sm90()
    x, ids, w, wgu, wd, dy = make_case(16384)
    want = ref64(x, ids, w, wgu, wd, dy)[:1]
    with config.patch(inference_grouped_mm=inference_grouped_mm):
        with poisoned(monkeypatch):
            y = dispatch.experts_forward(x, ids, w, wgu, wd)
        check([y], want, [dispatch.experts_forward(x, ids, w, wgu, wd)])


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 5e-3), (torch.float32, 1e-3)])
def test_triton_path_other_dtypes(dtype, tol, monkeypatch):
    case = make_case(512, dtype=dtype)
    with poisoned(monkeypatch):
        got = forward_backward(*case)
    check(got, ref64(*case), tol=tol)


@pytest.mark.parametrize("path", ["grouped_mm", "triton"])
def test_strided_inputs(path, monkeypatch):
    """x a strided view, dy of stride 0 (the gradient of a sum)."""
    if path == "grouped_mm":
        needs_sm90()
    x, ids, w, wgu, wd, _ = make_case(4096)
    x_view = torch.empty(x.shape[0], 2 * H, device="cuda", dtype=x.dtype)[:, ::2]
    x_view.copy_(x)
    dy = torch.ones(1, 1, device="cuda", dtype=x.dtype).expand(x.shape[0], H)
    with config.patch(grouped_mm=path == "grouped_mm"), poisoned(monkeypatch):
        got = forward_backward(x_view, ids, w, wgu, wd, dy)
    check(got, ref64(x, ids, w, wgu, wd, dy))


def test_ragged_gemm_is_grouped_mm_bit_for_bit():
    """The Triton ragged GEMM (ragged_min_rows=0) and torch._grouped_mm give the same bits on the grouped_mm path."""
    needs_sm90()
    case = make_case(4096)
    with config.patch(ragged_min_rows=0):
        ragged = forward_backward(*case)
    with config.patch(ragged_gemm=False):
        cutlass = forward_backward(*case)
    assert all(torch.equal(a, b) for a, b in zip(ragged, cutlass))


def test_op_on_cuda_agrees_with_its_fake():
    """torch.ops.moe_fuse.experts / experts_backward on CUDA: opcheck (schema, fake implementation, autograd)."""
    from torch.library import opcheck

    import moe_fuse.ops  # noqa: F401  (registers the ops)

    x, ids, w, wgu, wd, dy = make_case(256)
    req = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    for save_h in (False, True):
        opcheck(torch.ops.moe_fuse.experts.default, (req(x), ids, req(w), req(wgu), req(wd), save_h))
    _, h, xs, routing, aw = torch.ops.moe_fuse.experts(x, ids, w, wgu, wd, True)
    opcheck(torch.ops.moe_fuse.experts_backward.default, (dy, x, ids, w, wgu, wd, h, xs, routing, aw, "silu"))
    assert h.shape[0] == ids.numel() and routing.numel() > 0 and (xs.numel() > 0) == (aw.numel() > 0)
