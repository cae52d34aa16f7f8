"""Probe (H100, torch 2.11, cuDNN 9.19): causal AND key padding as ONE cuDNN call, aten._scaled_dot_product_cudnn_attention
with is_causal=True and an additive key-padding bias (0 / -inf), GQA; exactness against float64 (ones, right, left,
holes) and fwd+bwd time. Read: the output right (2.0e-3), the gradients wrong in eager; the compiled calls here
fail in Dynamo (the op called directly). Kept in history only."""
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from moe_fuse import attention  # noqa: E402

dev = torch.device("cuda")
op = torch.ops.aten._scaled_dot_product_cudnn_attention


FILL = {"inf": float("-inf"), "min": None}


def bias_of(valid, lq, dtype, form):
    form, fill = form.split("/") if "/" in form else (form, "inf")
    fill = FILL[fill] if FILL[fill] is not None else torch.finfo(dtype).min
    b = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, fill)
    if form == "b11l":
        return b[:, None, None, :].expand(valid.shape[0], 1, lq, valid.shape[1])
    if form == "b1ll":
        return b[:, None, None, :].expand(valid.shape[0], 1, lq, valid.shape[1]).contiguous()
    raise ValueError(form)


def cudnn_bias(q, k, v, valid, scale, form="b11l"):
    out = op(q, k, v, bias_of(valid, q.shape[-2], q.dtype, form), False, 0.0, True, False, scale=scale)[0]
    has_key = valid.cumsum(-1) > 0  # a query with no valid key at or before it: zeros, as SDPA's
    return out * has_key[:, None, :, None].to(out.dtype)


def reference(q, k, v, valid, scale):
    n = q.shape[-2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None, None] & valid[:, None, None, :]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def masks(b, n):
    ones = torch.ones(b, n, dtype=torch.bool, device=dev)
    right, left, holes = ones.clone(), ones.clone(), ones.clone()
    right[0, n - n // 3:] = False
    right[-1, n - 7:] = False
    left[0, : n // 4] = False
    left[-1, :130] = False
    holes[0, 100:300] = False
    holes[-1, ::3] = False
    return {"ones": ones, "right": right, "left": left, "holes": holes}


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def check(form, compiled, n=1000):
    b, hq, hkv, d = 2, 8, 2, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dy = (torch.randn(b, h, n, d, device=dev, generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    fn = torch.compile(cudnn_bias, dynamic=False) if compiled else cudnn_bias
    for name, valid in masks(b, n).items():
        try:
            f64 = [t.double().requires_grad_() for t in (q, k, v)]
            want = reference(*f64, valid, 0.1)
            wg = torch.autograd.grad(want, f64, dy.double())
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            torch._dynamo.reset()
            got = fn(*leaves, valid, 0.1, form) if not compiled else fn(*leaves, valid, 0.1, form)
            gg = torch.autograd.grad(got, leaves, dy)
            errs = [rel(got, want)] + [rel(x, y) for x, y in zip(gg, wg)]
            fin = all(bool(torch.isfinite(t).all()) for t in (got, *gg))
            print(f"  {form} n={n} compiled={compiled} {name:6s} finite={fin} err out/dq/dk/dv "
                  + " ".join(f"{e:.1e}" for e in errs), flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {form} compiled={compiled} {name} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


def timing():
    B, HQ, HKV, L, D = 1, 32, 4, 8192, 128
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, L, HQ, D, device=dev, generator=g, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(B, L, HKV, D, device=dev, generator=g, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    v = torch.randn(B, L, HKV, D, device=dev, generator=g, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    dy = torch.randn(B, HQ, L, D, device=dev, generator=g, dtype=torch.bfloat16)
    ones = torch.ones(B, L, dtype=torch.bool, device=dev)
    pad = ones.clone()
    pad[:, L - L // 10:] = False
    sc = D ** -0.5
    cases = [
        ("sdpa is_causal", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sc,
                                                                            enable_gqa=True), ones),
        ("cudnn bias b11l, ones", lambda q, k, v, m: cudnn_bias(q, k, v, m, sc, "b11l"), ones),
        ("cudnn bias b11l, pad", lambda q, k, v, m: cudnn_bias(q, k, v, m, sc, "b11l"), pad),
        ("cudnn bias b1ll, pad", lambda q, k, v, m: cudnn_bias(q, k, v, m, sc, "b1ll"), pad),
        ("cudnn bias b11l/min, pad", lambda q, k, v, m: cudnn_bias(q, k, v, m, sc, "b11l/min"), pad),
        ("flash+flex, ones", lambda q, k, v, m: attention.causal_prefix_padded_attention(q, k, v, m, sc), ones),
        ("flash+flex, pad", lambda q, k, v, m: attention.causal_prefix_padded_attention(q, k, v, m, sc), pad),
        ("flex, pad", lambda q, k, v, m: attention.causal_padded_attention(q, k, v, m, sc), pad),
    ]
    for name, fn, m in cases:
        try:
            torch._dynamo.reset()
            cf = torch.compile(fn, dynamic=False)

            def fb():
                torch.autograd.backward(cf(q, k, v, m), dy)

            def fo():
                with torch.no_grad():
                    cf(q, k, v, m)
            t = common.time_ms(fb, dev, grad_to_none=(q, k, v), rep_ms=500, warmup=5)
            tf = common.time_ms(fo, dev, rep_ms=200, warmup=3)
            print(f"{name:24s} fwd+bwd {t['ms']:.3f} ms (p20 {t['p20']:.3f} p80 {t['p80']:.3f})  "
                  f"fwd no_grad {tf['ms']:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc(limit=2)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version(), flush=True)
    for form in ("b11l", "b1ll", "b11l/min"):
        for compiled in (False, True):
            check(form, compiled)
    for form in ("b11l", "b11l/min"):
        check(form, True, n=960)
    timing()
