"""Probe (not a receipt): the doc conv backward's first pass (kernels/doc_conv._doc_conv_grad_pre_kernel) at the base
R block's shape, [4, 4096, 2304] bf16 read in place from a [.., 2576] projection row, 8 documents a row, across tile
sizes and warps (each row's error against the first), with the dx pass and the forward beside it.

    PYTHONPATH=. python scripts/conv_tiles_probe.py [OUT_DIR]

Writes OUT_DIR/conv_tiles_probe.json, stamped (device, versions, the project's commit)."""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.testing import do_bench

import megacpp_lab.kernels.doc_conv as dc
from megacpp_lab.receipts import stamp
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens

B, T, D, K, W = 4, 4096, 2304, 4, 2576
g = torch.Generator(device="cuda").manual_seed(0)
proj = torch.randn(B, T, W, device="cuda", generator=g).to(torch.bfloat16)
x = proj[..., :D]
grad = torch.randn(B, T, D, device="cuda", generator=g).to(torch.bfloat16)
weight = (torch.randn(D, 1, K, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
bias = (torch.randn(D, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
cu = torch.linspace(0, B * T, B * 8 + 1, device="cuda").round().to(torch.int32)
pos = build_context(doc_ids_from_cu_seqlens(cu, B, T), cu_seqlens=cu).positions
xs, row = dc._rows(x)
dpre = torch.empty(B, T, D, device="cuda", dtype=torch.bfloat16)
rows = []
ref = None
for bt, bd, warps in [(32, 64, 4), (32, 64, 2), (16, 64, 2), (64, 64, 4), (64, 64, 8), (32, 128, 4), (32, 128, 8),
                      (128, 64, 8), (16, 128, 4), (8, 256, 4), (64, 32, 4), (128, 32, 4)]:
    grid = dc._grid(B * T, D, bt, bd)
    part = torch.empty(grid[0], K + 1, D, device="cuda", dtype=torch.float32)
    def run():
        dc._doc_conv_grad_pre_kernel[grid](grad, xs, pos, weight, bias, dpre, part, B * T, T, D, row, K=K, BT=bt, BD=bd,
                                           HAS_BIAS=True, HAS_POS=True, SILU=True, num_warps=warps)
    try:
        run(); torch.cuda.synchronize()
        s = part.sum(0)
        if ref is None: ref = (dpre.clone(), s.clone())
        err = max((dpre.float() - ref[0].float()).abs().max().item(), ((s - ref[1]).abs().max() / ref[1].abs().max()).item())
        q = do_bench(run, quantiles=[0.5, 0.2, 0.8])
        r = {"BT": bt, "BD": bd, "warps": warps, "ms": q[0], "ms_p20": q[1], "ms_p80": q[2], "err_vs_first": err}
    except Exception as e:
        r = {"BT": bt, "BD": bd, "warps": warps, "error": str(e)[:200]}
    rows.append(r); print(r, flush=True)
dx = torch.empty(B, T, D, device="cuda", dtype=torch.bfloat16)
q = do_bench(lambda: dc._doc_conv_grad_x_kernel[dc._grid(B * T, D, dc.BLOCK_T, dc.BLOCK_D)](
    dpre, pos, weight, dx, B * T, T, D, K=K, BT=dc.BLOCK_T, BD=dc.BLOCK_D, HAS_POS=True, num_warps=4), quantiles=[0.5, 0.2, 0.8])
rows.append({"dx pass": q}); print("dx pass", q)
q = do_bench(lambda: dc._doc_conv_fwd_kernel[dc._grid(B * T, D, dc.BLOCK_T, dc.BLOCK_D)](
    xs, pos, weight, bias, dx, B * T, T, D, row, K=K, BT=dc.BLOCK_T, BD=dc.BLOCK_D, HAS_BIAS=True, HAS_POS=True, SILU=True, num_warps=4), quantiles=[0.5, 0.2, 0.8])
rows.append({"fwd": q}); print("fwd", q)
out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
shape = {"B": B, "T": T, "D": D, "K": K, "row_stride": W, "dtype": "bfloat16", "docs_per_row": 8}
with open(os.path.join(out, "conv_tiles_probe.json"), "w") as fh:
    json.dump({**stamp("cuda"), "shape": shape, "rows": rows}, fh, indent=1)
