"""The Megatron-side packs (10, 11, 12, 16) as reproducers against the lab's own fixes, on CPU.

Each function runs the pack's reproducer and returns its PackResult: `FIXED` when the lab's fix holds, `BUG FIRED`
when the upstream bug is back. Each pack also has a case that must see the bug's symptom on the unfixed path
(full logits, the slab, a bf16 decay parameter), so a watcher that cannot fire fails the pack too.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megacpp_lab.tripwires import BUG_FIRED, FIXED, PACKS, Case, PackResult
from megacpp_lab.varlen import build_context

__all__ = ["SEEDS_INDEXER_SHAPE", "pack10_loss_fallback", "pack11_fused_loss_wired", "pack12_indexer_slab",
           "pack16_fp32_contract"]  # fmt: skip

GiB, MiB = 2**30, 2**20
# sq = sk, b, h, d. The seeds: "at sq=sk=4096, b=8, h=32 that is 16 GiB"; d = 32 from their "k_bds [b, d, sk],
# ~4 MiB" in fp32.
SEEDS_INDEXER_SHAPE = (4096, 8, 32, 32)


def _versions() -> dict[str, str]:
    import triton

    import megacpp_lab

    return {"megacpp-lab": megacpp_lab.__version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0]}  # fmt: skip


def _target() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (the packs run on the CPU unless a case says otherwise)"
    return "cpu"


def _result(pack: str, fired: bool, cases: list[Case], measured: dict[str, Any]) -> PackResult:
    return PackResult(pack, PACKS[pack].title, BUG_FIRED if fired else FIXED, tuple(cases), _versions(), _target(),
                      measured=measured)  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------- pack 10


FELL_BACK = "fell back, with a RuntimeWarning"
MATCHES = "matches the fp64 reference"


def pack10_loss_fallback() -> PackResult:
    """fused_linear_cross_entropy(impl='auto') on CPU tensors, a device with no fused kernel: Megatron's dispatcher
    raised ValueError there. The lab's falls back to the eager chunked loss with a RuntimeWarning and gives the
    same loss and gradients (fp64 reference)."""
    from megacpp_lab.kernels import linear_cross_entropy as flce

    g = torch.Generator().manual_seed(10)
    T, H, V = 96, 32, 512
    x = (torch.randn(T, H, generator=g) / H**0.25).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(xd @ wd.t(), y)
    ref.backward()
    cases, measured = [], {}
    flce._warn_fallback.cache_clear()  # it warns once per process and reason (a cache): here, every run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss = flce.fused_linear_cross_entropy(x, w, y, impl="auto")
            loss.backward()
            raised = None
        except Exception as err:  # noqa: BLE001 (a crash is the bug's symptom: reported, not raised)
            raised = f"raised {type(err).__name__}: {err}"
    fallbacks = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    outcome = raised or (FELL_BACK if len(fallbacks) == 1 else f"fell back with {len(fallbacks)} RuntimeWarnings")
    cases.append(Case("CPU tensors, impl='auto'", outcome, FELL_BACK, fallbacks[0][:160] if fallbacks else ""))
    if raised is None:
        errs = {"loss": _rel(loss, ref), "dx": _rel(x.grad, xd.grad), "dW": _rel(w.grad, wd.grad)}
        measured.update(errs)
        tol = {"loss": 1e-5, "dx": 1e-4, "dW": 1e-4}
        for name in errs:
            ok = errs[name] <= tol[name]
            cases.append(Case(f"{name} against fp64", MATCHES if ok else "differs from the fp64 reference", MATCHES,
                              f"relative error {errs[name]:.2e} (bound {tol[name]:.0e})"))  # fmt: skip
    fired = raised is not None or any(not c.as_expected for c in cases)
    return _result("10", fired, cases, measured)


# ----------------------------------------------------------------------------- pack 11


NO_FULL_LOGITS = "no [B,T,V] tensor created"
FULL_LOGITS = "materialised [B,T,V] logits"
SAVES_LOGITS = "the flag saves at least the fp32 logits' bytes"


def _packed_batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded tokens, next-token targets and doc_ids [B,T]: two documents per row."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    doc_ids = (torch.arange(seq) >= seq // 3).long().expand(batch, seq).contiguous()
    return tokens[:, :-1], tokens[:, 1:], doc_ids


def pack11_fused_loss_wired(*, batch: int = 2, seq: int = 64, vocab: int = 8192, chunk: int = 32) -> PackResult:
    """HybridLM with the fused-loss flag on never materialises [B,T,V] logits, in the forward or the backward; with
    it off it does. Megatron's rebase-miss silently ignored the flag in the Mamba model. Measured on the tiny
    preset (vocab widened to `vocab`, so the logits stand out) on CPU: the largest tensor any op creates and the
    bytes autograd saves for the backward, flag on against flag off. The loss chunk is set to `chunk` rows, so its
    [chunk, V] buffer is told apart from full logits (by default a chunk holds every row that fits 256 MiB)."""
    from megacpp_lab.model.config import model_config
    from megacpp_lab.model.hybrid import HybridLM
    from megacpp_lab.model.parallelize import ParallelConfig, parallelize
    from megacpp_lab.profiling import saved_tensor_bytes, working_memory

    tokens, targets, doc_ids = _packed_batch(batch, seq, vocab)
    ctx = build_context(doc_ids)
    full = batch * seq * vocab
    cases, measured = [], {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = parallelize(HybridLM(model_config("tiny", "cpu", vocab_size=vocab, lm_head=dict(
            fused_loss=fused, loss_chunk_size=chunk, loss_impl="eager"))), ParallelConfig(dtype="fp32"))  # fmt: skip
        params = [*model.parameters(), *model.buffers()]
        saved = saved_tensor_bytes(lambda: model(tokens, ctx, targets).loss, exclude=params)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(tokens, ctx, targets).loss.backward()

        mem = working_memory(step)
        largest = int(torch.Size(mem.largest_shape).numel())
        measured[f"fused_loss={fused}"] = {"saved_bytes": saved, "largest_shape": list(mem.largest_shape),
                                           "largest_op": mem.largest_op, "peak_bytes": mem.peak_bytes}  # fmt: skip
        detail = (f"largest tensor {list(mem.largest_shape)} from {mem.largest_op} ({largest} elements; B*T*V = {full}); "
                  f"saved for backward {saved / MiB:.2f} MiB; working memory {mem.peak_bytes / MiB:.2f} MiB")  # fmt: skip
        name = "fused_loss=True" if fused else "fused_loss=False (the watcher must fire)"
        cases.append(Case(name, FULL_LOGITS if largest >= full else NO_FULL_LOGITS, NO_FULL_LOGITS if fused else FULL_LOGITS,
                          detail))  # fmt: skip
    # the fused loss keeps dW [V,H] (and dx) from its forward, which the reference head makes in its backward anyway:
    # the working memory over forward and backward (on a GPU, the peak) is the fair measure, not the saved bytes alone
    less = measured["fused_loss=False"]["peak_bytes"] - measured["fused_loss=True"]["peak_bytes"]
    saved_less = measured["fused_loss=False"]["saved_bytes"] - measured["fused_loss=True"]["saved_bytes"]
    logits_bytes = full * 4
    cases.append(Case("working memory, flag on against off", SAVES_LOGITS if less >= logits_bytes else
                      "saves less than the fp32 logits", SAVES_LOGITS,
                      f"{less / MiB:.2f} MiB less with the flag on ({saved_less / MiB:.2f} MiB less saved for backward); "
                      f"fp32 [B,T,V] logits are {logits_bytes / MiB:.2f} MiB"))  # fmt: skip
    if torch.cuda.is_available():  # the allocator's peak, with the GPU kernels (Triton scans and loss)
        cases.append(_pack11_cuda_peak(tokens, targets, doc_ids, vocab, chunk, logits_bytes, measured))
    fired = cases[0].outcome == FULL_LOGITS or any(not c.as_expected for c in cases[2:])
    return _result("11", fired, cases, measured)


def _pack11_cuda_peak(tokens: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor, vocab: int, chunk: int,
                      logits_bytes: int, measured: dict[str, Any]) -> Case:  # fmt: skip
    """Pack 11 on the GPU: the peak memory of one forward + backward above what the model holds, flag on and off."""
    from megacpp_lab.model.config import model_config
    from megacpp_lab.model.hybrid import HybridLM
    from megacpp_lab.model.parallelize import ParallelConfig, parallelize
    from megacpp_lab.profiling import peak_extra_mib

    dev = torch.device("cuda")
    ctx = build_context(doc_ids.to(dev))
    tok, tgt = tokens.to(dev), targets.to(dev)
    peaks = {}
    for fused in (True, False):
        torch.manual_seed(0)
        cfg = model_config("tiny", "cuda", vocab_size=vocab, lm_head=dict(fused_loss=fused, loss_chunk_size=chunk, loss_impl="triton"))
        model = parallelize(HybridLM(cfg).to(dev), ParallelConfig(dtype="fp32"))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(tok, ctx, tgt).loss.backward()

        step()  # compiles the kernels, allocates the gradients once
        peaks[fused] = peak_extra_mib(step) * MiB
        del model
    measured["cuda_peak_bytes"] = {"fused_loss=True": peaks[True], "fused_loss=False": peaks[False]}
    less = peaks[False] - peaks[True]
    return Case(f"CUDA peak memory ({torch.cuda.get_device_name()}), flag on against off",
                SAVES_LOGITS if less >= logits_bytes else "saves less than the fp32 logits", SAVES_LOGITS,
                f"peak {peaks[True] / MiB:.2f} MiB on, {peaks[False] / MiB:.2f} MiB off ({less / MiB:.2f} MiB less); "
                f"fp32 [B,T,V] logits are {logits_bytes / MiB:.2f} MiB")  # fmt: skip


# ----------------------------------------------------------------------------- pack 12


SLAB = "builds the [sq,b,h,sk] slab"
NO_SLAB = "no slab: largest tensor the [b,sq,sk] output size"
SAME_SCORES = "matches the einsum"


def pack12_indexer_slab(shape: tuple[int, int, int, int] = SEEDS_INDEXER_SHAPE) -> PackResult:
    """The DSA indexer's working memory at the seeds' shape, against the fp32 [sq,b,h,sk] slab. Run on meta tensors
    (the same ops, without data: the reference would need 32 GiB), so it is exact at any shape on any machine.
    The values of the streaming path against the einsum come from a small CPU shape."""
    from megacpp_lab.kernels.dsa_indexer import indexer_scores_reference, indexer_scores_streaming
    from megacpp_lab.profiling import working_memory

    sq, b, h, d = shape
    slab = sq * b * h * sq * 4
    out_bytes = b * sq * sq * 4

    def meta(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        return (torch.empty(sq, b, h, d, device="meta", dtype=dtype), torch.empty(sq, b, d, device="meta", dtype=dtype),
                torch.empty(sq, b, h, device="meta", dtype=dtype))  # fmt: skip

    cases, measured = [], {"slab_bytes": slab, "output_bytes": out_bytes}
    for key, name, fn, expect in (("reference", "reference einsum (the watcher must fire)", indexer_scores_reference, SLAB),
                                  ("streaming", "streaming, one head at a time", indexer_scores_streaming, NO_SLAB)):  # fmt: skip
        mem = working_memory(lambda fn=fn: fn(*meta()))
        outcome = SLAB if mem.largest_bytes >= slab else NO_SLAB if mem.largest_bytes <= out_bytes else "a tensor above the output"
        measured[key] = {"peak_bytes": mem.peak_bytes, "largest_bytes": mem.largest_bytes}
        cases.append(Case(f"{name}, bf16 at sq=sk={sq}, b={b}, h={h}, d={d}", outcome, expect,
                          f"working memory {mem.peak_bytes / GiB:.2f} GiB, largest {list(mem.largest_shape)} "
                          f"({mem.largest_bytes / MiB:.0f} MiB); the slab is {slab / GiB:.0f} GiB"))  # fmt: skip
    measured["reduction"] = measured["reference"]["peak_bytes"] / max(measured["streaming"]["peak_bytes"], 1)
    g = torch.Generator().manual_seed(12)
    q, k, w = torch.randn(64, 2, 4, 16, generator=g), torch.randn(80, 2, 16, generator=g), torch.rand(64, 2, 4, generator=g)
    a, ref = indexer_scores_streaming(q, k, w), indexer_scores_reference(q, k, w)
    drift = float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    measured["drift"] = drift
    cases.append(Case("streaming against the einsum, fp32 [64,2,4,16] x [80,2,16]", SAME_SCORES if drift <= 1e-6 else
                      "differs from the einsum", SAME_SCORES, f"max|a-b| / max|a| = {drift:.1e} (bound 1e-6)"))  # fmt: skip
    fired = cases[1].outcome != NO_SLAB
    return _result("12", fired, cases, measured)


# ----------------------------------------------------------------------------- pack 16


KEPT = "fp32-contract tensors fp32 in the forward, the other parameters bf16"
CAST = "fp32-contract tensors cast to bf16"


def _contract_outcome(seen: dict[str, set[torch.dtype]], params: set[str], contract: set[str]) -> tuple[str, str]:
    """KEPT when every contract tensor reached its forward in fp32 and every other parameter in bf16."""
    bad = sorted(n for n in contract if seen.get(n) != {torch.float32})
    others = sorted(params - contract)
    low = sum(seen.get(n) == {torch.bfloat16} for n in others)
    if bad:
        outcome = CAST
    elif not contract or low < len(others) or not others:
        outcome = f"nothing to check: {len(contract)} contract tensors, {low} of {len(others)} other parameters bf16"
    else:
        outcome = KEPT
    first = f" (first: {bad[0]})" if bad else ""
    return outcome, f"{len(contract) - len(bad)} of {len(contract)} contract tensors fp32{first}, {low} of {len(others)} other parameters bf16"


def pack16_fp32_contract() -> PackResult:
    """The blanket bf16 cast of fp32-contract parameters (Megatron's Float16Module). On the tiny HybridLM, built by
    parallelize: its one-device in-place cast (apply_precision) and FSDP2's bf16 policy (apply_fsdp, one gloo rank): every
    parameter a module declares fp32 must reach its forward in fp32 while the rest are bf16; a blanket cast
    (`.to(bfloat16)` on the bare model) must be seen as one. One optimiser-free backward checks the gradients."""
    from megacpp_lab.model.config import model_config
    from megacpp_lab.model.hybrid import HybridLM
    from megacpp_lab.model.distributed import one_process_group
    from megacpp_lab.model.parallelize import ParallelConfig, parallelize
    from megacpp_lab.model.precision import fp32_contract
    from megacpp_lab.profiling import forward_dtypes

    tokens, targets, doc_ids = _packed_batch(2, 32, model_config("tiny", "cpu").vocab_size)
    ctx = build_context(doc_ids)

    def build() -> HybridLM:
        torch.manual_seed(0)
        return HybridLM(model_config("tiny", "cpu"))

    bf16 = ParallelConfig(dtype="bf16")

    def one_device(m: nn.Module) -> nn.Module:
        return parallelize(m, bf16, device="cpu", fsdp=False)

    def sharded(m: nn.Module) -> nn.Module:
        return parallelize(m, bf16, device="cpu", fsdp=True)

    def blanket(m: nn.Module) -> nn.Module:
        return m.to(torch.bfloat16)

    cases, measured = [], {}
    for name, ready, expect in (("parallelize, one device: apply_precision (bf16)", one_device, KEPT),
                                ("parallelize, FSDP2 policy param_dtype=bf16, 1 gloo rank", sharded, KEPT),
                                ("blanket .to(bfloat16) (the watcher must fire)", blanket, CAST)):  # fmt: skip
        model = build()
        contract = set(fp32_contract(model))
        params = {n for n, _ in model.named_parameters()}
        with one_process_group() if ready is sharded else contextlib.nullcontext():
            model = ready(model)
            with forward_dtypes(model, buffers=True) as seen:
                loss = model(tokens, ctx, targets).loss
                loss.backward()
            loss = float(loss.detach())
            grads_finite = all(bool(torch.isfinite(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).all())
                               for p in model.parameters() if p.grad is not None)  # fmt: skip
        outcome, detail = _contract_outcome(seen, params, contract)
        detail = f"{detail}; loss {loss:.4f}, gradients {'finite' if grads_finite else 'NOT finite'}"
        measured[name] = {"loss": loss, "grads_finite": grads_finite, "contract": len(contract)}
        cases.append(Case(name, outcome if grads_finite or outcome != KEPT else "gradients not finite", expect, detail))
    fired = any(c.outcome != KEPT for c in cases[:2])
    return _result("16", fired, cases, measured)
