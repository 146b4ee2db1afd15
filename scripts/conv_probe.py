"""Probe (not a receipt): the doc-masked causal depthwise conv with its SiLU (as the layers run it), in its torch form
and its Triton form, compiled and eager, forward+backward, at the widths the `base` model runs it (the R block's q/k/v
conv, 2304 channels; Engram's, 256) and others; then the whole R block (M2RNN at the base model's width) compiled,
forward+backward, with each conv form.

    PYTHONPATH=. python scripts/conv_probe.py [--out DIR] [--layer-only]

nn/primitives.DocCausalDepthwiseConv: `xla_safe` (the K doc-masked shifts, weighted and summed: pointwise work
inductor fuses with the SiLU and its neighbours) and `triton` (kernels/doc_conv.py: one pass forward, one backward).
(`maxtext_depthwise`, F.conv1d over the transposed row, took 1.87 ms of kernels against xla_safe's 0.45 at the R
block's width on an H100 in an earlier run of this probe, and is not timed again.) Each row: median ms with its
p20-p80 spread (profiling.time_spread_ms), the kernels' time by name, and the forms' largest difference (y and each
gradient, relative to its largest magnitude).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from megacpp_lab.model.config import hybrid_preset
from megacpp_lab.nn.m2rnn import M2RNN
from megacpp_lab.nn.primitives import DocCausalDepthwiseConv
from megacpp_lab.profiling import kernel_times_ms, time_spread_ms
from megacpp_lab.receipts import stamp
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens


def _row(impl: str, compiled: bool, B: int, T: int, D: int, docs: int) -> dict:
    torch.manual_seed(0)
    conv = DocCausalDepthwiseConv(D, 4, impl).cuda().to(torch.bfloat16)  # the model's bf16 parameters (apply_precision)
    x = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.linspace(0, B * T, B * docs + 1, device="cuda").round().to(torch.int32)
    ctx = build_context(doc_ids_from_cu_seqlens(cu, B, T), cu_seqlens=cu)
    fn = torch.compile(conv) if compiled else conv
    dy = torch.randn_like(x)

    def fwd_bwd():
        y = fn(x, ctx, silu=True)
        return torch.autograd.grad(y, [x, conv.weight, conv.bias], dy)

    for _ in range(3):
        grads = fwd_bwd()
    y = fn(x, ctx, silu=True)
    return {"impl": impl, "compiled": compiled, "B": B, "T": T, "D": D, "docs": docs,
            "fwd_bwd": time_spread_ms(fwd_bwd, device="cuda"), "kernels": kernel_times_ms(fwd_bwd),
            "y": y.detach().float(), "grads": [g.float() for g in grads]}  # fmt: skip


IMPLS = ("xla_safe", "triton")


def _layer_row(impl: str, B: int, T: int, docs: int) -> dict:
    """The base model's R block mixer (M2RNN, its q/k/v conv with `impl`), compiled, forward+backward in bf16."""
    torch.manual_seed(0)
    cfg = hybrid_preset("base", m2rnn=dict(kernel="triton", conv_impl=impl)).m2rnn
    layer = M2RNN(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(B, T, cfg.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.linspace(0, B * T, B * docs + 1, device="cuda").round().to(torch.int32)
    ctx = build_context(doc_ids_from_cu_seqlens(cu, B, T), cu_seqlens=cu)
    fn = torch.compile(layer)
    dy = torch.randn_like(x)

    def fwd_bwd():
        return torch.autograd.grad(fn(x, ctx=ctx), [x, *layer.parameters()], dy)

    for _ in range(3):
        grads = fwd_bwd()
    return {"layer": "M2RNN (base)", "impl": impl, "compiled": True, "B": B, "T": T, "d_model": cfg.d_model,
            "docs": docs, "fwd_bwd": time_spread_ms(fwd_bwd, device="cuda"), "kernels": kernel_times_ms(fwd_bwd),
            "grads": [g.float() for g in grads]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--layer-only", action="store_true", help="only the R block rows")
    args = p.parse_args()
    rows = []

    def save() -> None:
        # stamp(): the device, torch, triton, the date and the project's commit (or its package's tree hash)
        Path(args.out, "conv_probe.json").write_text(json.dumps({**stamp("cuda"), "rows": rows}, indent=1))

    for B, T, docs in [(4, 4096, 8), (2, 8192, 16)]:
        pair = [_layer_row(impl, B, T, docs) for impl in IMPLS]
        diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(pair[0]["grads"], pair[1]["grads"]))
        for r in pair:
            r.pop("grads")
            r["max_rel_diff_between_forms"] = diff  # of each gradient, against its largest magnitude
            rows.append(r)
            f = r["fwd_bwd"]
            print(f"R block B={B} T={T} docs={docs} compiled {r['impl']:10s} {f['ms']:.3f} ms [{f['ms_p20']:.3f}, "
                  f"{f['ms_p80']:.3f}]  diff {diff:.2e}", flush=True)  # fmt: skip
            for name, ms in list(r["kernels"].items())[:8]:
                print(f"      {ms:7.3f}  {name[:90]}")
        save()
    if args.layer_only:
        return
    for B, T, D, docs in [(4, 4096, 2304, 8), (4, 4096, 256, 8), (8, 4096, 1024, 16), (1, 16384, 2304, 3),
                          (16, 1024, 3072, 64)]:  # fmt: skip
        for compiled in (True, False):
            pair = [_row(impl, compiled, B, T, D, docs) for impl in IMPLS]
            diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip([pair[0]["y"], *pair[0]["grads"]],
                                                                   [pair[1]["y"], *pair[1]["grads"]]))  # fmt: skip
            for r in pair:
                r.pop("y"), r.pop("grads")
                r["max_rel_diff_between_forms"] = diff  # of y and each gradient, against its largest magnitude
                rows.append(r)
                f = r["fwd_bwd"]
                print(f"B={B} T={T} D={D} docs={docs} {'compiled' if compiled else 'eager':8s} {r['impl']:18s} "
                      f"{f['ms']:.3f} ms [{f['ms_p20']:.3f}, {f['ms_p80']:.3f}]  diff {diff:.2e}", flush=True)
                for name, ms in list(r["kernels"].items())[:5]:
                    print(f"      {ms:7.3f}  {name[:90]}")
            save()
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
