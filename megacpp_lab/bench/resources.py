"""`megacpp-lab resources`: the scans' Triton kernels compiled for sm_90 on any machine, GPU or not, and what each
asks of an SM (kernels/resources.py: registers, spills, shared memory, programs per SM).

`SUBJECTS` names what is compiled: the Mamba-3 scan (SISO and MIMO; forward, backward with its chunk pass as one
kernel and as two, and the angle sums) and Mamba-2's SSD, at the benches' main shapes (the compiled code depends
on the head sizes, the chunk and the dtypes, not on B or T, so few tokens do). `report()` compiles them in a
subprocess with TRITON_INTERPRET unset (under the interpreter, as in the CPU tests and notebooks, no kernel is
compiled).

    python -m megacpp_lab.bench.resources [SUBJECT ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton

from megacpp_lab.kernels.resources import ARCH, compile_launches

__all__ = ["SUBJECTS", "report", "resources_table"]


def _mamba3_scan(rank: int) -> Callable[[str], None]:
    """The Mamba-3 scan forward and backward through its public entry (kernel='triton'), bench ssd's main shape's
    heads (H, P, N, G, chunk, rope pairs) in bf16, few tokens (16 documents: the specialisation of the main shape's
    64); the backward under an activation-memory budget below 1, so that it recomputes the keys (_keys_kernel; a
    backward on the keys the forward kept compiles no other kernel: the forward's angles and keys are
    _angle_keys_kernel, the backward's angle gradients _angle_grads_kernel); the angle sums' Triton scan on its own
    (doc_angle_sum's and its backward's, the chunked path's on a GPU); and the group sums of dB and dC the backward takes
    with fewer groups than heads (_group_sum_kernel, bf16 parts into one group). On `device`: the CPU for the offline compile,
    CUDA for the same launches run for real (tests/test_kernel_resources.py holds the two reports equal)."""

    def run(device: str = "cpu") -> None:
        from megacpp_lab.bench.mamba3 import MAIN, make_inputs
        from megacpp_lab.kernels import mamba3 as m3
        from megacpp_lab.kernels.mamba3 import doc_angle_sum_triton, doc_suffix_sum_triton, mamba3_scan

        s = replace(MAIN, B=1, T=1024, docs=16)
        a, cu = make_inputs(s, torch.bfloat16, device, rank=rank)
        with torch._functorch.config.patch(activation_memory_budget=0.5):  # below 1: keys recomputed
            mamba3_scan(**a, cu_seqlens=cu, chunk=s.chunk, kernel="triton").float().sum().backward()
        inc = torch.rand(s.B, s.T, s.H, s.rope_pairs, device=device)
        doc_suffix_sum_triton(doc_angle_sum_triton(inc, cu), cu)
        parts = torch.randn(s.B, s.T * rank, s.H, s.N, device=device).to(torch.bfloat16)  # per head, as at G < H
        m3.group_sums(parts, parts, 1)

    return run


def _ssd_scan(device: str = "cpu") -> None:
    """Mamba-2's SSD forward and backward at bench ssd's main shape's heads, few tokens, bf16, on `device`."""
    from megacpp_lab.bench.ssd import FULL_SHAPE, make_inputs
    from megacpp_lab.kernels.ssd import ssd_scan

    s = replace(FULL_SHAPE, B=1, T=1024, docs=16)
    (x, dt, A, Bm, Cm), cu = make_inputs(s, torch.bfloat16, device)
    for t in (x, dt, A, Bm, Cm):
        t.requires_grad_()
    ssd_scan(x, dt, A, Bm, Cm, cu_seqlens=cu, chunk=s.chunk, kernel="triton").float().sum().backward()


def _m2rnn_scan(device: str = "cpu") -> None:
    """The M2RNN scan forward and backward at bench m2rnn's main shape (B, H, K, V and one document a row, so the
    launch plan is the real shape's: it depends on the documents and heads, planned for a GH100's SMs and L2), few
    steps, bf16, on `device` (on a GPU the plan is that GPU's)."""
    from megacpp_lab.bench.m2rnn import FULL_SHAPE, make_inputs
    from megacpp_lab.kernels.m2rnn import m2rnn_scan

    q, k, v, f, W = make_inputs(replace(FULL_SHAPE, S=512), torch.bfloat16, device)
    m2rnn_scan(q, k, v, f, W, kernel="triton").float().sum().backward()


def _doc_conv(device: str = "cpu") -> None:
    """The doc-masked causal conv with its SiLU, forward and backward, at the base model's R block width (2304
    channels, K = 4) with positions, few tokens, bf16, on `device`."""
    from megacpp_lab.kernels.doc_conv import doc_conv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, 2304, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(2304, 1, 4, generator=g).to(device, torch.bfloat16).requires_grad_()
    b = torch.randn(2304, generator=g).to(device, torch.bfloat16).requires_grad_()
    positions = (torch.arange(256) % 100).view(1, 256).to(device)
    doc_conv(x, w, b, positions, silu=True).float().sum().backward()


SUBJECTS: dict[str, Callable[[str], None]] = {
    "doc_conv": _doc_conv,
    "mamba3": _mamba3_scan(1),
    "mamba3-mimo2": _mamba3_scan(2),
    "mamba3-mimo4": _mamba3_scan(4),
    "ssd": _ssd_scan,
    "m2rnn": _m2rnn_scan,
}


def report(subjects: tuple[str, ...] | None = None, *, timeout_s: float = 900.0) -> dict[str, Any]:
    """Each subject's kernels (None: every one of SUBJECTS) compiled for sm_90, in a subprocess with the
    interpreter off: {"arch", "triton", "subjects": {subject: [row, ...]}} (rows: KernelResources.as_row())."""
    subjects = tuple(SUBJECTS) if subjects is None else tuple(subjects)
    unknown = [s for s in subjects if s not in SUBJECTS]
    if unknown:
        raise ValueError(f"resources subjects: {unknown} unknown; choose from {tuple(SUBJECTS)}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "resources.json")
        done = subprocess.run([sys.executable, "-m", "megacpp_lab.bench.resources", *subjects, "--json", out],
                              env=env, capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the resources subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def _variant(row: dict[str, Any], same_name: list[dict[str, Any]]) -> str:
    """' K=v,...': the constexprs that tell a kernel's row from the other compilations of the same kernel in its
    subject ('' when it has none)."""
    differ = sorted({k for o in same_name for k, v in o["constexprs"].items() if row["constexprs"].get(k) != v})
    return " " + ",".join(f"{k}={row['constexprs'].get(k)}" for k in differ) if differ else ""


def resources_table(result: dict[str, Any]) -> str:
    """report()'s result as one aligned text table, a line per kernel."""
    head = (f"{'subject':<14}{'kernel':<44}{'regs':>5}{'spill st/ld B':>15}{'stack B':>8}{'smem KiB':>9}{'warps':>6}"
            f"{'per SM':>7}{'wgmma/mma':>10}{'bar/shfl':>9}")
    lines = [head]
    for subject, rows in result["subjects"].items():
        for r in rows:
            kernel = r["kernel"] + _variant(r, [o for o in rows if o["kernel"] == r["kernel"]])
            spill = f"{r['spill_store_bytes']}/{r['spill_load_bytes']}"
            mma = f"{r['sass']['wgmma']}/{r['sass']['mma']}"
            sync = f"{r['sass']['barrier']}/{r['sass']['shuffle']}"
            lines.append(f"{subject:<14}{kernel:<44}{r['regs']:>5}{spill:>15}{r['stack_bytes']:>8}"
                         f"{r['shared_bytes'] / 1024:>9.1f}{r['num_warps']:>6}{r['programs_per_sm']:>7}{mma:>10}{sync:>9}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megacpp_lab.bench.resources", description=__doc__.split("\n\n")[0])
    p.add_argument("subjects", nargs="*", default=list(SUBJECTS), metavar="SUBJECT",
                   help=f"what to compile: {', '.join(SUBJECTS)} (default: all)")  # fmt: skip
    p.add_argument("--json", help="write the result here as JSON")
    args = p.parse_args(argv)
    unknown = [s for s in args.subjects if s not in SUBJECTS]
    if unknown:
        p.error(f"unknown subjects {unknown}; choose from {', '.join(SUBJECTS)}")
    from megacpp_lab import kernels

    if kernels.TRITON_INTERPRET:  # run as a module under the interpreter: go round it
        result = report(tuple(args.subjects))
    else:
        result = {"arch": f"sm_{ARCH}", "triton": triton.__version__,
                  "subjects": {s: [r.as_row() for r in compile_launches(SUBJECTS[s])] for s in args.subjects}}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(resources_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
