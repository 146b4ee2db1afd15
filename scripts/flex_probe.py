"""Probe (not a receipt): compiled flex attention over packed documents at the A block's shapes, torch's default
kernel configuration against launch options (`kernel_options`: fwd_/bwd_ block sizes, stages, warps).

    PYTHONPATH=. python scripts/flex_probe.py [--out DIR]

The A block of the `base` model attends with q/k of 192 channels (d_nope 128 + d_rope 64) and v of 128, 8 heads, over
rows of 4096 tokens cut into documents (varlen.doc_causal_block_mask). Its compiled backward took 1.23 ms a call
against the forward's 0.26 in the H200 trace of the compiled step (profile_base_compiled at 3626dc0): torch picks
one backward configuration for head dims above 128 on sm90. Each row: forward and forward+backward wall ms with
spread (do_bench), the GPU kernels' ms by kernel over 5 calls, and the largest difference of the output and of
each gradient from torch's default configuration's, relative to that tensor's largest magnitude (a configuration
that computes something else shows here).

Beside flex, `varlen` rows run torch's flash varlen kernel (torch.nn.attention.varlen.varlen_attn, torch >= 2.10) over
the documents' cu_seqlens on [B*T, heads, D] leaves, v zero-padded to the q/k head dim (flash needs one head dim),
its max sequence length T ("varlen max=T": what a compiled layer can pass without recompiling per batch) or the
longest document ("varlen max=doc"). `--configs` picks rows by name prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from megacpp_lab.nn.mla import FLEX_KERNEL_OPTIONS
from megacpp_lab.profiling import kernel_times_ms, time_spread_ms
from megacpp_lab.receipts import stamp
from megacpp_lab.varlen import doc_causal_block_mask, doc_ids_from_cu_seqlens, packed_cu_seqlens

SHAPES = [  # B, T, heads, qk dim, v dim, documents per row
    (4, 4096, 8, 192, 128, 8),  # the base model's A block, bench compile's batch
    (4, 4096, 8, 192, 128, 1),
    (2, 8192, 8, 192, 128, 16),
    (8, 2048, 16, 192, 128, 4),
]

def _bwd(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int) -> dict[str, int]:
    return dict(bwd_BLOCK_M1=m1, bwd_BLOCK_N1=n1, bwd_BLOCK_M2=m2, bwd_BLOCK_N2=n2, bwd_num_stages=stages,
                bwd_num_warps=warps)  # fmt: skip


def _fwd(m: int, n: int, stages: int, warps: int) -> dict[str, int]:
    return dict(fwd_BLOCK_M=m, fwd_BLOCK_N=n, fwd_num_stages=stages, fwd_num_warps=warps)


# (name, kernel_options): None is torch's own choice; the lab's own entry read from nn/mla.py, not retyped
CONFIGS: list[tuple[str, dict | None]] = [
    ("default", None),
    ("bwd 32/128/128/32 s3 w8", _bwd(32, 128, 128, 32, 3, 8)),
    ("bwd 32/128/128/32 s4 w8", _bwd(32, 128, 128, 32, 4, 8)),
    ("bwd 32/128/128/32 s2 w8", _bwd(32, 128, 128, 32, 2, 8)),
    ("bwd 32/64/64/32 s3 w8", _bwd(32, 64, 64, 32, 3, 8)),
    ("bwd 32/128/128/32 s3 w4", _bwd(32, 128, 128, 32, 3, 4)),
    ("bwd 32/128/64/32 s3 w8", _bwd(32, 128, 64, 32, 3, 8)),
    ("FLEX_KERNEL_OPTIONS (sm90, bf16, 192/128)", FLEX_KERNEL_OPTIONS[((9, 0), torch.bfloat16, 192, 128)]),
    ("fwd 128/64 s4 w8", _fwd(128, 64, 4, 8)),
    ("fwd 128/32 s3 w8", _fwd(128, 32, 3, 8)),
    ("varlen max=T", None),
    ("varlen max=doc", None),
]


def _varlen_causal() -> dict:
    """varlen_attn's causal keyword: torch 2.10 takes is_causal, later versions window_size=(-1, 0)."""
    from torch.nn.attention.varlen import varlen_attn

    return {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default="0,1,2,3", help="indices into SHAPES")
    p.add_argument("--configs", default="", help="comma-separated name prefixes of CONFIGS to run (default: all)")
    args = p.parse_args()
    prefixes = [c for c in args.configs.split(",") if c]
    configs = [(n, o) for n, o in CONFIGS if not prefixes or any(n.startswith(c) for c in prefixes)]
    torch.manual_seed(0)
    rows = []
    out_path = Path(args.out, "flex_probe.json")
    for si in (int(i) for i in args.shapes.split(",")):
        B, T, Hh, dqk, dv, docs = SHAPES[si]
        cu = packed_cu_seqlens(B, T, docs, torch.Generator().manual_seed(si))
        mask = doc_causal_block_mask(doc_ids_from_cu_seqlens(cu, B, T).cuda())
        q, k = (torch.randn(B, Hh, T, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.randn(B, Hh, T, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(B, Hh, T, dv, device="cuda", dtype=torch.bfloat16)
        shape = {"B": B, "T": T, "heads": Hh, "dqk": dqk, "dv": dv, "docs": docs}
        want = None
        cu_dev = cu.to("cuda", torch.int32)
        max_doc = int(cu.diff().max())
        # the same values as q, k, v on varlen's [B*T, heads, D] layout, leaves of their own
        qt, kt, vt = (t.detach().transpose(1, 2).reshape(B * T, Hh, -1).clone().requires_grad_() for t in (q, k, v))
        dout_t = dout.transpose(1, 2).reshape(B * T, Hh, dv)
        for name, opts in configs:
            torch._dynamo.reset()
            if name.startswith("varlen"):
                from torch.nn.attention.varlen import varlen_attn

                max_len = T if name == "varlen max=T" else max_doc
                causal = _varlen_causal()
                leaves = (qt, kt, vt)

                def run():
                    v_pad = F.pad(vt, (0, dqk - dv))
                    return varlen_attn(qt, kt, v_pad, cu_dev, cu_dev, max_len, max_len, scale=dqk**-0.5, **causal)[..., :dv]

                def fwd():
                    return run().view(B, T, Hh, dv).transpose(1, 2)

                def fwd_bwd():
                    qt.grad = kt.grad = vt.grad = None
                    run().backward(dout_t)

                def grads():
                    return tuple(t.grad.view(B, T, Hh, -1).transpose(1, 2) for t in leaves)
            else:
                attn = torch.compile(flex_attention, fullgraph=True)
                kw = dict(block_mask=mask, scale=dqk**-0.5, **({"kernel_options": opts} if opts else {}))

                def fwd():
                    return attn(q, k, v, **kw)

                def fwd_bwd():
                    q.grad = k.grad = v.grad = None
                    attn(q, k, v, **kw).backward(dout)

                def grads():
                    return (q.grad, k.grad, v.grad)

            try:
                out = fwd()
                fwd_bwd()
                got = (out.detach().clone(), *(g.clone() for g in grads()))
                if want is None:
                    want = got
                diffs = {n: _rel(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
                with torch.no_grad():
                    f = time_spread_ms(fwd, device="cuda")
                fb = time_spread_ms(fwd_bwd, device="cuda")
                kernels = kernel_times_ms(fwd_bwd)
                row = {**shape, "config": name, "kernel_options": opts, "fwd_ms": f["ms"], "fwd_ms_p20": f["ms_p20"],
                       "fwd_ms_p80": f["ms_p80"], **fb, "kernel_ms": sum(kernels.values()),
                       "kernels": {k_: round(v_, 4) for k_, v_ in list(kernels.items())[:6]}, "rel_diff": diffs}
                print(f"{shape} {name:30s} fwd {f['ms']:.3f} fwd+bwd {fb['ms']:.3f} ({fb['ms_p20']:.3f}-{fb['ms_p80']:.3f}) "
                      f"kernels {row['kernel_ms']:.3f}  diff {max(diffs.values()):.1e}", flush=True)
            except Exception as e:  # a configuration that does not compile (shared memory) is a row, not a crash
                row = {**shape, "config": name, "kernel_options": opts, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{shape} {name:30s} FAILED {row['error'][:200]}", flush=True)
                traceback.print_exc(limit=1)
            rows.append(row)
            out_path.write_text(json.dumps({**stamp("cuda"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
