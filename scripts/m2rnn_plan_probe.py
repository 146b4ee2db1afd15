"""Probe (not a receipt): the M2RNN scan's launch plan (kernels/m2rnn.plan_block_k and the longest-first launch
order) against every fixed block of state rows, at document layouts the plan must get right: even documents, bench
compile's seeded-random ones (one long document among short ones), one document a row over few heads, and bench
m2rnn's wide points. Each row: forward and forward+backward, median ms with its p20-p80 spread
(profiling.time_spread_ms), the blocks the plan took (forward, backward), and the scan's kernels by name.

    PYTHONPATH=. python scripts/m2rnn_plan_probe.py [--out DIR]

Writes DIR/m2rnn_plan_probe.json as it goes (stamped with the device, versions and the project's commit). The
plan's cost model (PLAN_COST_US) was fitted to this probe's rows on an H100.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

from megacpp_lab.bench.harness import ModelShape, make_batch
from megacpp_lab.kernels.m2rnn import m2rnn_scan, plan_block_k, plan_bwd_block_k
from megacpp_lab.profiling import kernel_times_ms, time_spread_ms
from megacpp_lab.receipts import stamp
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens

# (label, B, T, H, K, V, documents a row, seeded-random lengths (make_batch's seed) or None for even ones)
LAYOUTS = (
    ("base R block, 8 even documents a row", 4, 4096, 16, 64, 16, 8, None),
    ("base R block, bench compile's batch", 4, 4096, 16, 64, 16, 8, 0),
    ("base R block, another seeded batch", 4, 4096, 16, 64, 16, 8, 1),
    ("one document a row, 8 heads", 2, 4096, 8, 64, 16, 1, None),
    ("bench m2rnn: B=16 S=1024 H=32 V=32", 16, 1024, 32, 64, 32, 1, None),
    ("bench m2rnn: B=4 S=8192 H=4 V=32, 16 seeded documents", 4, 8192, 4, 64, 32, 16, 0),
    ("H=16 V=64, 8 seeded documents a row", 4, 4096, 16, 64, 64, 8, 0),
)
BLOCKS = (0, 16, 32, 64)  # 0: the plan


def _context(B: int, T: int, docs: int, seed: int | None):
    if seed is not None:
        _, doc_ids, _ = make_batch(ModelShape("base", B, T, docs), 32768, "cuda", seed=seed)
        return build_context(doc_ids)
    cu = torch.linspace(0, B * T, B * docs + 1, device="cuda").round().to(torch.int32)
    return build_context(doc_ids_from_cu_seqlens(cu, B, T), cu_seqlens=cu)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows: list[dict] = []
    out = Path(args.out, "m2rnn_plan_probe.json")
    for label, B, T, H, K, V, docs, seed in LAYOUTS:
        ctx = _context(B, T, docs, seed)
        lengths = ctx.doc_lengths
        in_order = dataclasses.replace(ctx, longest_first=torch.arange(ctx.n_seqs + 1, device="cuda", dtype=torch.int32))
        g = torch.Generator(device="cuda").manual_seed(0)

        def mk(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16).requires_grad_(True)

        q, k, v = mk(B, T, H, K, scale=K**-0.5), mk(B, T, H, K, scale=K**-0.5), mk(B, T, H, V)
        f = (torch.rand(B, T, H, device="cuda", generator=g) * 0.5 + 0.45).requires_grad_(True)
        W = mk(H, V, V, scale=0.5 / V**0.5)
        dy = torch.randn(B, T, H, V, device="cuda", generator=g).to(torch.bfloat16)
        plan = {"fwd": plan_block_k(lengths, H, K, V, q.device), "bwd": plan_bwd_block_k(lengths, H, K, V, q.device)}
        contenders = [(bk, "longest first", ctx) for bk in BLOCKS] + [(0, "in order", in_order)]
        for bk, order, c in contenders:

            def fwd(c=c, bk=bk) -> torch.Tensor:
                with torch.no_grad():
                    return m2rnn_scan(q, k, v, f, W, ctx=c, block_k=bk)

            def fwd_bwd(c=c, bk=bk) -> tuple[torch.Tensor, ...]:
                return torch.autograd.grad(m2rnn_scan(q, k, v, f, W, ctx=c, block_k=bk), [q, k, v, f, W], dy)

            fwd_bwd()
            row = {"layout": label, "B": B, "T": T, "H": H, "K": K, "V": V, "docs_per_row": docs, "seed": seed,
                   "longest": max(lengths), "block_k": bk or "plan", "plan": plan, "launch_order": order,
                   "fwd": time_spread_ms(fwd, device="cuda"), "fwd_bwd": time_spread_ms(fwd_bwd, device="cuda"),
                   "kernels": kernel_times_ms(fwd_bwd)}  # fmt: skip
            rows.append(row)
            f_, fb = row["fwd"], row["fwd_bwd"]
            print(f"{label[:48]:48s} bk={str(bk or 'plan'):4s} {order:13s} fwd {f_['ms']:.3f} [{f_['ms_p20']:.3f}, "
                  f"{f_['ms_p80']:.3f}]  fwd+bwd {fb['ms']:.3f} [{fb['ms_p20']:.3f}, {fb['ms_p80']:.3f}]  plan "
                  f"{plan['fwd']}/{plan['bwd']}", flush=True)  # fmt: skip
            out.write_text(json.dumps({**stamp("cuda"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
