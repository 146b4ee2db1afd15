"""Mixture-of-experts benchmark: the E block's experts grouped against the per-expert loop and a dense SwiGLU of
the same active FLOPs, the expert-GEMM recompute lever's memory and time, and the `stack` preset compiled over
changing batches. One run, three receipts.

What it measures and writes: `megacpp-lab bench moe --help` (megacpp_lab.bench.COMMANDS["moe"]).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megacpp_lab.bench import bench_device, output_root
from megacpp_lab.bench.harness import ModelShape, build_model, fresh_dynamo, make_batch, measure_fwd_bwd, timed_call
from megacpp_lab.model.config import model_config
from megacpp_lab.model.hybrid import Block
from megacpp_lab.model.parallelize import ParallelConfig
from megacpp_lab.nn.moe import MoE, MoEConfig, update_balance
from megacpp_lab.nn.primitives import SwiGLU
from megacpp_lab.profiling import retained_bytes, sync, time_ms
from megacpp_lab.receipts import make_receipt, write_receipt
from megacpp_lab.varlen import build_context

__all__ = ["FULL", "SMALL", "SWEEP", "MoEShape", "bench_experts", "bench_experts_sweep", "bench_recompute", "bench_stack"]

SPEEDUP_OVER_LOOP_BAR = 3.0
OVER_DENSE_BAR = 1.3
MEMORY_SAVED_BAR = 0.40
RECOMPUTE_COST_BAR = 0.10
STACK_BATCHES = 20


@dataclass(frozen=True)
class MoEShape:
    tokens: int
    d_model: int
    n_experts: int
    top_k: int
    expert_hidden: int
    preset: str  # the E block's (its mixer and d_model)
    B: int  # the E-block and stack measurements' batch: B x T tokens
    T: int
    docs: int


FULL = MoEShape(tokens=16384, d_model=1024, n_experts=16, top_k=2, expert_hidden=1368, preset="base", B=4, T=4096,
                docs=8)  # fmt: skip
# the sweep (bench_experts_sweep): fewer tokens and experts, fine-grained experts (DeepSeek-style: many narrow
# experts, top-8), a wide model with top-1, and many tokens
SWEEP = (MoEShape(tokens=4096, d_model=1024, n_experts=8, top_k=2, expert_hidden=2736, preset="base", B=1, T=4096, docs=8),
         MoEShape(tokens=32768, d_model=1024, n_experts=64, top_k=8, expert_hidden=512, preset="base", B=8, T=4096, docs=8),
         MoEShape(tokens=16384, d_model=2048, n_experts=16, top_k=1, expert_hidden=5464, preset="base", B=4, T=4096, docs=8),
         MoEShape(tokens=65536, d_model=1024, n_experts=16, top_k=2, expert_hidden=1368, preset="base", B=16, T=4096, docs=8))  # fmt: skip
SMALL = MoEShape(tokens=256, d_model=64, n_experts=4, top_k=2, expert_hidden=48, preset="tiny", B=2, T=64, docs=3)
SMALL_SWEEP = (MoEShape(tokens=128, d_model=64, n_experts=8, top_k=1, expert_hidden=32, preset="tiny", B=2, T=64, docs=3),)


def _moe(s: MoEShape, device: str, dtype: torch.dtype, **overrides: Any) -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig.build(d_model=s.d_model, n_experts=s.n_experts, top_k=s.top_k, expert_hidden=s.expert_hidden,
                          **overrides)  # fmt: skip
    layer = MoE(cfg).to(device)
    layer.experts_gate_up.data, layer.experts_down.data = (layer.experts_gate_up.to(dtype),
                                                           layer.experts_down.to(dtype))  # fmt: skip
    return layer.train()


def _expert_rows(s: MoEShape, *, device: str, dtype: torch.dtype, rep: int) -> list[dict[str, Any]]:
    """One row per contender at shape s: the MoE layer grouped (eager and compiled) and looped, and a dense SwiGLU
    of the same active FLOPs; forward+backward and forward alone, and the first call's seconds."""
    x = torch.randn(s.tokens, s.d_model, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    grouped, loop = _moe(s, device, dtype), _moe(s, device, dtype, experts="loop")
    dense = SwiGLU(s.d_model, s.top_k * s.expert_hidden).to(device, dtype)
    fresh_dynamo()
    contenders = {
        "MoE, grouped experts (torch._grouped_mm), eager": grouped,
        # a CPU smoke run compiles without inductor (its C++ build would be most of the run)
        "MoE, grouped experts, torch.compile": torch.compile(grouped, fullgraph=True,
                                                             backend="inductor" if device == "cuda" else "aot_eager"),
        "MoE, per-expert loop (the reference), eager": loop,
        "dense SwiGLU of the same active FLOPs, eager": dense,
    }
    results = []
    for name, fn in contenders.items():
        params = [p for p in fn.parameters() if p.requires_grad]

        def fwd(fn=fn) -> torch.Tensor:
            with torch.no_grad():
                return fn(x)

        def fwd_bwd(fn=fn, params=params) -> tuple[torch.Tensor, ...]:
            return torch.autograd.grad(fn(x), [x, *params], dy)

        _, first = timed_call(fwd_bwd, device)
        timed_call(fwd, device)
        results.append({"contender": name, "first_call_s": first, **measure_fwd_bwd(fwd, fwd_bwd, device=device, rep=rep)})
    return results


def bench_experts(s: MoEShape, *, device: str, dtype: torch.dtype, rep: int) -> dict[str, Any]:
    """The MoE layer with grouped experts (eager and compiled), with the per-expert loop, and a dense SwiGLU of
    hidden top_k x expert_hidden (the same active FLOPs), forward+backward over s.tokens tokens."""
    results = _expert_rows(s, device=device, dtype=dtype, rep=rep)
    ms = {r["contender"]: r["ms"] for r in results}
    best = min(ms[k] for k in ms if "grouped" in k)
    loop_ms, dense_ms = ms["MoE, per-expert loop (the reference), eager"], ms["dense SwiGLU of the same active FLOPs, eager"]
    summary = {
        "grouped_speedup_over_loop": loop_ms / best,
        "grouped_over_dense": best / dense_ms,
        "bar": {f"grouped experts fwd+bwd >= {SPEEDUP_OVER_LOOP_BAR}x faster than the per-expert loop": loop_ms / best >= SPEEDUP_OVER_LOOP_BAR,
                f"grouped experts fwd+bwd <= {OVER_DENSE_BAR}x a dense SwiGLU of the same active FLOPs": best / dense_ms <= OVER_DENSE_BAR},
    }  # fmt: skip
    return make_receipt(
        "moe_experts", "moe", shape=asdict(s), dtype=dtype, results=results, device=device, summary=summary,
        notes=("The MoE layer (nn/moe.py: fp32 router, top-k, dropless, z-loss attached) on x [tokens, d_model], "
               "forward+backward (the gradients of x and every parameter) and forward under no_grad, medians after "
               "warm-up; the bars take the faster grouped row. The loop row runs one expert at a time with a host "
               "sync each (the reference); the dense row is one SwiGLU of hidden top_k x expert_hidden, without a "
               "router. first_call_s: the first forward+backward (torch.compile's when compiled)."),
    )  # fmt: skip


def bench_experts_sweep(shapes: tuple[MoEShape, ...], *, device: str, dtype: torch.dtype, rep: int) -> dict[str, Any]:
    """bench_experts' contenders at other expert counts, top-k, widths and token counts than the bars' shape: the
    grouped experts' speed over the loop and against the dense SwiGLU is a property of the method, not of one shape."""
    results, ratios = [], {}
    for s in shapes:
        rows = _expert_rows(s, device=device, dtype=dtype, rep=rep)
        tag = f"E={s.n_experts} top-{s.top_k} d={s.d_model} h={s.expert_hidden} N={s.tokens}"
        results += [{"shape": tag, **asdict(s), **r} for r in rows]
        ms = {r["contender"]: r for r in rows}
        best = min((r for k, r in ms.items() if "grouped" in k), key=lambda r: r["ms"])
        loop = ms["MoE, per-expert loop (the reference), eager"]
        dense = ms["dense SwiGLU of the same active FLOPs, eager"]
        ratios[tag] = {"grouped_speedup_over_loop": loop["ms"] / best["ms"], "grouped_over_dense": best["ms"] / dense["ms"],
                       "grouped_fwd_over_dense_fwd": best["fwd_ms"] / dense["fwd_ms"]}  # fmt: skip
    return make_receipt(
        "moe_experts_sweep", "moe", shape={"shapes": [asdict(s) for s in shapes]}, dtype=dtype, results=results,
        device=device, summary={"by_shape": ratios},
        notes=("bench_experts' four contenders (moe_experts.json's notes) at each shape of the sweep, one receipt: "
               "forward+backward and forward under no_grad, medians after warm-up. by_shape: the faster grouped "
               "row's speed-up over the loop and its time over the dense SwiGLU. No bar: the bars are judged at "
               "moe_experts.json's shape; this shows how they move."),
    )  # fmt: skip


def _e_block(s: MoEShape, device: str, *, recompute: bool) -> tuple[Block, torch.Tensor, Any]:
    config = model_config(s.preset, device, pattern="E", n_layers=1, engram_layers=(),
                          moe=dict(n_experts=s.n_experts, top_k=s.top_k, expert_hidden=s.expert_hidden,
                                   recompute_experts=recompute))  # fmt: skip
    # bf16 on a CPU too: the grouped experts compile in bf16 alone
    model = build_model(config, device, parallel=ParallelConfig(dtype="bf16"))
    tokens, doc_ids, _ = make_batch(ModelShape(s.preset, s.B, s.T, s.docs), config.vocab_size, device)
    x = model.embed(tokens).detach().requires_grad_()
    return model.blocks[0], x, (tokens, build_context(doc_ids))


def bench_recompute(s: MoEShape, *, device: str, rep: int) -> dict[str, Any]:
    """One E block (the shape's preset's mixer and an MoE of its experts) on a [B,T] packed batch, eager and
    compiled, with and without the expert-GEMM recompute (MoEConfig.recompute_experts): what the E layer (the
    block's MoE after its norm) and the whole block keep for the backward, and the block's forward+backward time."""
    results = []
    for mode in ("eager", "torch.compile"):
        for recompute in (False, True):
            block, x, (tokens, ctx) = _e_block(s, device, recompute=recompute)
            fresh_dynamo()
            compile_fn = (lambda f: f) if mode == "eager" else (lambda f: torch.compile(
                f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager"))  # fmt: skip
            run_block = compile_fn(block)
            run_layer = compile_fn(lambda h, block=block: block.mlp(block.mlp_norm(h)))
            dy = torch.randn_like(x)

            def fwd_bwd(run_block=run_block, x=x, tokens=tokens, ctx=ctx, dy=dy) -> None:
                torch.autograd.grad(run_block(x, tokens, ctx), [x], dy)

            _, first = timed_call(fwd_bwd, device)
            run_layer(x).float().sum().backward()  # its own compile, before the memory is read
            block_kept = retained_bytes(lambda: run_block(x, tokens, ctx))
            layer_kept = retained_bytes(lambda: run_layer(x))
            out_bytes = x.numel() * x.element_size()  # each call's output, held past the measurement
            results.append({
                "contender": f"E block, {mode}, " + ("expert-GEMM recompute" if recompute else "everything saved"),
                "mode": mode, "recompute_experts": recompute, "first_call_s": first,
                "e_layer_activation_mib": (layer_kept - out_bytes) / 2**20,
                "block_activation_mib": (block_kept - out_bytes) / 2**20,
                "ms": time_ms(fwd_bwd, warmup=0 if rep == 1 else 3, rep=rep, device=device)})  # fmt: skip
            del block, x, run_block, run_layer
    by = {(r["mode"], r["recompute_experts"]): r for r in results}
    summary: dict[str, Any] = {"bar": {}}
    for mode in ("eager", "torch.compile"):
        base, lever = by[(mode, False)], by[(mode, True)]
        summary[mode] = {"e_layer_memory_saved": 1 - lever["e_layer_activation_mib"] / base["e_layer_activation_mib"],
                         "block_memory_saved": 1 - lever["block_activation_mib"] / base["block_activation_mib"],
                         "time_cost": lever["ms"] / base["ms"] - 1}  # fmt: skip
    lab = summary["torch.compile"]  # the bars: the way the lab trains (regional compile)
    summary["bar"] = {
        f"expert-GEMM recompute: E-layer activation memory >= {MEMORY_SAVED_BAR:.0%} lower (compiled)":
            lab["e_layer_memory_saved"] >= MEMORY_SAVED_BAR,
        f"expert-GEMM recompute: E-block step time <= {RECOMPUTE_COST_BAR:.0%} higher (compiled)":
            lab["time_cost"] <= RECOMPUTE_COST_BAR}  # fmt: skip
    return make_receipt(
        "moe_recompute", "moe", shape=asdict(s), dtype=torch.bfloat16,
        results=results, device=device, summary=summary,
        notes=(f"One E block of the {s.preset} preset (its M mixer, then the MoE) built as the model builds it in bf16, "
               "on embedded tokens of a packed [B, T] batch; eager, and under torch.compile(fullgraph) as regional "
               "compile compiles a block (the bars read the compiled rows: the lab trains compiled). The lever: "
               "MoEConfig.recompute_experts, the experts' dispatch, GEMMs and combine under a checkpoint that keeps their "
               "input rows and the routing (nn/moe.py). e_layer_activation_mib: what the E layer (the block's MoE after "
               "its norm, the seeds' E-layer terms) still holds when its forward returns, its output aside "
               "(profiling.retained_bytes); block_activation_mib: the same for the whole block, mixer included; ms: "
               "forward+backward of the block, median after warm-up."),
    )  # fmt: skip


def _graphs(model: Any) -> int:
    """Graphs the model's compiled blocks have used so far: dynamo's unique graphs (the blocks compiled with
    torch.compile, and the saved graphs compiled in this process, which reach dynamo once each) plus the saved graphs
    loaded from disk (model/saved_graphs.py: a loaded graph never reaches dynamo's counters)."""
    from torch._dynamo.utils import counters

    saved = getattr(model, "saved_graphs", None)
    # a loaded file whose guards refused these inputs is not a graph in use (one is compiled next to it)
    loaded = 0 if saved is None else sum(1 for e in saved.events if e["how"] == "loaded" and e.get("guards_pass"))
    return int(counters["stats"]["unique_graphs"]) + loaded


def bench_stack(s: MoEShape, *, device: str, batches: int) -> dict[str, Any]:
    """The `stack` preset (tiny on a CPU smoke run) regionally compiled, trained on `batches` batches whose
    documents per row change every step (so does the routing): graph breaks and recompiles after the first."""
    from torch._dynamo.utils import counters

    preset = "stack" if device == "cuda" else "tiny"
    # a CPU smoke run: an A and an E block only (the other scans run under the Triton interpreter, seconds a call)
    overrides = {} if device == "cuda" else dict(pattern="AE", n_layers=2, mhc=True, engram_layers=(1,))
    config = model_config(preset, device, compiled=True, **overrides)
    fresh_dynamo()
    # a CPU smoke run: bf16 (the grouped experts compile in bf16 alone) and dynamo's graphs without inductor
    parallel = ParallelConfig(compile=True) if device == "cuda" else ParallelConfig(
        compile=True, dtype="bf16", backend="aot_eager", compile_workers=0, saved_graphs=False)  # fmt: skip
    model = build_model(config, device, parallel=parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows, t0 = [], time.perf_counter()
    compiles_after_first = None
    for i in range(batches):
        docs = 1 + (i * 7) % (2 * s.docs)  # 1 .. 2 docs-per-row, changing every step
        tokens, doc_ids, targets = make_batch(ModelShape(preset, s.B, s.T, docs), config.vocab_size, device, seed=i)
        ctx = build_context(doc_ids)
        sync(device)
        t_step = time.perf_counter()
        loss = model(tokens, ctx, targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_balance(model)
        sync(device)
        if i == 0:
            compiles_after_first = _graphs(model)
        rows.append({"contender": f"batch {i}", "docs_per_row": docs, "train_loss": float(loss.detach()),
                     "ms": 1e3 * (time.perf_counter() - t_step)})  # fmt: skip
    graphs = _graphs(model)
    breaks = sum(counters["graph_break"].values())
    summary = {
        "graph_breaks": breaks, "graphs_after_first_batch": compiles_after_first, "graphs_at_end": graphs,
        "recompiles_after_first_batch": graphs - compiles_after_first,
        # a first batch that used no graph compiled nothing, and its zero recompiles would prove nothing
        "bar": {"stack: zero graph breaks": breaks == 0,
                f"stack: zero recompiles over {batches} batches of changing routing and document counts":
                    graphs == compiles_after_first and compiles_after_first > 0},
    }  # fmt: skip
    saved = getattr(model, "saved_graphs", None)
    if saved is not None:
        summary["saved_graphs"] = saved.summary()
    counts = model.num_parameters()
    return make_receipt(
        "moe_stack", "moe", shape={"preset": preset, "B": s.B, "T": s.T, "batches": batches},
        dtype=torch.bfloat16 if device == "cuda" else torch.float32, results=rows, device=device, summary=summary,
        parameters={"total": counts["total"], "active": model.active_parameters(), "by_bucket": counts},
        elapsed_s=time.perf_counter() - t0,
        notes=("The preset regionally compiled (parallelize with compile=True), AdamW steps on packed batches "
               "whose documents per row change every batch (and so does every E block's routing). graph_breaks: "
               "dynamo's graph-break counter over the run (saved graphs compile with fullgraph: a break is an error); "
               "graphs: the block graphs in use, loaded or compiled through saved graphs (model/saved_graphs.py; "
               "dynamo's unique graphs without them); recompiles: graphs added after the first batch; ms: each step's wall clock (the first holds the compile). parameters: total, and active (an E "
               "block's experts at top_k / n_experts)."),
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    device = bench_device("moe", small)
    s = SMALL if small else FULL
    root = output_root(out_root, small)
    rep = 1 if small else 20
    # bf16 on a CPU too: the grouped experts compile in bf16 alone
    written = [write_receipt(bench_experts(s, device=device, dtype=torch.bfloat16, rep=rep), root)]
    written.append(write_receipt(bench_experts_sweep(SMALL_SWEEP if small else SWEEP, device=device,
                                                     dtype=torch.bfloat16, rep=rep), root))
    written.append(write_receipt(bench_recompute(s, device=device, rep=rep), root))
    written.append(write_receipt(bench_stack(s, device=device, batches=2 if small else STACK_BATCHES), root))
    return written
