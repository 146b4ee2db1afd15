"""Probe (not a receipt): the Mamba-3 angle sums' document scan at bench ssd's main shape, by tile and by arithmetic.

    PYTHONPATH=. python scripts/scan_probe.py [--out DIR]

Times kernels/mamba3's _doc_scan_kernel (the library's: int32 turns forward, fp32 suffix sum backward) over tiles, against a
copy of the same bytes and against probe-only variants: the sum in int32 turns (2**32 a turn, wrap-around is the
mod 2 pi), the suffix sum in fp32, and the forward reading the angle logits and dt itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from megacpp_lab.kernels import mamba3 as m3


@triton.jit
def _turns_scan_kernel(a_ptr, dt_ptr, v_ptr, cu_ptr, out_ptr, C, n_a, BT: tl.constexpr, BC: tl.constexpr,
                       FUSED: tl.constexpr, REVERSE: tl.constexpr, F32: tl.constexpr):  # fmt: skip
    start = tl.load(cu_ptr + tl.program_id(0))
    end = tl.load(cu_ptr + tl.program_id(0) + 1)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = rc < C
    carry = tl.zeros((BC,), dtype=tl.int32 if not F32 else tl.float32)
    for i in range(0, tl.cdiv(end - start, BT)):
        if REVERSE:
            rt = end - (i + 1) * BT + tl.arange(0, BT)
            mt = rt >= start
        else:
            rt = start + i * BT + tl.arange(0, BT)
            mt = rt < end
        at = rt[:, None] * C + rc[None, :]
        m = mt[:, None] & mc[None, :]
        if F32:
            v = tl.load(v_ptr + at, mask=m, other=0.0)
            run = tl.cumsum(v, axis=0, reverse=REVERSE) + carry[None, :]
            carry += tl.sum(v, axis=0)
            tl.store(out_ptr + at, run, mask=m)
        else:
            if FUSED:
                a = tl.load(a_ptr + at, mask=m, other=0.0).to(tl.float32)
                dt = tl.load(dt_ptr + rt[:, None] * (C // n_a) + rc[None, :] // n_a, mask=m, other=0.0)
                e = tl.exp(-2.0 * tl.abs(a))
                th = (1.0 - e) / (1.0 + e)
                turns = tl.where(a < 0, -th, th) * 0.5 * dt
            else:
                turns = tl.load(v_ptr + at, mask=m, other=0.0) * 0.15915494309189535
            frac = turns - tl.floor(turns)
            q = tl.where(m, (frac * 4294967296.0 + 0.5).to(tl.int64).to(tl.int32), 0)
            run = tl.cumsum(q, axis=0) + carry[None, :]
            carry += tl.sum(q, axis=0)
            u = run.to(tl.int64) & 0xFFFFFFFF
            tl.store(out_ptr + at, (u.to(tl.float32) * 1.4629180792671596e-09), mask=m)


def bench(fn) -> dict:  # noqa: ANN001
    p20, med, p80 = do_bench(fn, warmup=25, rep=200, quantiles=[0.2, 0.5, 0.8])
    return {"ms": med, "p20": p20, "p80": p80}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    B, T, H, n_a, docs = 8, 4096, 16, 32, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.arange(0, B * T + 1, T // docs, device="cuda", dtype=torch.int32)
    angles = torch.randn(B, T, H, n_a, device="cuda", generator=g).to(torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(B, T, H, device="cuda", generator=g) - 1)
    inc = torch.tanh(angles.float()) * math.pi * dt[..., None]
    grad = torch.randn_like(inc)
    C = H * n_a
    rows = {"copy_fp32": bench(lambda: inc.clone()), "inc_glue": bench(lambda: torch.tanh(angles.float()) * math.pi * dt[..., None])}
    out = torch.empty_like(inc)
    for bt, bc, w in [(128, 8, 4), (64, 8, 2), (32, 16, 2), (32, 32, 4), (64, 4, 2), (256, 8, 8)]:
        for angles_mode, rev in ((True, False), (False, True)):
            src = inc if angles_mode else grad
            grid = (cu.numel() - 1, triton.cdiv(C, bc))
            f = lambda: m3._doc_scan_kernel[grid](src, cu, out, C, BT=bt, BC=bc, ANGLES=angles_mode, REVERSE=rev,  # noqa: E731
                                                  FIXED_POINT=m3.ANGLE_FIXED_POINT, TURN=m3.ANGLE_TURN, num_warps=w)
            rows[f"lib_{'fwd' if angles_mode else 'bwd'}_bt{bt}_bc{bc}_w{w}"] = bench(f)
        for name, fused, rev, f32, src in (("turns", False, False, False, inc), ("turns_fused", True, False, False, inc),
                                           ("sum_fp32_rev", False, True, True, grad)):
            grid = (cu.numel() - 1, triton.cdiv(C, bc))
            f = lambda: _turns_scan_kernel[grid](angles, dt, src, cu, out, C, n_a, BT=bt, BC=bc, FUSED=fused,  # noqa: E731
                                                 REVERSE=rev, F32=f32, num_warps=w)
            rows[f"{name}_bt{bt}_bc{bc}_w{w}"] = bench(f)
        print(bt, bc, w, {k: round(v["ms"], 4) for k, v in rows.items() if f"_bt{bt}_bc{bc}_w{w}" in k}, flush=True)
    # the turns scan against the library's angles: how far apart (rad), as a check that the variant computes the sum
    ref = m3.doc_angle_sum_triton(inc, cu)
    _turns_scan_kernel[(cu.numel() - 1, C // 8)](angles, dt, inc, cu, out, C, n_a, BT=128, BC=8, FUSED=False,
                                                 REVERSE=False, F32=False, num_warps=4)
    diff = torch.remainder(out.double() - ref.double() + math.pi, 2 * math.pi) - math.pi
    rows["turns_vs_lib_max_abs_rad"] = float(diff.abs().max())
    print({k: (round(v["ms"], 4) if isinstance(v, dict) else v) for k, v in rows.items() if "bt" not in k})
    Path(args.out, "scan_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))


if __name__ == "__main__":
    main()
