"""Two compiled fwd+bwd calls of the SISO Mamba-3 scan at bench ssd's main shape (the ncu target)."""
import sys, torch
from megacpp_lab.bench.mamba3 import FULL_SHAPES, make_inputs
from megacpp_lab.kernels.mamba3 import mamba3_scan
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens
label = sys.argv[1] if len(sys.argv) > 1 else "main"
s = FULL_SHAPES[label]
a, cu = make_inputs(s, torch.bfloat16, "cuda", rank=1)
ctx = build_context(doc_ids_from_cu_seqlens(cu, s.B, s.T), cu_seqlens=cu)
dy = torch.randn((s.B, s.T, s.H, s.P), device="cuda", dtype=torch.bfloat16)
scan = torch.compile(lambda **k: mamba3_scan(**k, ctx=ctx, chunk=s.chunk, kernel="triton"), fullgraph=True)
leaves = [v for v in a.values() if v.requires_grad]
for _ in range(2):
    torch.autograd.grad(scan(**a), leaves, dy)
torch.cuda.synchronize()
print("done", s)
