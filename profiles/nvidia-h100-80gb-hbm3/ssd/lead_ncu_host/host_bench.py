"""Where the Mamba-3 ops' host time goes: the op through the dispatcher against its Python body, and the body's parts."""
import statistics, sys, time, json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from megacpp_lab.bench.mamba3 import FULL_SHAPES, make_inputs
from megacpp_lab.kernels import mamba3 as m3
from megacpp_lab.kernels.mamba3 import mamba3_scan

s = FULL_SHAPES[sys.argv[1] if len(sys.argv) > 1 else "main"]
a, cu = make_inputs(s, torch.bfloat16, "cuda", rank=1)
dy = torch.randn((s.B, s.T, s.H, s.P), device="cuda", dtype=torch.bfloat16)
calls = {}
class Rec(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "megacpp" in name:
            calls.setdefault(name, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))
with Rec():
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=s.chunk, kernel="triton")
    torch.autograd.grad(y, [v for v in a.values() if v.requires_grad], dy)
print(list(calls))
def host_us(fn, n=200):
    out = []
    for i in range(n):
        if i % 5 == 0: torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    out.sort(); return {"median": round(statistics.median(out), 1), "p20": round(out[n // 5], 1), "p80": round(out[4 * n // 5], 1)}
res = {}
fa, fk = calls["megacpp.mamba3_scan_fwd.default"]
ba, bk = calls["megacpp.mamba3_scan_bwd.default"]
op_f = torch.ops.megacpp.mamba3_scan_fwd.default
op_b = torch.ops.megacpp.mamba3_scan_bwd.default
with torch.no_grad():
    res["fwd op (dispatcher)"] = host_us(lambda: op_f(*fa, **fk))
    res["fwd body (_init_fn)"] = host_us(lambda: m3.mamba3_scan_fwd._init_fn(*fa, **fk))
    res["bwd op (dispatcher)"] = host_us(lambda: op_b(*ba, **bk))
    res["bwd body (_init_fn)"] = host_us(lambda: m3.mamba3_scan_bwd._init_fn(*ba, **bk))
    x, dt, A, Bm, Cm, inc, bb, cb, w, g, D, mx, cu_steps, cu_sq, chunk, rank, save, keep = fa
    res["fwd: _angles_and_keys"] = host_us(lambda: m3._angles_and_keys(inc, cu_steps, Bm, Cm, bb, cb, x.shape[2], rank, x.dtype))
    theta, k, q = m3._angles_and_keys(inc, cu_steps, Bm, Cm, bb, cb, x.shape[2], rank, x.dtype)
    from megacpp_lab.kernels.ssd import launch_ssd_fwd, Mamba3Operands
    res["fwd: launch_ssd_fwd (2 kernels)"] = host_us(lambda: launch_ssd_fwd(x, dt, A, k, q, cu_sq, chunk, save, w, x.dtype, Mamba3Operands(g, rank, D, mx)))
    res["fwd: _doc_block_totals (1 kernel)"] = host_us(lambda: m3._doc_block_totals(inc, cu_steps, angles=True, reverse=False))
    res["bwd: doc_suffix_sum_triton (2 kernels)"] = host_us(lambda: m3.doc_suffix_sum_triton(theta, cu_steps))
    res["torch.empty x4"] = host_us(lambda: [torch.empty_like(k) for _ in range(4)])
for k_, v in res.items(): print(f"{k_:45s} {v}")
json.dump(res, open(sys.argv[2], "w"), indent=1)
