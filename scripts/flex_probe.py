"""Probe (not a receipt): flex attention's block sizes at the base model's A block (MLA: 8 heads, q/k head dim 192,
v 128; B=4 T=4096 bf16, the documents' block mask as the model builds it), compiled forward+backward, inductor's
default tiles against kernel_options overrides.

    PYTHONPATH=. python scripts/flex_probe.py [--out DIR] [--docs 8]

Each row: the options, the forward's and the backward's kernel time (profiling.kernel_times_ms, by name), the
whole call's wall time with spread, and the largest difference of the output and each gradient from the default
tiles' (relative to its largest magnitude).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from megacpp_lab.profiling import kernel_times_ms, time_spread_ms
from megacpp_lab.varlen import doc_causal_block_mask, doc_ids_from_cu_seqlens, packed_cu_seqlens

OPTIONS = [  # fwd (BLOCK_M, BLOCK_N, stages, warps), bwd (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, stages, warps)
    {},
    {"fwd": (128, 64, 3, 8), "bwd": (64, 64, 64, 64, 3, 4)},
    {"fwd": (128, 64, 2, 8), "bwd": (64, 64, 64, 64, 2, 8)},
    {"fwd": (64, 128, 3, 4), "bwd": (32, 64, 64, 32, 3, 4)},
    {"fwd": (128, 32, 3, 4), "bwd": (64, 128, 128, 64, 2, 8)},
    {"fwd": (64, 64, 2, 4), "bwd": (32, 128, 128, 32, 2, 8)},
    {"fwd": (128, 128, 2, 8), "bwd": (64, 64, 64, 64, 1, 8)},
]


def _kernel_options(opt: dict) -> dict:
    out = {}
    if "fwd" in opt:
        out.update(zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), opt["fwd"]))
    if "bwd" in opt:
        out.update(zip(("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages",
                        "bwd_num_warps"), opt["bwd"]))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--docs", type=int, default=8)
    args = p.parse_args()
    B, H, T, dqk, dv = 4, 8, 4096, 192, 128
    g = torch.Generator().manual_seed(0)
    cu = packed_cu_seqlens(B, T, args.docs, g).cuda()
    mask = doc_causal_block_mask(doc_ids_from_cu_seqlens(cu, B, T), batch=B, seq_len=T)
    q, k = (torch.randn(B, H, T, dqk, generator=g).cuda().bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g).cuda().bfloat16().requires_grad_()
    dy = torch.randn(B, H, T, dv, generator=g).cuda().bfloat16()
    rows, base = [], None
    for opt in OPTIONS:
        torch._dynamo.reset()
        kw = _kernel_options(opt)
        fn = torch.compile(lambda q, k, v, kw=kw: flex_attention(q, k, v, block_mask=mask, scale=dqk**-0.5,
                                                                 kernel_options=kw or None))  # fmt: skip

        def step():  # noqa: ANN202
            out = fn(q, k, v)
            return out, *torch.autograd.grad(out, (q, k, v), dy)

        try:
            got = [t.float() for t in step()]
        except Exception as e:  # noqa: BLE001  a tile the template refuses: say so and go on
            print(f"{opt}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"options": opt, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            continue
        base = base or got
        diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, base))
        kernels = kernel_times_ms(step)
        fwd = sum(ms for n, ms in kernels.items() if "flex_attention" in n and "backward" not in n)
        bwd = sum(ms for n, ms in kernels.items() if "flex_attention_backward" in n)
        r = {"options": opt, "fwd_kernel_ms": fwd, "bwd_kernel_ms": bwd, **time_spread_ms(step, device="cuda"),
             "rel_diff_from_default": diff, "kernels": kernels}  # fmt: skip
        rows.append(r)
        print(f"{opt}: fwd {fwd:.3f} ms  bwd {bwd:.3f} ms  wall {r['ms']:.3f} [{r['ms_p20']:.3f}, {r['ms_p80']:.3f}]"
              f"  diff {diff:.1e}", flush=True)  # fmt: skip
        Path(args.out, "flex_probe.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "docs": args.docs, "rows": rows},
            indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
