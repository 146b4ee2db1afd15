"""The fused LM-head loss's chunk size against Liger at bench loss's peer shapes, one process (the probe behind the
chunk rule; the receipts come from `megacpp-lab bench loss`).

    PYTHONPATH=. python scripts/loss_probe.py [--chunks 512,1024,...] [--out DIR]

Each shape: forward+backward median ms with its p20/p80 for the default chunk, each listed chunk, filter_eps with
the gate (which turns it off at these shapes' kept shares), and liger-kernel where it imports.
"""

from __future__ import annotations

import argparse
import json
import os
from importlib.util import find_spec
from pathlib import Path

import torch

from megacpp_lab.kernels.linear_cross_entropy import (BF16_FILTER_EPS, default_chunk_size,
                                                      fused_linear_cross_entropy)  # fmt: skip
from megacpp_lab.profiling import time_spread_ms

SHAPES = ((32768, 1024, 50304), (16384, 1024, 32768), (8192, 4096, 65536))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", default="512,768,1024,2048,4096")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    liger = None
    if find_spec("liger_kernel") is not None:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger
    rows = []
    for T, H, V in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(T, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16().requires_grad_()
        t = torch.randint(0, V, (T,), device="cuda", generator=g)
        calls = {f"default chunk ({default_chunk_size(T, V, x.dtype)})": lambda: fused_linear_cross_entropy(x, w, t)}
        for c in map(int, args.chunks.split(",")):
            calls[f"chunk={c}"] = lambda c=c: fused_linear_cross_entropy(x, w, t, chunk_size=c)
        calls["filter_eps (gated)"] = lambda: fused_linear_cross_entropy(x, w, t, filter_eps=BF16_FILTER_EPS)
        if liger is not None:
            calls["liger-kernel"] = lambda: liger(x, w, t)
        for name, fn in calls.items():
            def step(fn=fn):
                fn().backward()
                x.grad = w.grad = None

            r = {"shape": f"T={T} H={H} V={V}", "contender": name, **time_spread_ms(step, device="cuda")}
            rows.append(r)
            print(f"{r['shape']:24s} {name:28s} {r['ms']:8.3f} [{r['ms_p20']:.3f}, {r['ms_p80']:.3f}]", flush=True)
        Path(args.out, "loss_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
