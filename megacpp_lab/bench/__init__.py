"""One benchmark command per subsystem (`megacpp-lab bench <subsystem>`), each writing receipts.

A full run needs a CUDA GPU (except a command with `cpu_receipts`, such as table_store, which measures
host code and runs on the CPU) and writes receipts under profiles/<device-slug>/<subsystem>/. A `--small`
run takes CPU-sized shapes: a smoke test of the same code, whose numbers are not receipts, so it
writes under build/bench-small/ and never into profiles/. On a machine without a GPU its Triton
kernels run under the Triton interpreter, which has to be switched on before `megacpp_lab.kernels`
is first imported (that package reads TRITON_INTERPRET once): `run_bench` does it in that order.

This module imports no benchmark and no kernel: the CLI builds its help from `COMMANDS` alone.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SMALL_OUT = Path("build") / "bench-small"


class BenchSetupError(RuntimeError):
    """A benchmark cannot run as asked on this machine: a full-size run without a GPU, a smoke run
    whose Triton kernels were imported without the interpreter, or smoke output aimed at profiles/."""


@dataclass(frozen=True)
class BenchCommand:
    """What `megacpp-lab bench <name>` runs and what its help says (shapes, contenders, receipts, time)."""

    name: str
    module: str  # imported only when the command runs, after the interpreter is set up
    summary: str  # one line in `megacpp-lab bench --help`
    description: str  # `megacpp-lab bench <name> --help`
    triton_on_cpu: bool  # a --small run without a GPU launches Triton kernels (so needs the interpreter)
    run_kwargs: dict[str, Any] = field(default_factory=dict)
    cpu_receipts: bool = False  # measures host-side code: a full run on a CPU is a receipt, not refused


# Run times: the committed H100 receipts (profiles/nvidia-h100-80gb-hbm3/) are stamped when each
# phase ends, and the trace file name carries its write time, so every phase but the first is timed
# there; the first is estimated from its call count and the per-call times in the same receipt.
COMMANDS: dict[str, BenchCommand] = {
    c.name: c
    for c in (
        BenchCommand(
            "engram",
            "megacpp_lab.bench.engram",
            "Engram branch: eager vs torch.compile, forward+backward",
            """\
Engram branch (EngramBranch), forward+backward on packed doc_ids cut from real torch headers.

Shapes: B=8, T=4096, C=1024, bottleneck=256, bf16; speed curve over T = 1024, 2048, 4096, 8192.
Contenders: eager and torch.compile(branch) for gated mode with conv_impl maxtext_depthwise, gated
with xla_safe, and minimal mode: time, forward time, peak memory, compile time, compiled-vs-eager
output error, and (gated maxtext_depthwise) error against fp32 eager. The RMSNorm overflow table
compares the manual x.pow(2).mean(-1) RMSNorm with F.rms_norm on bf16 activations scaled from 1 to
1e19 (64 x 4096).
Receipts under <out>/<device-slug>/engram/: engram_gated_fwd_bwd.json/.png,
engram_gated_seq_sweep.json/.png, rmsnorm_bf16_overflow.json, engram_gated_compiled.*.pt.trace.json.
Run time on an H100: one to two minutes, most of it torch.compile (the committed receipt records
20 s, 6.5 s and 2.4 s of compile for the three modes, and the T sweep, which compiles again at every
length, took 48 s).""",
            triton_on_cpu=False,
        ),
        BenchCommand(
            "m2rnn",
            "megacpp_lab.bench.m2rnn",
            "M2RNN scan: Triton kernel vs the reference step loop and XMA",
            """\
M2RNN recurrence (m2rnn_scan): the Triton scan against the reference step loop, same inputs; then
against XMA's m2rnn over a shape grid.

Shape: B=2, S=4096, H=8, K=64, V=16, bf16; speed curve over S = 512 ... 16384 (the reference loop
up to 2048). Contenders: the Triton scan storing its fp32 state every 1, 16, 64 (the default,
'triton') and 256 steps, and the reference loop; forward and forward+backward time, peak memory,
output error and per-input gradient error against the fp32 reference loop.
Peer grid: seven shapes, many heads over short rows (B=16 S=1024 H=32 K=64 with V = 16, 32, 64; B=8
S=512 H=64), few heads over long packed rows (B=4 S=8192 H=4, 16 documents a row), the main shape and
the base model's R block (B=4 S=4096 H=16, 8 documents a row). Contenders at each: the lab's scan over
the batch's PackedContext under its launch plan ('triton'), two fixed plans, the plan with the serial
backward (a chunk of scratch a program, not the parallel order's every-step buffer) and the plan with fp32
MMA operands in the backward, and XMA's m2rnn on
its Triton backend (open-lm-engine/accelerated-model-architectures, found through
$MEGACPP_XMA_PEER, ../shared/peers/xma or .peers/xma; recorded as missing without a GPU or a
checkout); time with its p20-p80 spread, peak memory, errors against the fp32 reference loop. The
bar: 'triton' forward+backward at most 1.0x XMA's at every point.
Receipts under <out>/<device-slug>/m2rnn/: m2rnn_fwd_bwd.json/.png, m2rnn_seq_sweep.json/.png,
m2rnn_peer_grid.json/.png, m2rnn_triton.*.pt.trace.json.
Run time on an H100: under a minute for the first two receipts, the reference loop dominating; the
grid is not timed on a GPU yet (its reference loops run at every point, and XMA autotunes 24
configurations per kernel on its first call at each V).""",
            triton_on_cpu=True,
        ),
        BenchCommand(
            "ssd",
            "megacpp_lab.bench.ssd",
            "SSD scan: Triton op vs fla chunk_simple_gla, compiled chunked torch, the step loop",
            """\
SSD scan (ssd_scan, Mamba-2 scalar decay per head) over packed rows: the lab's Triton op against its
peers, same inputs, same run.

Shape: B=8, T=4096, H=16, N=128 (state), P=64 (head), G=16 groups of B/C, chunk 64, bf16 (dt and A
in fp32, as the layer passes them), 8 documents of seeded-random lengths per row (cu_seqlens over the
B*T tokens). Contenders: the Triton op (kernel="triton"); flash-linear-attention's chunk_simple_gla
(fla-core, where installed: q=C, k=B, v=x*dt, g=dt*A, scale 1, varlen on one flattened row; a
backward fla refuses, as its gated one on Hopper with triton 3.4 to 3.7.0, is recorded as refused with
fla's message) and its g_gamma variant (one constant decay per head: a different, easier problem,
labelled so); torch.compile(ssd_chunked_torch); the reference step loop at B=1, T=256 (beside the
Triton op at that shape). Forward and forward+backward time, peak memory, y and per-input gradient
error against ssd_chunked_torch in fp32, and pass/fail against the bar: Triton forward at most 1.25x
fla's, forward+backward at least 3x faster than the compiled chunked path, at most half its peak
memory. Sweep, Triton vs compiled chunked: T = 1024, 2048, 4096, 8192 at B*T fixed, 1 and 64
documents per row, G=1.
Mamba-3 (bench/mamba3.py), same run: the lab's mamba3_scan (SISO; compiled whole, and eager at the main
shape) against mamba_ssm's mamba3_siso_combined (found through $MEGACPP_MAMBA3_PEER or
../shared/peers/mamba3; its first call autotunes for minutes) and the lab's Mamba-2 SSD, at the shape
above, at B=4 H=32 G=1 and at B=2 T=16384; MIMO R=2, 4 at the main shape. Errors against the fp32 chunked
scan; bars in summary.bar: SISO fwd+bwd at most 1.0x mamba_ssm and forward at most 1.1x at each shape,
MIMO R=4 at most 1.6x SISO, first call at most 30 s. Every row is timed in two rounds, the second in
reverse order; each keeps both medians and takes the lower.
Receipts under <out>/<device-slug>/ssd/: ssd_fwd_bwd.json/.png, ssd_seq_sweep.json/.png,
mamba3_fwd_bwd.json/.png, ssd_triton.*.pt.trace.json. MEGACPP_BENCH_SSD_PARTS=ssd or =mamba3 runs one part
(default both): on an H200 the Mamba-3 part took about 500 s, most of it mamba_ssm's autotuning, more than
a ten-minute call holds beside the SSD part. With MEGACPP_BENCH_DEADLINE_S set, the Mamba-3 part begins no
further shape that would end past it (the receipt lists the shape as not measured, with the reason).
Run time on an H100: about six and a half minutes (the committed receipts: 295 s for the contenders,
82 s for the sweep), mostly first calls: torch.compile of the chunked path (again for each new B, T or
G) and fla's autotuning. The receipts record elapsed_s, every compile_s and first_call_s.
--small (CPU, Triton interpreter, B=2, T=32): about 20 s; fla and torch.compile are skipped (the
chunked path runs eager), and the receipt says so.""",
            triton_on_cpu=True,
        ),
        BenchCommand(
            "mla",
            "megacpp_lab.bench.mla",
            "MLA: RoPE kernels vs copy bandwidth, layer memory per flag, KV-cache quantisation",
            """\
Multi-head latent attention: the RoPE kernels, the layer's memory under each flag, the KV cache.

RoPE kernels at B=4, T=4096, H=32, d_nope=128, d_rope=64, d_v=128, kv_lora_rank=512 (GQA: 32 query
and 8 key heads of 128), bf16: MLA Q side (forward, backward, packed thd), MLA KV side (forward,
backward), generic GQA (forward, backward). Contenders per kernel: Triton, torch.compile of the torch
reference, and a copy of the same bytes (the bar: at least 80% of copy bandwidth, and faster than
the compiled reference); GB/s and time.
Layer memory: one MLA layer (d_model=2048, 16 heads, q_lora_rank=1536, kv_lora_rank=512) at B=2,
T=4096, forward+backward with no recompute, recompute_kv_upproj (default), + recompute_q_upproj and
kv_fused_down_norm_up; then FusedDownNormUp against the unfused down/RMSNorm/up chain.
KV cache at B=2, T=2048: bytes per token (MLA vs MHA), decode parity (expanded and absorbed), and
4-bit TurboQuant and PolarQuant caches (compression, attention-output error).
Receipts under <out>/<device-slug>/mla/: mla_rope_kernels.json/.png, mla_memory.json/.png,
mla_kv_cache.json, mla_layer.*.pt.trace.json.
Run time on an H100: one to two minutes (the memory and KV-cache phases took 11 s and 25 s in the
committed run; the RoPE phase first compiles five reference functions).""",
            triton_on_cpu=True,
        ),
        BenchCommand(
            "loss",
            "megacpp_lab.bench.loss",
            "fused linear cross-entropy vs materialised logits and installed peers",
            """\
Fused linear cross-entropy (the LM-head loss), forward+backward of the mean loss.

Shape: T=8192, H=4096, V=151552, bf16; vocabulary sweep V = 32768, 65536, 131072, 151552.
Contenders: materialised logits (F.cross_entropy), the fused chunked path at its default chunk (the
bar: 60 ms and 1.3 GiB) and at chunks 128, 384, 512, 1024, the fused path with gradient filtering
(filter_eps), and liger-kernel / cut-cross-entropy when they are installed; time, peak memory, loss
and gradient error against the materialised path.
Peer shapes: T=32768 H=1024 V=50304, the model's head T=16384 H=1024 V=32768, and T=8192 H=4096
V=65536, each contender as above with the exact path also at chunks 1024, 2048 and 4096 (the default
chunk's trade); the bars: the exact fused path at its default chunk at most 1.0x Liger's time at the
first two, and filter_eps (through its gate, filter_max_kept) never slower than exact at any (within
1.02x: the median ratio of 30 back-to-back pairs of calls, profiling.paired_ratio).
Break-even: at the model's head shape, the filter forced on against exact as the kept share of the
gradient's blocks grows (the mass on a band of 2% to 40% of the vocabulary): where FILTER_MAX_KEPT
should sit.
Receipts under <out>/<device-slug>/loss/: flce_fwd_bwd.json/.png, flce_vocab_sweep.json/.png,
flce_peer_shapes.json/.png, flce_filter_break_even.json, flce.*.pt.trace.json (T=2048).
Run time on an H200: about a minute (liger-kernel installed; the committed run at 9c8f8c9).
On a CPU (--small) the fused loss runs its eager chunked fallback, with a warning.""",
            triton_on_cpu=False,
            run_kwargs={"which": "loss"},
        ),
        BenchCommand(
            "dsa",
            "megacpp_lab.bench.loss",
            "DSA indexer scores: fused Triton vs einsum slab and per-head stream",
            """\
DeepSeek sparse-attention indexer scores, which never materialise [sq, b, h, sk].

Shape: sq = sk = 4096, b=8, h=32, d=64, bf16 and fp32 inputs, fp32 output; sequence sweep
sq = 1024, 2048, 4096, 8192 (bf16 inputs, forward only). Contenders: the einsum slab (when it fits in
48 GiB), the per-head stream, the fused Triton kernel, the fused forward+backward and the torch
head-streaming backward; time, working memory beyond the [b, sq, sk] output (the bar: 10 ms and
1 GiB), error against the per-head stream.
Receipts under <out>/<device-slug>/dsa/: dsa_scores.json/.png, dsa_seq_sweep.json/.png,
dsa_scores.*.pt.trace.json (b=1).
Run time on an H100: under a minute (the sequence sweep took 6 s in the committed run).""",
            triton_on_cpu=True,
            run_kwargs={"which": "dsa"},
        ),
        BenchCommand(
            "model",
            "megacpp_lab.bench.model",
            "HybridLM: the eager training step, its share per block kind, the whole-model leak check",
            """\
HybridLM (the hybrid of MLA, Mamba-3 and M2RNN blocks), its eager training step: the baseline that regional
compile and the activation-memory policies improve.

Shape: the base preset (12 layers, d=1024, pattern AMRM, Engram at layers 1, 5, 9, vocab 32768), B=4,
T=4096, 8 documents of seeded-random lengths per row, bf16 under apply_mixed_precision, the Mamba-3 and
M2RNN scans on their Triton kernels. Contenders: eager fwd+bwd (zero_grad, forward to the fused
LM-head loss, backward), eager forward alone (no_grad), fwd+bwd + a fused AdamW step, and the
per-batch build_context; median step time over 10 steps (CUDA events), tokens/s, TFLOP/s from
HybridLM.flops_per_token (attention over each document's causal triangle), peak memory. One profiled
fwd+bwd step gives each block kind's share of the step: every GPU kernel goes to the labelled module (block, Engram branch, final norm: forward or
backward; embedding, LM head: forward) that launched it, as a share of the unprofiled step. Sweep: B = 1, 2, 4, 8 at T=4096; T = 2048, 8192 at B*T fixed; 1 and
64 documents per row; fwd+bwd and forward alone. Leak check: the small preset on real packed BPE rows
(2 x 512 tokens of the committed sample), eager, bf16, Triton scans, with and without mHC, the n-gram
memory and a CBlock. M blocks: the same eager step with the M block as Mamba-3 SISO, Mamba-3 MIMO R=2
and Mamba-2's SSD (HybridConfig.m_block), time and peak memory side by side, ratios to Mamba-2.
Receipts under <out>/<device-slug>/model/: model_step.json/.png, model_sweep.json/.png,
model_m_blocks.json, model_leaks.json, model_step.*.pt.trace.json.
Run time on an H200: about two minutes (a trial run: 32 s for the step and its profile, most of it
the first call's Triton autotuning, 25 s for the first five sweep points); each receipt records its
elapsed_s.
--small (CPU, the tiny preset at B=2, T=64, the chunked scans and the M2RNN reference loop by name):
about 20 s.""",
            triton_on_cpu=False,
        ),
        BenchCommand(
            "compile",
            "megacpp_lab.bench.compile",
            "HybridLM compile time: cold / warm / Mega-Cache per region and phase, depth, recompiles, step vs eager",
            """\
HybridLM's compile time as a user meets it, and the compiled step against eager, one run. Each contender
runs in a process of its own, with inductor and Triton cache directories of its own (cold: empty).

Shape: the base preset (12 layers, d=1024, pattern AMRM, Engram at layers 1, 5, 9), B=4, T=4096, 8
documents per row, bf16, Triton scans, built by parallelize. Contenders:
  regional cold                apply_compile (one graph per block structure) through saved graphs, as
                               `train --compile` runs: fresh caches; import, build and first step, each
                               structure traced once by dynamo's ahead-of-time compile and saved; the
                               Triton kernels compiled; then batches of 1, 2, 3, 17 and 64 documents per
                               row with and without gradients (graphs added: recompiles); the timed steps,
                               MFU against 989 TFLOP/s (attention FLOPs per document; the old count over
                               each row's whole causal triangle beside it as mfu_upper_bound); one
                               profiled step; its Mega-Cache artifacts saved;
                               then the eager step of the same weights and batch (the
                               baseline: 10 CUDA-event-timed steps after 3 of warm-up)
  regional warm                a new process on the caches the cold run left: it loads the saved graphs and
                               traces nothing; three in a row, the bars reading their medians
  regional cold 48 layers      the same model 48 layers deep (compile should be flat in depth)
  whole-model cold 48 layers   torch.compile(model), stopped at 3.05x the regional first step at 48 layers
                               (a lower bound then; earlier if MEGACPP_BENCH_DEADLINE_S seconds would pass)
  regional from Mega-Cache     empty caches, the artifacts loaded first (torch.compiler.load_cache_artifacts),
                               torch.compile's entry (Mega-Cache carries inductor's caches, not saved graphs)
  regional cold, one process   compile_workers=0, torch.compile's entry: every block structure compiled in
                               the step's process, its compile split by phase (dynamo trace, AOTAutograd,
                               inductor lowering and code generation, Triton compile, autotune) from dynamo's
                               CompilationMetrics, and the time outside dynamo (the lab's kernels)
The last two explain and are stopped at the deadline if it comes first. Where the host writes no Python
bytecode (PYTHONDONTWRITEBYTECODE, a torch without .pyc files), every process gets a bytecode cache compiled
once before the first contender, as a pip-installed torch has (summary.python_bytecode).
The summary holds one bar per threshold: cold first step <= 40 s, warm first step <= 4 s, warm import +
build + first step <= 10 s, 48 layers <= 1.15x 12 layers, regional <= 1/3 of whole-model at 48 layers,
zero recompiles, the compiled step <= 0.8x eager, regional MFU >= 30% (attention FLOPs per document).
Receipts under <out>/<device-slug>/compile/: compile_step.json, compile_step.png (phases per region, first
steps), compile_regional.*.pt.trace.json; compile_step.partial.json while it runs.
Run time on an H100 or H200: six to ten minutes (six processes; four cold compiles and a stopped one).
--small (CPU, the tiny preset at B=1, T=32, 4 and 8 layers, the scans' Triton kernels under the
interpreter, dynamo's aot_eager backend instead of inductor): about two minutes.""",
            triton_on_cpu=True,
        ),
        BenchCommand(
            "train",
            "megacpp_lab.bench.train",
            "the Engram ablation: the small preset with Engram, without, and with the n-gram memory, three seeds each",
            """\
The Engram ablation: `megacpp-lab train`'s loop on the small preset (12 layers, d=384, pattern AMRM,
vocab 32768) over the Debian C++ corpus that `megacpp-lab data corpus` builds, in three arms: Engram at
layers 1, 5, 9 (the preset); engram_layers=none; and the hashed n-gram memory at 1, 5, 9 in Engram's
place. Three seeds per arm (the weights), one tokenized corpus and one batch order for all nine runs.

Each run: B=16, T=1024, 400 steps (6.6M tokens), peak LR 2e-3 after 40 warmup steps, cosine to 10%, fused
AdamW over fp32 master weights, bf16 with fp32-contract parameters, regional compile. Every 50 steps
(fixed token counts) the loss on 8 fixed batches of the validation files and 8 of the held-out library
(CGAL: transfer). The receipt holds per arm the mean and seed range of both losses at every evaluation,
tokens/s, peak memory, 160 sampled tokens (seed 0, temperature 0.8, top-k 50), and each arm against no
Engram: a direction is named only when the arms' seed ranges do not overlap.
MEGACPP_BENCH_TRAIN_RUNS=arm:seed,... runs part of the nine (a piece per run, stamped with the commit;
MEGACPP_BENCH_TRAIN_PIECES names earlier pieces); the receipt is written once all nine exist.
Checkpoints go to build/bench-train/ (not receipts).
Receipts under <out>/<device-slug>/train/: engram_ablation.json/.png.
Run time on an H200: about a minute a run (a sizing run of one arm: 35 s compiling, 400 steps in about 25 s),
after restoring and tokenizing the corpus; the nine runs take two ten-minute device calls.
--small (CPU, the tiny preset on 40 files of the torch headers, 3 arms x 2 seeds x 4 steps of 2 x 64
tokens, 24 sampled tokens): about a minute.""",
            triton_on_cpu=False,
        ),
        BenchCommand(
            "table_store",
            "megacpp_lab.bench.table_store",
            "Engram table-store lookups: numpy gather vs the in-process and Mooncake backends (CPU)",
            """\
Engram table-store lookup: [B, L, H] precomputed row ids -> [B, L, H, D] float32 rows, on the host.

Shapes: the issue's B=8, L=4096, H=2, D=256 (tables of 49999 and 50021 rows); a small batch on large
tables, B=1, L=1024, H=2, D=256 (~200k rows per head); a large batch of narrow rows, B=16, L=4096, H=4,
D=64. Contenders, same tables and ids, one run: a plain numpy gather, the in-process backend through
TableStore, the Mooncake backend through TableStore (planned block reads), the Mooncake backend forced to
one range per row and to whole tables, and Mooncake's own EngramStore.lookup on the same keys. Mooncake
runs a local master and a second process that holds the tables, read over TCP loopback. Median, min and
max ms after warm-up, rows/s, GB/s gathered, exactness against the numpy gather, the planner's choice;
the receipt records the CPU, its cores and the Mooncake version. Without Mooncake (the `mooncake` extra
and libibverbs1) its contenders are listed as not measured, with the reason.
Receipts under <out>/<device-slug>/table_store/: table_store_lookup.json/.png (no profiler trace).
Run time on a 2-core CPU: about a minute (the committed receipt: 54 s), most of it the one-range-per-row
contenders (seconds per call at the large shapes). A full run on a CPU writes a receipt: the lookup is
host code. --small (tiny shapes, one call each): about 10 s, most of it starting and stopping Mooncake.""",
            triton_on_cpu=False,
            cpu_receipts=True,
        ),
        BenchCommand(
            "moe",
            "megacpp_lab.bench.moe",
            "E block: grouped experts vs the per-expert loop and a dense SwiGLU; expert-GEMM recompute; stack compiled",
            """\
The E block's mixture of experts (nn/moe.py), three measurements, one receipt each.
Experts: the MoE layer (fp32 router, top-2, dropless) at 16 experts, d=1024, 16384 tokens, bf16, forward+backward
and forward alone, with the grouped experts (torch._grouped_mm) eager and under torch.compile, with the per-expert
loop (the reference), and a dense SwiGLU of the same active FLOPs (hidden = top_k x expert_hidden). The bars: the
grouped experts at least 3x faster than the loop, at most 1.3x the dense SwiGLU.
Sweep: the same four contenders at four other shapes (8 experts at 4096 tokens; 64 fine-grained experts top-8
at 32768 tokens; d=2048 top-1; 65536 tokens), one receipt, no bar: how the bars' ratios move with the shape.
Recompute: one E block of the base preset (its M mixer, then the MoE) on a packed B=4 x T=4096 batch, eager and
compiled: the activation memory the E layer (its MoE) and the whole block keep and the block's forward+backward
time, with everything saved and with the expert-GEMM recompute (MoEConfig.recompute_experts: the gathered rows
and the hiddens recomputed, one grouped GEMM again). The bars, on the compiled rows: at least 40% less E-layer
memory, at most 10% more time.
Stack: the stack preset (every block kind, 16 experts in the E blocks, Engram and mHC) regionally compiled and
trained for 20 batches whose documents per row, and so the routing, change every batch; graph breaks and
recompiles after the first batch (the bars: none), total and active parameters.
Receipts under <out>/<device-slug>/moe/: moe_experts.json, moe_experts_sweep.json, moe_recompute.json,
moe_stack.json.
Run time on an H200: about 4.5 minutes cold (the stack preset's cold compile is about 100 s of it).
--small (CPU, 256 tokens at d=64 and 4 experts, the tiny preset's E block eager and compiled, and a tiny A + E
model: 2 batches, compiled in bf16 without inductor): about 20 s.""",
            triton_on_cpu=True,
        ),
        BenchCommand(
            "attention",
            "megacpp_lab.bench.attention",
            "DSA layer vs dense MLA (sdpa, flex, varlen) and its parts; MTP depth 1 on the stack preset, trained",
            """\
The seeds' attention side (nn/dsa.py, model/hybrid.py's MTPModule), two parts, three receipts.
DSA layer: the stack preset's MLA layer (d=1024, 8 heads) at B=1, T=16384, 8 documents per row of random lengths,
top-k 2048, bf16, train mode, each contender torch.compile(fullgraph): the dense MLA layer with attn_impl sdpa (a
[B,1,T,T] document mask, the reference), with attn_impl flex (the documents' block mask: MLAConfig's default
'auto' runs it compiled on a GPU) and with attn_impl varlen (torch's flash varlen kernel over the documents'
cu_seqlens), and the DSA layer of the same weights in its sparse and its warm-up phase; forward and forward+backward, each step timed alone, with
the spread; then the DSA layer's parts alone: the indexer's scores forward+backward, the top-k selection, the KL
forward+backward. The bar: the DSA layer's forward+backward at most 0.5x the dense sdpa layer's, its indexer's
time reported.
Sweep: the dense and sparse contenders at B=4 x T=4096 (8 documents per row), and at T=16384 with 1 and with 32
documents; no bar.
MTP: two training runs (`megacpp-lab train`'s loop, regionally compiled) of the stack preset (its DSA layer, MTP)
at B=4 x T=4096 on the installed torch's C++ headers for 120 steps, with mtp_depth 1 and 0: the steady step time
and peak memory of each (the bar: MTP at most +15%), then the depth-1 drafts' acceptance rate on the held-out files,
teacher-forced and in the drafting decode (generate_with_drafts on their openings).
Receipts under <out>/<device-slug>/attention/: dsa_layer.json, dsa_sweep.json, mtp_stack.json.
MEGACPP_BENCH_ATTENTION_PARTS=dsa or =mtp runs one part (a ten-minute device call holds one).
Run time on an H200: the DSA part about 5 minutes cold (each shape compiles each contender), the MTP part about
6 minutes (two compiles of the stack preset, then 120 steps each).
--small (CPU: the tiny preset's attention at T=256 with the DSA reference path, and two 6-step tiny training runs
of an A and an E block on 80 header files): under a minute.""",
            triton_on_cpu=True,
        ),
        BenchCommand(
            "scale_out",
            "megacpp_lab.bench.scale_out",
            "FSDP2 scale-out: `megacpp-lab train` on one GPU against every GPU of the host",
            """\
The scale-out receipt: `megacpp-lab train --nproc N` (torchrun underneath; FSDP2 per block, embedding and
[final norm, LM head], fp32 masters sharded, bf16 forward, fp32 gradient reduce, the fp32-contract
parameters replicated and averaged in one all-reduce per backward) on 1 GPU and on every GPU of the host,
from scratch, at the same per-GPU batch: the base preset, B=4 x T=4096 per GPU, bf16, regional compile, 40
steps. The corpus is tokenized once (cached under build/tokenized/) and both runs share one inductor and one
Triton cache (build/bench-scale-out/, unless TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR are set), so the
N-GPU run compiles warm. Each run's lines are echoed as they come: phase, step, loss, tokens/s, peak memory.
Per process count: tokens/s (the median over log intervals after the first, which holds the compile, and
without the traced one), tokens/s per GPU, the per-GPU peak memory (the largest over the ranks), the loss
curve, and a torch.profiler trace of the run's last 3 steps on rank 0, split into compute, exposed and hidden
NCCL communication and idle time (profiling.gpu_time_split): the receipt's notes name where the N-GPU step
loses time. The bar: the 2-GPU throughput at least 1.85x the 1-GPU throughput. Needs 2 or more GPUs
(refused on one).
Receipts under <out>/<device-slug>/scale_out/: scale_out.json/.png, scale_out_<N>gpu.pt.trace.json.gz (a --small
run: scale_out_<N>proc.pt.trace.json.gz).
Run time on an H100 host of 2 GPUs: 263 s from cold caches on a fresh machine (the receipt's elapsed_s; 148 s
for the 1-GPU run, which compiles cold, 102 s for the 2-GPU run, which finds the caches warm).
--small (CPU, the tiny preset, 8 steps, 2 gloo processes against 1): about 20 s.""",
            triton_on_cpu=False,
        ),
    )
}


def bench_device(name: str, small: bool) -> str:
    """'cuda' on a GPU machine; 'cpu' for a --small run without one; a full-size run needs a GPU, except
    for a command that measures host-side code (cpu_receipts), which runs on the CPU."""
    import torch

    if name in COMMANDS and COMMANDS[name].cpu_receipts:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if not small:
        raise BenchSetupError(
            f"`megacpp-lab bench {name}` runs full-size shapes and needs a CUDA GPU; "
            "on this machine use --small (a CPU smoke run, not a receipt)"
        )
    return "cpu"


def use_triton_interpreter() -> None:
    """Run Triton kernels under the interpreter (no GPU). Must come before megacpp_lab.kernels is
    first imported: it reads TRITON_INTERPRET once, and its kernels are built for one mode."""
    kernels = sys.modules.get("megacpp_lab.kernels")
    if kernels is not None and not kernels.TRITON_INTERPRET:
        raise BenchSetupError(
            "megacpp_lab.kernels was imported without TRITON_INTERPRET=1, so its Triton kernels cannot run "
            "on this CPU; set TRITON_INTERPRET=1 before importing megacpp_lab (or start a fresh process)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def require_triton_interpreter(name: str) -> None:
    """Fail closed before a CPU run launches a Triton kernel that was not built for the interpreter
    (Triton would otherwise die looking for a GPU driver: "0 active drivers")."""
    from megacpp_lab.kernels import TRITON_INTERPRET

    if not TRITON_INTERPRET:
        raise BenchSetupError(
            f"bench {name} on a CPU runs Triton kernels under the interpreter, and megacpp_lab.kernels was "
            "imported without TRITON_INTERPRET=1; run it as `megacpp-lab bench ... --small`, which sets it up, "
            "or set TRITON_INTERPRET=1 before importing megacpp_lab"
        )


def peer_checkout(env: str, folder: str, marker: str) -> Path | None:
    """A benchmark peer's checkout: the folder named by $env, else ../shared/peers/<folder> beside the repository,
    else .peers/<folder> inside it (a copy carried to a GPU box); the first that holds `marker` (a path inside
    it), or None. Peers are contenders, never dependencies: the library imports none of them."""
    root = Path(__file__).resolve().parents[2]
    candidates = [os.environ.get(env), root.parent / "shared" / "peers" / folder, root / ".peers" / folder]
    return next((Path(c) for c in candidates if c and (Path(c) / marker).exists()), None)


def output_root(out: str | Path | None, small: bool) -> Path:
    """Where a run writes: profiles/ for a full run, build/bench-small/ for a smoke run (relative to the
    current directory). Smoke output is refused inside profiles/, which holds only GPU receipts."""
    from megacpp_lab.receipts import profiles_dir

    if out is None:
        return SMALL_OUT if small else profiles_dir()
    root = Path(out)
    if small and root.resolve().is_relative_to(profiles_dir().resolve()):
        raise BenchSetupError(
            f"--out {out}: a --small run is a smoke test, not a receipt, and profiles/ holds receipts only; "
            f"write it elsewhere (default {SMALL_OUT}/)"
        )
    return root


def run_bench(name: str, out: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    """Run `megacpp-lab bench <name>`: refuse what this machine cannot run, set up the Triton interpreter
    for a CPU smoke run before any kernel is imported, then run the benchmark; returns the files written."""
    if name not in COMMANDS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {sorted(COMMANDS)}")
    cmd = COMMANDS[name]
    output_root(out, small)  # refuse a bad --out before any work
    if bench_device(name, small) == "cpu" and cmd.triton_on_cpu:
        use_triton_interpreter()
    module = importlib.import_module(cmd.module)
    return module.run(out, small=small, trace=trace, **cmd.run_kwargs)
