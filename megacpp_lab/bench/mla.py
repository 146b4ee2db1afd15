"""`megacpp-lab bench mla`: the MLA receipts (RoPE kernels, layer memory, KV cache).

What it measures and writes, and how long it takes: `megacpp-lab bench mla --help`
(megacpp_lab.bench.COMMANDS["mla"]).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megacpp_lab.bench import bench_device, output_root, require_triton_interpreter
from megacpp_lab.kernels import rope as R
from megacpp_lab.kernels.down_norm_up import FusedDownNormUp, down_norm_up_reference
from megacpp_lab.nn.mla import MLAConfig, MLAKVCache, MultiLatentAttention, cache_bytes_per_token
from megacpp_lab.nn.rope_freqs import rope_cos_sin
from megacpp_lab.profiling import peak_extra_mib, profile_trace, time_ms
from megacpp_lab.receipts import device_slug, make_receipt, write_receipt
from megacpp_lab.varlen import build_context

BAR = {"pct_of_copy": 80.0}


@dataclass(frozen=True)
class RopeShape:
    B: int
    T: int
    H: int
    d_nope: int
    d_rope: int
    d_v: int
    kv_lora_rank: int
    gqa_heads_q: int
    gqa_heads_k: int
    gqa_head_dim: int


FULL_SHAPE = RopeShape(B=4, T=4096, H=32, d_nope=128, d_rope=64, d_v=128, kv_lora_rank=512, gqa_heads_q=32, gqa_heads_k=8, gqa_head_dim=128)
SMALL_SHAPE = RopeShape(B=1, T=32, H=4, d_nope=16, d_rope=16, d_v=16, kv_lora_rank=32, gqa_heads_q=4, gqa_heads_k=2, gqa_head_dim=16)


# the thd row's contenders besides the kernel alone: the public call checking cu_seqlens on every call (device
# asserts on a GPU), and the public call given the batch's PackedContext, validated once when it was built
THD_CHECKED = "public thd call, cu_seqlens checked"
THD_CONTEXT = "public thd call, context validated"
CONTENDERS = ("triton", THD_CHECKED, THD_CONTEXT, "compiled", "copy")


def _rope_cases(s: RopeShape, dtype: torch.dtype, device: str) -> list[dict[str, Any]]:
    """(name, bytes moved, Triton call, compiled-reference call) for every kernel."""
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    N, H, dn, dr, dv, b = s.B * s.T, s.H, s.d_nope, s.d_rope, s.d_v, torch.tensor([], dtype=dtype).element_size()
    cos, sin = (t.to(device) for t in rope_cos_sin(s.T, dr))
    cos_g, sin_g = (t.to(device) for t in rope_cos_sin(s.T, s.gqa_head_dim))
    q = rnd(s.B, s.T, H, dn + dr)
    kv, latent = rnd(s.B, s.T, H, dn + dv), rnd(s.B, s.T, s.kv_lora_rank + dr)
    k_pe = latent[..., s.kv_lora_rank :]
    dkey, dval = rnd(N, H, dn + dr), rnd(N, H, dv)
    qg, kg = rnd(s.B, s.T, s.gqa_heads_q, s.gqa_head_dim), rnd(s.B, s.T, s.gqa_heads_k, s.gqa_head_dim)
    # packed documents: boundaries at N/5, N/2, 3N/4 and at every row start, as packed rows have them
    starts = torch.zeros(N, dtype=torch.long, device=device)
    starts[[N // 5, N // 2, (3 * N) // 4]] = 1
    starts[:: s.T] = 1
    ctx = build_context((starts.cumsum(0) - 1).view(s.B, s.T))  # validated once, here, outside any timing
    cu = ctx.cu_seqlens.clone()  # the same boundaries, as a bare tensor for the checked call
    q_thd = q.view(N, H, dn + dr)

    def kv_bwd_reference(dk: torch.Tensor, dvv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(N, device=device) % s.T
        pe = R.rotate_half_split(dk[..., dn:].float().sum(1), cos[pos], sin[pos], inverse=True)
        return torch.cat((dk[..., :dn], dvv), dim=-1), pe.to(dk.dtype)

    compiled = {name: torch.compile(fn) for name, fn in (
        ("q", lambda x, inv: R.mla_rope_q_reference(x, cos, sin, dn, inverse=inv)),
        ("q_thd", lambda x: R.mla_rope_q_reference(x, cos, sin, dn, cu_seqlens=cu)),
        ("kv", lambda a, p: R.mla_rope_kv_reference(a, p, cos, sin, dn)),
        ("kv_bwd", kv_bwd_reference),
        ("qk", lambda a, c, inv: R.rope_qk_reference(a, c, cos_g, sin_g, inverse=inv)),
    )}  # fmt: skip
    rope_bytes = 2 * N * H * dr * b
    qk_bytes = 2 * N * (s.gqa_heads_q + s.gqa_heads_k) * s.gqa_head_dim * b
    kv_fwd_bytes = (N * H * dn + N * dr + N * H * (dn + dr)) * b  # value stays a view of kv: not moved
    kv_bwd_bytes = (N * H * (dn + dr) + N * H * dv + N * H * (dn + dv) + N * dr) * b
    return [
        {"kernel": "mla_q_fwd", "bytes": rope_bytes,
         "triton": lambda: R.mla_rope_q_op(q, cos, sin, None, None, dn, False), "compiled": lambda: compiled["q"](q, False),
         "autotuner": R.mla_rope_q_kernel},
        {"kernel": "mla_q_bwd", "bytes": rope_bytes,
         "triton": lambda: R.mla_rope_q_op(q, cos, sin, None, None, dn, True), "compiled": lambda: compiled["q"](q, True),
         "autotuner": R.mla_rope_q_kernel},
        {"kernel": "mla_q_fwd_thd", "bytes": rope_bytes,
         "triton": lambda: R.mla_rope_q_op(q_thd, cos, sin, None, cu, dn, False, validated=True),
         THD_CHECKED: lambda: R.mla_rope_q_(q_thd, cos, sin, dn, cu_seqlens=cu),
         THD_CONTEXT: lambda: R.mla_rope_q_(q_thd, cos, sin, dn, ctx=ctx),
         "compiled": lambda: compiled["q_thd"](q_thd), "autotuner": R.mla_rope_q_kernel},
        {"kernel": "mla_kv_fwd", "bytes": kv_fwd_bytes,
         "triton": lambda: R.mla_rope_kv_fwd_op(kv.view(N, H, -1), k_pe.reshape(N, dr), cos, sin, None, None, s.T, dn),
         "compiled": lambda: compiled["kv"](kv, k_pe), "autotuner": R.mla_rope_kv_fwd_kernel},
        {"kernel": "mla_kv_bwd", "bytes": kv_bwd_bytes,
         "triton": lambda: R.mla_rope_kv_bwd_op(dkey, dval, cos, sin, None, None, s.T, dn, dtype),
         "compiled": lambda: compiled["kv_bwd"](dkey, dval), "autotuner": R.mla_rope_kv_bwd_kernel},
        {"kernel": "gqa_qk_fwd", "bytes": qk_bytes,
         "triton": lambda: R.rope_qk_op(qg, kg, cos_g, sin_g, None, None, s.T, False), "compiled": lambda: compiled["qk"](qg, kg, False),
         "autotuner": R.rope_qk_kernel},
        {"kernel": "gqa_qk_bwd", "bytes": qk_bytes,
         "triton": lambda: R.rope_qk_op(qg, kg, cos_g, sin_g, None, None, s.T, True), "compiled": lambda: compiled["qk"](qg, kg, True),
         "autotuner": R.rope_qk_kernel},
    ]  # fmt: skip


def bench_rope(s: RopeShape = FULL_SHAPE, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
               rep: int = 50, warmup: int = 5, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    from tqdm.auto import tqdm

    results: list[dict[str, Any]] = []
    meets: dict[str, bool] = {}
    for case in tqdm(_rope_cases(s, dtype, device), desc="mla rope kernels", disable=not progress):
        rows = {}
        for contender in CONTENDERS:
            if contender not in case and contender != "copy":
                continue
            fn = (lambda: None) if contender == "copy" else case[contender]
            if contender == "copy":
                src = torch.empty(max(1, case["bytes"] // 2), dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                fn = lambda src=src, dst=dst: dst.copy_(src)  # noqa: E731
            ms = time_ms(fn, warmup=warmup, rep=rep, device=device, cuda_graph=device == "cuda")
            name = {"compiled": "torch.compile(reference)", "copy": "copy (same bytes)"}.get(contender, contender)
            rows[contender] = {"contender": name, "kernel": case["kernel"], "bytes": case["bytes"], "ms": ms,
                               "gb_per_s": case["bytes"] / ms / 1e6,
                               "ms_eager_launch": time_ms(fn, warmup=min(warmup, 2), rep=rep, device=device)}  # fmt: skip
            if contender == "triton" and getattr(case["autotuner"], "best_config", None) is not None:
                rows[contender]["config"] = str(case["autotuner"].best_config)  # what autotune picked in this run
        for contender in [c for c in rows if c != "copy"]:
            rows[contender]["pct_of_copy"] = 100.0 * rows["copy"]["ms"] / rows[contender]["ms"]
        rows["triton"]["speedup"] = rows["compiled"]["ms"] / rows["triton"]["ms"]
        meets[case["kernel"]] = bool(rows["triton"]["pct_of_copy"] >= BAR["pct_of_copy"] and rows["triton"]["speedup"] > 1.0)
        if THD_CONTEXT in rows:  # the public call a model makes: its own bar, a share of copy bandwidth
            ok = bool(rows[THD_CONTEXT]["pct_of_copy"] >= BAR["pct_of_copy"])
            rows[THD_CONTEXT]["meets_bar"] = ok
            meets[f"{case['kernel']}: {THD_CONTEXT}"] = ok
        results.extend(rows.values())
    return make_receipt(
        "mla_rope_kernels", "mla", shape=asdict(s), dtype=dtype, results=results, device=device,
        bar={"pct_of_copy": BAR["pct_of_copy"], "faster_than_compiled_reference": True,
             THD_CONTEXT: {"pct_of_copy": BAR["pct_of_copy"]}},
        meets_bar=meets,
        notes=("bytes = the bytes each kernel must read and write (in-place Q side: the rope slice only; KV side: kv "
               "and k_pe in, key and value out; GQA: q and k in place); gb_per_s = bytes / time for every contender; "
               "copy = torch copy_ of a buffer moving the same bytes, timed in the same run; pct_of_copy = copy time / "
               "contender time; 'triton' = the kernel's op with its positions taken as validated (the kernel alone); "
               f"on the thd row (documents at N/5, N/2, 3N/4 and every row start) '{THD_CHECKED}' is the public "
               "mla_rope_q_(cu_seqlens=) with its per-call cu_seqlens value checks (device-side asserts on a GPU) and "
               f"'{THD_CONTEXT}' the public mla_rope_q_(ctx=) given the batch's PackedContext, validated once when "
               "it was built (no value check, no host sync); meets_bar: per kernel, the triton row against both bars; "
               f"'<kernel>: {THD_CONTEXT}' that row against the pct_of_copy bar alone (also its row's meets_bar); "
               "ms = median of the call captured in a CUDA graph and replayed (do_bench_cudagraph), so host "
               "dispatch is not in it; ms_eager_launch = the same call launched from Python each time (do_bench), "
               "host dispatch included; calls are the ops or the public calls without the autograd wrapper"),
    )  # fmt: skip


def _layer_cfg(small: bool) -> dict[str, Any]:
    if small:
        return dict(d_model=64, n_heads=2, q_lora_rank=32, kv_lora_rank=32, d_nope=16, d_rope=16, d_v=16, max_positions=64)
    return dict(d_model=2048, n_heads=16, q_lora_rank=1536, kv_lora_rank=512, d_nope=128, d_rope=64, d_v=128, max_positions=4096)


@contextlib.contextmanager
def _saved_storages() -> Iterator[dict[int, int]]:
    """Distinct storages autograd saves for the backward (views and repeats counted once): ptr -> bytes."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def bench_memory(*, small: bool = False, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> dict[str, Any]:
    """Peak extra memory of one MLA layer fwd+bwd per flag, and FusedDownNormUp vs the unfused chain."""
    B, T = (1, 32) if small else (2, 4096)
    base = _layer_cfg(small)
    variants = {
        "no recompute": dict(recompute_kv_upproj=False),
        "recompute_kv_upproj (default)": dict(),
        "recompute_kv_upproj + recompute_q_upproj": dict(recompute_q_upproj=True),
        "kv_fused_down_norm_up (no recompute)": dict(recompute_kv_upproj=False, kv_fused_down_norm_up=True),
    }
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(B, T, base["d_model"], generator=g, device=device).to(dtype).requires_grad_()
    ctx = build_context((torch.arange(T) >= T // 3).long().expand(B, T).contiguous()).to(device)
    results = []
    for name, flags in variants.items():
        torch.manual_seed(0)
        layer = MultiLatentAttention(MLAConfig.build(**base, **flags)).to(device=device, dtype=dtype)
        step = lambda: layer(x, ctx=ctx).float().square().mean().backward()  # noqa: E731
        step()
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        with _saved_storages() as saved:
            layer(x, ctx=ctx)  # activations kept for the backward (inside a checkpoint: only its inputs)
        mib = sum(n for ptr, n in saved.items() if ptr not in params) / 2**20
        row = {"contender": name, "saved_mib": mib, "ms": time_ms(step, warmup=2, rep=10, device=device)}
        if device == "cuda":
            row["peak_mib"] = peak_extra_mib(step)
        results.append(row)
    # the projection alone: [B*T, d_model] -> rank -> H*(d_nope+d_v)
    d, rank, up = base["d_model"], base["kv_lora_rank"], base["n_heads"] * (base["d_nope"] + base["d_v"])
    xs = torch.randn(B * T, d, generator=g, device=device).to(dtype).requires_grad_()
    w_down = (torch.randn(rank, d, generator=g, device=device) / math.sqrt(d)).to(dtype).requires_grad_()
    rms_w = torch.ones(rank, device=device, dtype=dtype, requires_grad=True)
    w_up = (torch.randn(up, rank, generator=g, device=device) / math.sqrt(rank)).to(dtype).requires_grad_()
    args = (xs, w_down, rms_w, w_up, 1e-6)
    for name, fn in (("FusedDownNormUp", FusedDownNormUp.apply), ("unfused down/RMSNorm/up", down_norm_up_reference)):
        with _saved_storages() as saved:
            fn(*args)
        step = lambda fn=fn: fn(*args).float().square().mean().backward()  # noqa: E731
        step()
        row = {"contender": name, "saved_mib": sum(saved.values()) / 2**20, "ms": time_ms(step, warmup=2, rep=10, device=device)}
        if device == "cuda":
            row["peak_mib"] = peak_extra_mib(step)
        results.append(row)
    return make_receipt(
        "mla_memory", "mla", shape={"B": B, "T": T, **base}, dtype=dtype, results=results, device=device,
        notes=("layer rows: one MLA layer forward+backward on packed rows (two documents), doc-masked SDPA, "
               "saved_mib = bytes of the distinct storages autograd keeps for the backward (parameters excluded; "
               "a view keeps its whole base storage); "
               "projection rows: y = W_up RMSNorm(W_down x) alone, saved_mib = bytes autograd keeps for the backward "
               "(distinct storages, weights included), peak_mib = peak extra CUDA memory of forward+backward"),
    )  # fmt: skip


def bench_kv_cache(*, small: bool = False, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                   bits: int = 4) -> dict[str, Any]:  # fmt: skip
    """Cache bytes per token, decode parity, and 4-bit quantised cache: compression and attention error."""
    from megacpp_lab.nn.kv_quant import make_quantizer

    cfg = MLAConfig.build(**_layer_cfg(small))
    B, T = (1, 24) if small else (2, 2048)
    torch.manual_seed(0)
    layer = MultiLatentAttention(cfg).to(device).eval()
    x = torch.randn(B, T, cfg.d_model, device=device)
    per_token = cache_bytes_per_token(cfg)
    results: list[dict[str, Any]] = [
        {"contender": "MLA cache (bf16)", "bytes_per_token": per_token["mla_bytes"]},
        {"contender": "MHA cache, same heads (bf16)", "bytes_per_token": per_token["mha_bytes"]},
    ]
    with torch.no_grad():
        full = layer(x)
        for absorbed in (False, True):
            cache = MLAKVCache(1, B, T, cfg.kv_lora_rank, cfg.d_rope, dtype=torch.float32, device=device)
            out = layer.decode(x, cache, 0, absorbed=absorbed)  # the whole prefix in one step: causal within it
            results.append({"contender": f"decode ({'absorbed' if absorbed else 'expanded'}) vs forward",
                            "max_abs_err": float((out - full).abs().max())})  # fmt: skip
        q_lat, c_lat, k_pe = layer.down_proj(x)
        q = layer.q_up_rope(q_lat, None)
        c = layer.kv_norm(c_lat)
        pe = layer.rope(k_pe.unsqueeze(2).contiguous(), 0, None)[:, :, 0]

        def attend(c_rows: torch.Tensor, pe_rows: torch.Tensor) -> torch.Tensor:
            """Absorbed attention of every query over the cache rows (causal): [B,T,H,d_v]."""
            w = layer.w_ukv.weight.view(cfg.n_heads, cfg.d_nope + cfg.d_v, cfg.kv_lora_rank).float()
            scores = torch.einsum("bthd,hdr,bsr->bhts", q[..., : cfg.d_nope].float(), w[:, : cfg.d_nope], c_rows)
            scores = scores + torch.einsum("bthd,bsd->bhts", q[..., cfg.d_nope :].float(), pe_rows)
            mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            p = (scores / math.sqrt(cfg.d_nope + cfg.d_rope)).masked_fill(~mask, float("-inf")).softmax(-1)
            return torch.einsum("bhts,bsr,hvr->bthv", p, c_rows, w[:, cfg.d_nope :])

        c16, pe16 = c.to(dtype).float(), pe.to(dtype).float()
        reference = attend(c16, pe16)
        for method in ("turboquant", "polarquant"):
            qc = make_quantizer(method, cfg.kv_lora_rank, bits=bits, seed=0, device=device)
            qp = make_quantizer(method, cfg.d_rope, bits=bits, seed=1, device=device)
            c_hat = qc.dequantize(qc.quantize(c.to(dtype)))
            pe_hat = qp.dequantize(qp.quantize(pe.to(dtype)))
            got = attend(c_hat.float(), pe_hat.float())
            cos_tok = torch.nn.functional.cosine_similarity(got.flatten(2), reference.flatten(2), dim=-1)
            bytes_q = qc.bytes_per_row() + qp.bytes_per_row()
            results.append({
                "contender": f"{method} {bits}-bit", "bits": bits, "bytes_per_token": bytes_q,
                "compression_vs_bf16": 2 * (cfg.kv_lora_rank + cfg.d_rope) / bytes_q,
                "attn_cosine_mean": float(cos_tok.mean()), "attn_cosine_min": float(cos_tok.min()),
                "max_abs_err": float((got - reference).abs().max()), "ref_max_abs": float(reference.abs().max()),
                "latent_rel_err": float((c_hat.float() - c16).norm() / c16.norm()),
            })  # fmt: skip
    return make_receipt(
        "mla_kv_cache", "mla", shape={"B": B, "T": T, **asdict(cfg) | {"rope_scaling": asdict(cfg.rope_scaling)}},
        dtype=dtype, results=results, device=device,
        notes=("bytes: MLA caches kv_lora_rank + d_rope values per token per layer, MHA of the same heads caches "
               "n_heads * (d_nope + d_rope + d_v); decode rows: the cached decode of the whole sequence vs the "
               "training forward (fp32); quantised rows: the latent (kv_lora_rank) and rope row (d_rope) quantised "
               "separately, attention output (absorbed form, per head, before w_o) vs the same attention over the bf16 "
               "cache; the layer has random init weights, so the attention pattern is not a trained model's"),
    )  # fmt: skip


def run(out_root: str | Path | None = None, *, small: bool = False, trace: bool = True) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megacpp_lab.plots import plot_rope_receipt, save_figure

    device = bench_device("mla", small)
    if device == "cpu":  # the RoPE rows call the kernel ops directly, past the layer's device check
        require_triton_interpreter("mla")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    root = output_root(out_root, small)
    written: list[Path] = []
    # a --small run is a smoke test (an interpreted kernel call takes a fraction of a second): one timed call each
    rope = bench_rope(SMALL_SHAPE if small else FULL_SHAPE, dtype=dtype, device=device, rep=1 if small else 50,
                      warmup=1 if small else 5)  # fmt: skip
    written.append(write_receipt(rope, root))
    written.append(save_figure(plot_rope_receipt(rope), written[-1].with_suffix(".png")))
    mem = bench_memory(small=small, dtype=dtype, device=device)
    written.append(write_receipt(mem, root))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    rows = [r for r in mem["results"] if "peak_mib" in r or "saved_mib" in r]
    key = "peak_mib" if device == "cuda" else "saved_mib"
    ax.barh([r["contender"] for r in rows], [r.get(key, 0.0) for r in rows])
    ax.set(xlabel=key.replace("_", " "), title=f"MLA memory ({mem['device']})")
    written.append(save_figure(ax, written[-1].with_suffix(".png")))
    written.append(write_receipt(bench_kv_cache(small=small, dtype=dtype, device=device), root))
    if trace:
        torch.manual_seed(0)
        layer = MultiLatentAttention(MLAConfig.build(**_layer_cfg(small))).to(device=device, dtype=dtype)
        x = torch.randn(1 if small else 2, 32 if small else 4096, layer.config.d_model, device=device, dtype=dtype, requires_grad=True)
        ctx = build_context((torch.arange(x.shape[1]) >= x.shape[1] // 3).long().expand(x.shape[0], -1).contiguous()).to(device)
        path, _ = profile_trace(lambda: layer(x, ctx=ctx).float().sum().backward(), root / device_slug(rope["device"]) / "mla",
                                "mla_layer", steps=1 if small else 2, warmup=1 if small else 2)  # fmt: skip
        written.append(path)
    return written
