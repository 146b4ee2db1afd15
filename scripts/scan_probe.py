"""Probe (not a receipt): the Mamba-3 angle scans (kernels/mamba3.py: doc_angle_sum's int64 fixed-point sum and its
backward's fp32 suffix sum), this tree's two-pass block scan at several tiles against the one-program-per-document
scan of an earlier commit, at the base model's shape and at shapes no bench names.

    git show 56ef312:megacpp_lab/kernels/mamba3.py > build/probe/mamba3_56ef312.py
    PYTHONPATH=. python scripts/scan_probe.py --old build/probe/mamba3_56ef312.py [--out DIR]

Each row: the scan's GPU kernel time (profiling.kernel_times_ms, both passes summed) and its wall time with spread
(profiling.time_spread_ms), and whether its output equals the old scan's (angles: bit for bit; suffix sums: the
largest difference relative to the largest magnitude).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import torch

from megacpp_lab.kernels import mamba3
from megacpp_lab.profiling import kernel_times_ms, time_spread_ms
from megacpp_lab.receipts import stamp
from megacpp_lab.varlen import packed_cu_seqlens

SHAPES = [  # B, T, H, n_a, docs per row
    (4, 4096, 32, 32, 8),  # the base model's M block
    (4, 4096, 32, 32, 1),
    (8, 4096, 16, 32, 8),  # bench ssd's main shape
    (1, 16384, 32, 32, 2),
    (16, 1024, 32, 16, 64),
]
TILES = [(64, 32, 4), (32, 32, 4), (64, 16, 4), (128, 16, 4), (64, 32, 8), (32, 64, 4)]  # tokens, columns, warps


def _load_old(path: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("mamba3_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time(fn) -> dict:  # noqa: ANN001
    return {"gpu_ms": sum(kernel_times_ms(fn).values()), **time_spread_ms(fn, device="cuda")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True, help="an earlier kernels/mamba3.py, its scans the baseline")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    old = _load_old(args.old)
    rows = []
    for B, T, H, n_a, docs in SHAPES:
        g = torch.Generator().manual_seed(0)
        cu = packed_cu_seqlens(B, T, docs, g).cuda()
        inc = (torch.randn(B, T, H, n_a, generator=g) * 0.3).cuda()
        grad = torch.randn(B, T, H, n_a, generator=g).cuda()
        want_a, want_s = old.doc_angle_sum_triton(inc, cu), old.doc_suffix_sum_triton(grad, cu)
        shape = {"B": B, "T": T, "H": H, "n_a": n_a, "docs": docs}
        for kind, fn_old in (("angles", lambda: old.doc_angle_sum_triton(inc, cu)),
                             ("suffix", lambda: old.doc_suffix_sum_triton(grad, cu))):  # fmt: skip
            r = {**shape, "scan": kind, "contender": "one program per document (56ef312)", **_time(fn_old)}
            rows.append(r)
            print(f"{shape} {kind:6s} {r['contender']:40s} gpu {r['gpu_ms']:.4f} ms  wall {r['ms']:.4f}", flush=True)
        for bt, bc, warps in TILES:
            mamba3.SCAN_BLOCK_T, mamba3.SCAN_BLOCK_C, mamba3.SCAN_WARPS = bt, bc, warps
            got_a = mamba3.doc_angle_sum_triton(inc, cu)
            got_s = mamba3.doc_suffix_sum_triton(grad, cu)
            equal = bool(torch.equal(got_a, want_a))
            diff = ((got_s - want_s).abs().max() / want_s.abs().max()).item()
            for kind, fn in (("angles", lambda: mamba3.doc_angle_sum_triton(inc, cu)),
                             ("suffix", lambda: mamba3.doc_suffix_sum_triton(grad, cu))):  # fmt: skip
                r = {**shape, "scan": kind, "contender": f"two-pass {bt}x{bc} {warps} warps", **_time(fn),
                     "angles_equal_old": equal, "suffix_rel_diff_old": diff}  # fmt: skip
                rows.append(r)
                print(f"{shape} {kind:6s} {r['contender']:40s} gpu {r['gpu_ms']:.4f} ms  wall {r['ms']:.4f}  "
                      f"equal {equal} diff {diff:.1e}", flush=True)
        Path(args.out, "scan_probe.json").write_text(json.dumps(
            {**stamp("cuda"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
