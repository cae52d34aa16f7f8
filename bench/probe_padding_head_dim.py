"""Probe: key padding as an extra head dimension (q gets a 1, k the padding 0 / -inf, d 128 -> 136) in one SDPA
is_causal call, against SDPA at d 128, per backend; exactness against float64 masked SDPA. Decided: slower (docs/performance.md)."""
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
dev="cuda"; B,H,KV,L,D=1,32,4,8192,128
torch.manual_seed(0)
q=torch.randn(B,H,L,D,device=dev,dtype=torch.bfloat16,requires_grad=True)
k=torch.randn(B,KV,L,D,device=dev,dtype=torch.bfloat16,requires_grad=True)
v=torch.randn(B,KV,L,D,device=dev,dtype=torch.bfloat16,requires_grad=True)
valid=torch.ones(B,L,dtype=torch.bool,device=dev); valid[:, int(L*0.9):]=False
dy=torch.randn(B,H,L,D,device=dev,dtype=torch.bfloat16)
def plain(): return F.scaled_dot_product_attention(q,k,v,is_causal=True,enable_gqa=True)
def aug():
    bias=torch.zeros(B,1,L,1,device=dev,dtype=q.dtype).masked_fill(~valid[:,None,:,None], float("-inf"))
    qa=torch.cat([q, torch.ones_like(q[...,:1]), q.new_zeros(B,H,L,7)],-1)
    ka=torch.cat([k, bias.expand(B,KV,L,1), k.new_zeros(B,KV,L,7)],-1)
    va=torch.cat([v, v.new_zeros(B,KV,L,8)],-1)
    return F.scaled_dot_product_attention(qa,ka,va,is_causal=True,enable_gqa=True,scale=D**-0.5)[...,:D]
def t(f, n=10):
    for _ in range(3): f().backward(dy)
    torch.cuda.synchronize(); s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): q.grad=k.grad=v.grad=None; f().backward(dy)
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e)/n
for name, be in [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("eff", SDPBackend.EFFICIENT_ATTENTION)]:
    for fn_name, fn in [("plain128", plain), ("aug136", aug)]:
        try:
            if be is None: ms = t(fn)
            else:
                with sdpa_kernel(be): ms = t(fn)
            print(name, fn_name, round(ms,3), flush=True)
        except Exception as ex: print(name, fn_name, "ERR", str(ex)[:80])
# exactness of aug (pad rows) vs masked SDPA, small
L2=300; qs,ks,vs=[torch.randn(1,h,L2,D,device=dev,dtype=torch.float64) for h in (H,KV,KV)]
vl=torch.ones(1,L2,dtype=torch.bool,device=dev); vl[:,250:]=False
m=torch.ones(L2,L2,dtype=torch.bool,device=dev).tril() & vl[:,None,None,:]
ref=F.scaled_dot_product_attention(qs,ks,vs,attn_mask=m,enable_gqa=True)
q,k,v,valid,B,L=qs.bfloat16(),ks.bfloat16(),vs.bfloat16(),vl,1,L2
out=aug().double(); print("aug err", ((out-ref).abs().max()/ref.abs().max()).item(), "nan", torch.isnan(out).any().item())
