"""Helpers shared by the MLA attention-path tests (test_mla_flex, test_mla_varlen): the layer shapes, a pair of
layers with the same weights that differ in attn_impl, packed document layouts and a relative error."""

from __future__ import annotations

import torch

from megacpp_lab.nn.mla import MLAConfig, MultiLatentAttention
from megacpp_lab.varlen import build_context

SMALL = dict(d_model=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16, d_nope=8, d_rope=8, d_v=8, max_positions=256)
# the MLA block of a real model: DeepSeek-V2-Lite-like ranks and head dims (q/k 192, v 128, as the base model's)
REAL = dict(d_model=2048, n_heads=16, q_lora_rank=1536, kv_lora_rank=512, d_nope=128, d_rope=64, d_v=128,
            max_positions=4096)  # fmt: skip


def layer_pair(impl: str, device: str, dtype: torch.dtype = torch.float32, **kw) -> tuple[MultiLatentAttention, MultiLatentAttention]:
    """(sdpa layer, `impl` layer) with the same weights."""
    torch.manual_seed(0)
    sdpa = MultiLatentAttention(MLAConfig.build(**kw, attn_impl="sdpa")).to(device, dtype)
    other = MultiLatentAttention(MLAConfig.build(**kw, attn_impl=impl)).to(device, dtype)
    other.load_state_dict(sdpa.state_dict())
    return sdpa, other


def packed_doc_ids(B: int, T: int, device: str, seed: int) -> torch.Tensor:
    """B rows of packed documents; each row a different number of documents (1 to 6) of random lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        n_docs = 1 + (seed + b) % 6
        starts = torch.randperm(T - 1, generator=g)[: n_docs - 1] + 1
        row = torch.zeros(T, dtype=torch.long)
        row[starts] = 1
        rows.append(row.cumsum(0))
    return torch.stack(rows).to(device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check_across_shapes(layer_fn, sdpa: MultiLatentAttention, shapes: list[tuple[int, int]], grad: bool,
                        seed: int = 100) -> None:  # fmt: skip
    """check_against_sdpa at each (B, T) of `shapes` in turn, one seed a shape: one module fed shapes no test
    names, as a user's loop would."""
    for i, (B, T) in enumerate(shapes):
        check_against_sdpa(layer_fn, sdpa, B, T, grad, seed=seed + i)


def check_against_sdpa(layer_fn, sdpa: MultiLatentAttention, B: int, T: int, grad: bool, seed: int,
                       dtype: torch.dtype = torch.bfloat16, packed: bool = True) -> None:  # fmt: skip
    """On CUDA, layer_fn(x, ctx=) against eager SDPA on the same context (flex reads its block mask, varlen its
    cu_seqlens, sdpa its doc_ids; packed=False: no context, one document a row): outputs, and with grad the
    input and weight grads."""
    torch.manual_seed(seed)
    x = torch.randn(B, T, REAL["d_model"], device="cuda", dtype=dtype)
    ctx = build_context(packed_doc_ids(B, T, "cuda", seed), block_mask=True) if packed else None
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    if not grad:
        with torch.no_grad():
            y, ref = layer_fn(x, ctx=ctx), sdpa(x, ctx=ctx)
        torch.cuda.synchronize()  # an illegal memory access surfaces here, not as a silent result
        assert torch.isfinite(y).all()
        assert rel(y, ref) < tol and (y.float() - ref.float()).abs().max() < 10 * tol * ref.float().abs().max()
        return
    xs = [x.clone().requires_grad_() for _ in range(2)]
    y, ref = layer_fn(xs[0], ctx=ctx), sdpa(xs[1], ctx=ctx)
    dy = torch.randn_like(ref)
    y.backward(dy)
    ref.backward(dy)
    torch.cuda.synchronize()
    assert rel(y, ref) < tol
    assert rel(xs[0].grad, xs[1].grad) < tol
    params = dict(layer_fn.named_parameters()) if isinstance(layer_fn, torch.nn.Module) else {}
    for name, p in sdpa.named_parameters():
        q = params[name] if name in params else params.get(f"_orig_mod.{name}")
        assert q is not None and rel(q.grad, p.grad) < tol, name
    for p in [*sdpa.parameters(), *params.values()]:
        p.grad = None
