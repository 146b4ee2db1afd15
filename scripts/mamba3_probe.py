"""Where the Mamba-3 scan's time goes, per kernel: SISO and MIMO at bench ssd's main shape, compiled as the bench
runs them, one process (the probe behind kernel work; the receipts come from `megacpp-lab bench ssd`).

    PYTHONPATH=. python scripts/mamba3_probe.py [--variants siso,r4c64,...] [--out DIR]

Each variant: forward+backward median ms (do_bench), the GPU kernels' time by kernel name over 5 calls, and each
Triton kernel's registers, spills and SASS instruction mix. A variant is `siso`, or `r<R>c<chunk>` (MIMO rank R,
chunk in sub-tokens), optionally at another of bench ssd's shapes by `@<label>` (bench/mamba3.FULL_SHAPES: main,
H=32, T=16384; e.g. `siso@H=32`), optionally followed by `:NAME=VALUE+NAME=VALUE` setting kernels/mamba3's or
kernels/ssd's launch constants for it (e.g. `siso@H=32:M3_BWD_WARPS=8+M3_BWD_BLOCK_N=32`).

`--launch-only`: each variant's compiled forward+backward and forward once each, nothing timed (the target for
Nsight Compute: `ncu --clock-control none -k regex:_m3_bwd_chunk -c 1 --section ... python scripts/mamba3_probe.py
--variants siso --launch-only`; profiles/nvidia-h100-80gb-hbm3/ssd/lead_ncu_host/ holds one such run).

Two code trees on one card, in one device call: run the probe once per tree with PYTHONPATH naming it (a lead
branch's tree carried as an ignored folder, say), each with its own --out; the rows name the package tree each ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from megacpp_lab.bench.mamba3 import FULL_SHAPES, make_inputs
from megacpp_lab.kernels.mamba3 import mamba3_scan
from megacpp_lab.profiling import kernel_times_ms, time_spread_ms
from megacpp_lab.receipts import stamp
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens


def _triton_resources() -> dict[str, dict[str, int]]:
    """Registers and spills of every compiled lab Triton kernel (kernels/ssd, kernels/mamba3)."""
    from megacpp_lab.kernels import mamba3 as m3, ssd

    out = {}
    for mod in (ssd, m3):
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)
            if not caches:
                continue
            for dev_cache in caches.values():
                for i, kernel in enumerate(dev_cache[0].values()):
                    out[f"{name}#{i}"] = {"regs": int(getattr(kernel, "n_regs", -1)),
                                          "spills": int(getattr(kernel, "n_spills", -1)),
                                          "warps": int(kernel.metadata.num_warps), "sass": _sass(kernel)}  # fmt: skip
    return out


def _sass(kernel) -> dict | str:  # noqa: ANN001
    """The loaded kernel's SASS instruction mix (kernels/resources.sass_mix: wgmma, barriers, shuffles, spill
    instructions), or why it could not be read (the probe's timings are kept either way)."""
    from megacpp_lab.kernels.resources import sass_mix

    try:
        return sass_mix(kernel.asm["cubin"])
    except Exception as exc:  # noqa: BLE001  (recorded in the output, never a made-up mix)
        return f"unread: {type(exc).__name__}: {exc}"[:300]


def _with_constants(overrides: str):
    """Set the launch constants NAME=VALUE(+...) on kernels/mamba3 or kernels/ssd; returns the undo list."""
    from megacpp_lab.kernels import mamba3 as m3, ssd

    undo = []
    for item in filter(None, overrides.split("+")):
        name, value = item.split("=")
        mod = m3 if hasattr(m3, name) else ssd
        if not hasattr(mod, name):
            raise ValueError(f"no launch constant {name} in kernels/mamba3 or kernels/ssd")
        undo.append((mod, name, getattr(mod, name)))
        setattr(mod, name, type(getattr(mod, name))(int(value) if value.isdigit() else value == "True"))
    return undo


def run(variant: str, out: str) -> dict:
    base, _, overrides = variant.partition(":")
    # dynamo's code cache forgotten: each variant's lambda is the same code object, and a launch constant read inside
    # an op is no part of its guards, so a later variant would run an earlier one's graph
    torch._dynamo.reset()
    undo = _with_constants(overrides)
    try:
        return _run(base, out) | {"variant": variant}
    finally:
        for mod, name, value in undo:
            setattr(mod, name, value)


def _run(variant: str, out: str) -> dict:
    kind, _, label = variant.partition("@")
    if (label or "main") not in FULL_SHAPES:
        raise ValueError(f"variant {variant!r}: shape {label!r} is none of bench ssd's {tuple(FULL_SHAPES)}")
    shape = FULL_SHAPES[label or "main"]
    rank, chunk = (1, shape.chunk) if kind == "siso" else map(int, kind[1:].split("c"))
    s = shape.__class__(**{**shape.__dict__, "chunk": chunk})
    a, cu = make_inputs(s, torch.bfloat16, "cuda", rank=rank)
    ctx = build_context(doc_ids_from_cu_seqlens(cu, s.B, s.T), cu_seqlens=cu)
    shape = (s.B, s.T, s.H, s.P) if rank == 1 else (s.B, s.T, rank, s.H, s.P)
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    scan = torch.compile(lambda **k: mamba3_scan(**k, ctx=ctx, chunk=chunk, kernel="triton"), fullgraph=True)
    leaves = [v for v in a.values() if v.requires_grad]

    def fwd_bwd():
        return torch.autograd.grad(scan(**a), leaves, dy)

    def fwd():
        with torch.no_grad():
            return scan(**a)

    fwd_bwd()
    fwd()
    if LAUNCH_ONLY:
        torch.cuda.synchronize()
        return {"variant": variant, "shape": s.__dict__, "rank": rank, "chunk": chunk, "launch_only": True}
    if os.environ.get("MAMBA3_PROBE_HOST_PROFILE"):  # where the host's time to issue a call goes (cProfile, stderr)
        import cProfile
        import pstats

        torch.cuda.synchronize()
        with cProfile.Profile() as prof:
            for _ in range(20):
                fwd_bwd()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(45)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            for _ in range(5):
                fwd_bwd()
            torch.cuda.synchronize()
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60),
              file=sys.stderr)
        tprof.export_chrome_trace(str(Path(out, "mamba3_host.trace.json")))
    return {"variant": variant, "shape": s.__dict__, "rank": rank, "chunk": chunk, "fwd_bwd": time_spread_ms(fwd_bwd, device="cuda"),
            "fwd": time_spread_ms(fwd, device="cuda"), "host_ms_fwd_bwd": _host_ms(fwd_bwd),
            "host_parts_ms": _host_parts_ms(fwd_bwd), "kernels_fwd_bwd": kernel_times_ms(fwd_bwd)}  # fmt: skip


def _host_parts_ms(fn) -> dict:  # noqa: ANN001
    """Where the host's time to issue one call of fn goes (medians over 20 calls from an idle GPU, ms): the two
    Mamba-3 ops' Python bodies (the scan's own host code, each op's registered implementation), the Triton launches
    inside them (JITFunction.run: binding and specialising the arguments, then the launch), and the rest (dynamo's
    guards, AOTAutograd's wrappers, the autograd engine, inductor's graphs and their kernels' launches)."""
    import triton.runtime.jit as jit

    from megacpp_lab.kernels import mamba3 as m3

    spent = {"op_bodies": 0.0, "triton_runs": 0.0, "n_triton_runs": 0}
    ops = [m3.mamba3_scan_fwd, m3.mamba3_scan_bwd]
    saved = [dict(op._backend_fns) for op in ops]
    run0 = jit.JITFunction.run

    def timed(impl, key):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return impl(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
                if key == "triton_runs":
                    spent["n_triton_runs"] += 1
        return wrapper

    samples = []
    try:
        for op, fns in zip(ops, saved):
            for dev, impl in fns.items():
                op._backend_fns[dev] = timed(impl, "op_bodies")
        jit.JITFunction.run = lambda self, *a, **k: timed(run0, "triton_runs")(self, *a, **k)
        for _ in range(20):
            torch.cuda.synchronize()
            before = dict(spent)
            t0 = time.perf_counter()
            fn()
            total = (time.perf_counter() - t0) * 1e3
            samples.append({"total": total, "op_bodies": (spent["op_bodies"] - before["op_bodies"]) * 1e3,
                            "triton_runs": (spent["triton_runs"] - before["triton_runs"]) * 1e3,
                            "n_triton_runs": spent["n_triton_runs"] - before["n_triton_runs"]})  # fmt: skip
    finally:
        jit.JITFunction.run = run0
        for op, fns in zip(ops, saved):
            op._backend_fns.update(fns)
    torch.cuda.synchronize()
    out = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    out["rest"] = statistics.median(s["total"] - s["op_bodies"] for s in samples)
    out["op_bodies_less_triton_runs"] = statistics.median(s["op_bodies"] - s["triton_runs"] for s in samples)
    return out


def _host_ms(fn) -> float:  # noqa: ANN001
    """The host's time to issue one call of fn (perf_counter from an idle GPU to fn's return, no sync after): above
    the call's GPU kernel time, the call is launch-bound and the GPU waits between kernels."""
    samples = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


LAUNCH_ONLY = False  # --launch-only


def main() -> None:
    global LAUNCH_ONLY
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="siso,r2c64,r4c64")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--launch-only", action="store_true", help="run each variant once, time nothing (an ncu target)")
    args = p.parse_args()
    LAUNCH_ONLY = args.launch_only
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the first variant's compile, not after it
    torch._dynamo.config.recompile_limit = 64
    # every variant compiled afresh (with _run's dynamo reset): a launch constant read inside an op is no part of
    # inductor's and AOTAutograd's cache keys, and a variant must never run an earlier one's graph
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rows = []
    for v in args.variants.split(","):
        print(f"probe: {v} (compiling)", file=sys.stderr, flush=True)
        try:
            rows.append(run(v, args.out))
        except Exception as exc:  # noqa: BLE001  (a variant that fails is reported, the others still run)
            rows.append({"variant": v, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        Path(args.out, "mamba3_probe.json").write_text(json.dumps({**stamp("cuda"), "rows": rows,
                                                                   "triton_kernels": _triton_resources()}, indent=1))
        r = rows[-1]
        if "error" in r or LAUNCH_ONLY:
            print(f"{v}: {r.get('error', 'launched')}")
            continue
        print(f"== {v}: fwd+bwd {r['fwd_bwd']['ms']:.3f} ms [{r['fwd_bwd']['ms_p20']:.3f}, {r['fwd_bwd']['ms_p80']:.3f}]"
              f"  fwd {r['fwd']['ms']:.3f} ms  host {r['host_ms_fwd_bwd']:.3f} ms  kernels {sum(r['kernels_fwd_bwd'].values()):.3f} ms")
        print("   host parts (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in r["host_parts_ms"].items()))
        for name, ms in list(r["kernels_fwd_bwd"].items())[:14]:
            print(f"   {ms:7.3f}  {name[:70]}")
    for name, res in _triton_resources().items():
        print(f"{name:40s} {res}")


if __name__ == "__main__":
    main()
