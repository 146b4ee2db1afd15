"""Multi-Latent Attention: the training path, the fused down-norm-up projection, the compressed KV
cache and decode (expanded and absorbed-weights).

Training (no weight absorption):

    x -> w_dq -> RMSNorm -> w_uq -> q [B,T,H,d_nope+d_rope] -> partial RoPE on the last d_rope dims
    x -> w_dkv -> [c_kv (kv_lora_rank) | k_pe (d_rope)]
         c_kv -> RMSNorm -> w_ukv -> [k_nope (d_nope) | v (d_v)] per head
         key = cat(k_nope, RoPE(k_pe) shared by every head), value = v
    attention over packed documents (causal and same-document mask) -> w_o

(`fused_down_proj` computes w_dq and w_dkv as one matmul, w_dqkv.) `recompute_kv_upproj` (default on)
runs the KV norm, up-projection and key build under a checkpoint: what those steps save for their own
backward (the normed latent) is recomputed from the small latent instead. Attention still keeps key
and value (value is a view of the up-projection output), so the big H*(d_nope+d_v) buffer lives on
either way; `megacpp-lab bench mla` measures what each flag saves. `recompute_q_upproj` does the same
for the Q side.

Packed rows: `forward(x, ctx=)` takes the batch's `PackedContext` (megacpp_lab.varlen), validated once when
it was built, as given: RoPE runs the kernels' packed thd path on its cu_seqlens (no value check, no host
sync), attention its doc_ids (sdpa), its block mask (flex) or its cu_seqlens (varlen). Bare doc_ids reach the layer through
testing.with_doc_ids, which builds (and checks) a context per call.

Decode keeps only the normed latent c_kv and one rotated rope row per token (`MLAKVCache`). The
expanded path re-projects keys and values from it; the absorbed path folds W_uk into the query and
W_uv into the output, so attention runs in kv_lora_rank dims: a decode-only choice.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, flex_attention
from torch.utils.checkpoint import checkpoint

from megacpp_lab.checks import check_ints, config_error
from megacpp_lab.kernels import TRITON_INTERPRET
from megacpp_lab.kernels.down_norm_up import FusedDownNormUp
from megacpp_lab.kernels.dsa_sparse import select_thresholds, sparse_kl
from megacpp_lab.kernels.rope import (
    mla_rope_kv,
    mla_rope_kv_reference,
    mla_rope_q_,
    mla_rope_q_reference,
)
from megacpp_lab.nn.config_builder import build_config
from megacpp_lab.nn.dsa import (
    DSAConfig,
    DSAIndexer,
    document_starts,
    dsa_attention,
    indexer_kl,
    selection_mask,
    selection_score_mod,
)
from megacpp_lab.nn.primitives import attach_loss
from megacpp_lab.nn.rope_freqs import RopeScaling, rope_cos_sin
from megacpp_lab.varlen import FLEX_BLOCK, PackedContext, context_positions, doc_causal_block_mask

__all__ = [
    "ATTN_IMPLS",
    "FLEX_KERNEL_OPTIONS",
    "FLEX_PROVEN",
    "ROPE_IMPLS",
    "FlexNotProvenError",
    "VARLEN_PROVEN",
    "VarlenRefusedError",
    "MLAConfig",
    "MLAKVCache",
    "MultiLatentAttention",
    "cache_bytes_per_token",
    "flex_kernel_options",
    "flex_refusal",
    "reads_block_mask",
    "varlen_attention",
    "varlen_attention_reference",
    "varlen_refusal",
]

ROPE_IMPLS = ("auto", "triton", "reference")
ATTN_IMPLS = ("auto", "sdpa", "flex", "varlen")


_fail = functools.partial(config_error, "MLAConfig")


@dataclass(frozen=True)
class MLAConfig:
    """MLA settings; build it with MLAConfig.build. Frozen, checked on construction.

    attn_impl: "sdpa" (scaled_dot_product_attention with a dense [B,1,T,T] same-document causal mask: the
    reference, and the CPU's path), "flex" (flex_attention over the batch's block mask, which skips the blocks no
    document reaches: 8 documents in a row of 4096 leave about 1/8 of the row's causal triangle), "varlen" (torch's
    flash varlen attention over the context's cu_seqlens: varlen_attention; CUDA, fp16/bf16, torch >= 2.10,
    varlen_refusal; a DSA layer refuses it, its attention being the indexer's selection), or "auto" (the default):
    compiled flex on a GPU wherever FLEX_PROVEN lists the (device, dtype, compiled, gradients) configuration, T is a
    multiple of FLEX_BLOCK and the batch has documents (a compiled call without the context's block mask is
    refused, as flex's is); sdpa in eager mode (flex's eager path is an unfused reference implementation, slower
    than sdpa), on a CPU, in an unproven configuration (compiled fp32, or T off the block grid, where a compiled
    flex kernel once returned wrong numbers), and with no context (one causal document a row, where sdpa's causal
    kernel skips the upper triangle itself). "auto" never takes varlen: at the base model's head dims (q/k 192, v
    128 padded to 192) it was measured slower than compiled flex with FLEX_KERNEL_OPTIONS (scripts/flex_probe.py on
    an H100 at 73a2aa1, forward+backward: 1.27 against 0.91 ms at B=4 T=4096, 8 heads, 8 documents a row; 1.34
    against 0.87 at B=2 T=8192, 16 documents; 1.22 and 1.21 with the longest document as the length bound in place
    of T, which a compiled region cannot pass without recompiling per batch)."""

    d_model: int
    n_heads: int
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    d_nope: int = 128
    d_rope: int = 64
    d_v: int = 128
    max_positions: int = 4096
    rope_base: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    fused_down_proj: bool = False
    kv_fused_down_norm_up: bool = False
    recompute_kv_upproj: bool = True
    recompute_q_upproj: bool = False
    rope_impl: str = "auto"
    attn_impl: str = "auto"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_ints("MLAConfig", self, ("d_model", "n_heads", "q_lora_rank", "kv_lora_rank", "d_nope", "d_rope", "d_v",
                                      "max_positions"))  # fmt: skip
        if self.d_rope % 2:
            raise _fail("d_rope", "even (the rotation pairs its two halves)", self.d_rope)
        for name in ("fused_down_proj", "kv_fused_down_norm_up", "recompute_kv_upproj", "recompute_q_upproj"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "a bool", getattr(self, name))
        if self.rope_impl not in ROPE_IMPLS:
            raise _fail("rope_impl", f"one of {ROPE_IMPLS}", self.rope_impl)
        if self.attn_impl not in ATTN_IMPLS:
            raise _fail("attn_impl", f"one of {ATTN_IMPLS}", self.attn_impl)
        if not isinstance(self.rope_scaling, RopeScaling):
            raise _fail("rope_scaling", "a RopeScaling", self.rope_scaling)
        if not self.rope_base > 1:
            raise _fail("rope_base", "> 1", self.rope_base)
        if not 0 < self.eps < 1:
            raise _fail("eps", "in (0, 1)", self.eps)

    @classmethod
    def build(cls, source: Any = None, **overrides: Any) -> MLAConfig:
        """The one builder: fields from a model config object (these names, mla_<name>, or Megatron's
        hidden_size / num_attention_heads / qk_head_dim / qk_pos_emb_head_dim / v_head_dim) and keyword
        overrides, else the defaults."""
        aliases = {
            "d_model": ("d_model", "hidden_size"),
            "n_heads": ("mla_n_heads", "n_heads", "num_attention_heads"),
            "d_nope": ("mla_d_nope", "d_nope", "qk_head_dim", "qk_nope_head_dim"),
            "d_rope": ("mla_d_rope", "d_rope", "qk_pos_emb_head_dim", "qk_rope_head_dim"),
            "d_v": ("mla_d_v", "d_v", "v_head_dim"),
        }
        return build_config(cls, source, overrides, prefix="mla", aliases=aliases, required=("d_model", "n_heads"))


def cache_bytes_per_token(config: MLAConfig, bytes_per_value: int = 2) -> dict[str, float]:
    """KV-cache bytes per token per layer: MLA's latent + one rope row vs MHA with the same heads and head
    dims (K of d_nope + d_rope, V of d_v per head)."""
    mla = (config.kv_lora_rank + config.d_rope) * bytes_per_value
    mha = config.n_heads * (config.d_nope + config.d_rope + config.d_v) * bytes_per_value
    return {"mla_bytes": float(mla), "mha_bytes": float(mha), "ratio": mha / mla}


# ----------------------------------------------------------------------------- KV cache


class MLAKVCache:
    """Per layer: low_rank_main [B, T_max, kv_lora_rank] (the normed latent) and a rope cache
    [B, T_max, 1, d_rope] (the rotated key row). The length is uniform across the batch.

    Every layer `update`s at the current length; `advance` moves the length once, after the whole
    layer stack. With strict=True (the default) advance fails unless every layer wrote exactly once
    at this length: a per-layer advance (an early bring-up bug) would make each layer write a different
    slot and read a cache with holes."""

    def __init__(self, n_layers: int, batch: int, max_len: int, kv_lora_rank: int, d_rope: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None, strict: bool = True,
                 index_dims: Sequence[int | None] | None = None):  # fmt: skip
        if min(n_layers, batch, max_len, kv_lora_rank, d_rope) < 1:
            raise ValueError(f"MLAKVCache sizes must be >= 1, got n_layers={n_layers} batch={batch} "
                             f"max_len={max_len} kv_lora_rank={kv_lora_rank} d_rope={d_rope}")  # fmt: skip
        self.low_rank_main = [torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rope_caches = [torch.zeros(batch, max_len, 1, d_rope, dtype=dtype, device=device) for _ in range(n_layers)]
        # a DSA layer's indexer keys [B, T_max, d_I] (index_dims[layer]: its indexer head size; None: not DSA), fp32
        # as the indexer scores them: its selection of each new query's keys reads every earlier token's
        dims = [None] * n_layers if index_dims is None else list(index_dims)
        if len(dims) != n_layers:
            raise ValueError(f"index_dims must name one entry per layer ({n_layers}), got {len(dims)}")
        self.index_keys = [None if d is None else torch.zeros(batch, max_len, d, dtype=torch.float32, device=device)
                           for d in dims]  # fmt: skip
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.length = 0  # host mirror of cache_seqlens (uniform), so update needs no device sync
        self.pending = 0  # tokens written at this length, awaiting advance
        self.strict = strict
        self._written: set[int] = set()

    @property
    def max_len(self) -> int:
        return self.low_rank_main[0].shape[1]

    def update(self, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T_new tokens of `layer` at the current length; return its cache up to length + T_new."""
        if not 0 <= layer < len(self.low_rank_main):
            raise ValueError(f"layer must be in [0, {len(self.low_rank_main)}), got {layer}")
        main, rope = self.low_rank_main[layer], self.rope_caches[layer]
        B, T_new = c_kv.shape[:2]
        if c_kv.shape != (B, T_new, main.shape[2]) or B != main.shape[0]:
            raise ValueError(f"c_kv must be [{main.shape[0]}, T_new, {main.shape[2]}], got {tuple(c_kv.shape)}")
        if k_pe.shape != (B, T_new, 1, rope.shape[3]):
            raise ValueError(f"k_pe must be [{B}, {T_new}, 1, {rope.shape[3]}], got {tuple(k_pe.shape)}")
        if self.length + T_new > self.max_len:
            raise ValueError(f"cache overflow: length {self.length} + {T_new} new tokens > max_len {self.max_len}")
        if self.strict and layer in self._written:
            raise ValueError(f"layer {layer} already wrote at length {self.length}: call advance once after the whole stack")
        if self.pending and T_new != self.pending:
            raise ValueError(f"layer {layer} writes {T_new} tokens but this step's other layers wrote {self.pending}")
        start = self.length
        main[:, start : start + T_new] = c_kv.to(main.dtype)
        rope[:, start : start + T_new] = k_pe.to(rope.dtype)
        self._written.add(layer)
        self.pending = T_new
        return main[:, : start + T_new], rope[:, : start + T_new]

    def update_index(self, layer: int, k_index: torch.Tensor) -> torch.Tensor:
        """Write T_new indexer keys [B,T_new,d_I] of DSA `layer` at the current length (with its update call);
        return its indexer keys up to length + T_new."""
        keys = self.index_keys[layer] if 0 <= layer < len(self.index_keys) else None
        if keys is None:
            raise ValueError(f"layer {layer} holds no indexer keys (MLAKVCache index_dims): it is not a DSA layer")
        B, T_new = k_index.shape[:2]
        if k_index.shape != (keys.shape[0], T_new, keys.shape[2]):
            raise ValueError(f"k_index must be [{keys.shape[0]}, T_new, {keys.shape[2]}], got {tuple(k_index.shape)}")
        if self.length + T_new > self.max_len:
            raise ValueError(f"cache overflow: length {self.length} + {T_new} new tokens > max_len {self.max_len}")
        keys[:, self.length : self.length + T_new] = k_index.float()
        return keys[:, : self.length + T_new]

    def advance(self) -> None:
        """Move the length past this step's tokens; once per step, after every layer updated."""
        if self.strict and len(self._written) != len(self.low_rank_main):
            missing = sorted(set(range(len(self.low_rank_main))) - self._written)
            raise ValueError(f"advance before every layer updated (missing layers {missing}); advance once per step, "
                             "after the whole layer stack, never per layer")  # fmt: skip
        self.length += self.pending
        self.cache_seqlens += self.pending
        self.pending = 0
        self._written.clear()

    def nbytes_per_token(self) -> int:
        """Bytes per token per layer held by this cache."""
        return (self.low_rank_main[0].shape[2] + self.rope_caches[0].shape[3]) * self.low_rank_main[0].element_size()


# ----------------------------------------------------------------------------- the layer


def _doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B,1,T,T] bool: query t sees key s iff s <= t and both lie in the same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


# Where the flex path has been checked against the dense SDPA path (tests/test_mla_flex.py), as (device type,
# dtype, compiled, gradients). CPU: fp32 without gradients (flex has no CPU backward). CUDA: bf16 compiled
# on an H100 over B in {1, 2, 4} x T in {256, 1024, 2048} and one module walked over other shapes, with and
# without gradients; eager bf16 and fp32. Compiled fp32 is not: at head dim 192 its kernel overflows shared
# memory. Compiled flex also needs T to be a multiple of FLEX_BLOCK: one compiled module that had recompiled
# for dynamic shapes returned wrong numbers with no error at T=100 under no_grad (H100, torch 2.11). Anything
# else is refused until a test proves it: compiled flex once returned wrong numbers with no error.
FLEX_PROVEN: frozenset[tuple[str, torch.dtype, bool, bool]] = frozenset(
    [("cpu", torch.float32, compiled, False) for compiled in (False, True)]
    + [("cuda", dtype, False, grad) for dtype in (torch.float32, torch.bfloat16) for grad in (False, True)]
    + [("cuda", torch.bfloat16, True, grad) for grad in (False, True)]
)  # fmt: skip


# Compiled flex attention's launch options where torch's own choice was measured slower, by (CUDA capability, dtype,
# q/k head dim, v head dim): flex_attention's kernel_options (fwd_/bwd_ block sizes, stages, warps), which pin the
# launch (under inductor's max-autotune too: they override every candidate). scripts/flex_probe.py measures them
# against torch's default on the A block's shapes (its output: profiles/<device>/attention/flex_probe.json); a
# listed configuration runs every compiled flex test of tests/test_mla_flex.py (their REAL head dims are the base
# model's), which compare it with sdpa.
# sm90, bf16, 192/128 (the base model's MLA): torch 2.11 picks forward 64/64 (3 stages, 4 warps) and backward
# 64/64/64/64 (2 stages, 4 warps); these took the forward and backward 0.91 ms against 1.51 at B=4 T=4096 8 heads
# 8 docs/row, and 0.89/1.51, 1.50/2.60, 2.10/3.74 at (2, 8192, 8 heads, 16 docs), (8, 2048, 16 heads, 4 docs),
# (4, 4096, 8 heads, 1 doc), the same output and gradients bit for bit (H100). At this head dim the forward's
# 64/128 and 128/128 blocks, its 128/64 at 4 stages and the backward's 64/128/128/64 at 3 stages overflow shared
# memory.
FLEX_KERNEL_OPTIONS: dict[tuple[tuple[int, int], torch.dtype, int, int], dict[str, int]] = {
    ((9, 0), torch.bfloat16, 192, 128): dict(fwd_BLOCK_M=128, fwd_BLOCK_N=64, fwd_num_stages=3, fwd_num_warps=8,
                                             bwd_BLOCK_M1=32, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=32,
                                             bwd_num_stages=3, bwd_num_warps=8),
}


@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def flex_kernel_options(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int) -> dict[str, int] | None:
    """FLEX_KERNEL_OPTIONS's entry for attention in `dtype` of head dims d_qk (queries, keys) and d_v (values) on
    `device`, or None (torch's choice; every device but CUDA). A constant under torch.compile: the capability is read
    at trace time."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return FLEX_KERNEL_OPTIONS.get((_capability(index), dtype, d_qk, d_v))


class FlexNotProvenError(NotImplementedError):
    """The flex path refuses a configuration no test has checked against sdpa (see flex_refusal)."""


def flex_refusal(device: torch.device, dtype: torch.dtype, *, compiled: bool, grad: bool, seq_len: int,
                 has_block_mask: bool) -> str | None:  # fmt: skip
    """Why the flex path must not run this configuration, or None: it must be listed in FLEX_PROVEN and,
    compiled, have a block mask built outside the compiled region and T a multiple of FLEX_BLOCK."""
    if compiled and not has_block_mask:
        return ("MultiLatentAttention(attn_impl='flex') under torch.compile needs a context with a block mask: build it "
                "once per batch outside the compiled region (build_context(doc_ids, block_mask=True)). Built inside, "
                "inductor fuses the mask into the attention kernel, which gave wrong numbers and illegal memory "
                "accesses")  # fmt: skip
    if compiled and seq_len % FLEX_BLOCK:
        return (f"compiled attn_impl='flex' needs T to be a multiple of {FLEX_BLOCK}, got T={seq_len} (a compiled flex "
                "kernel returned wrong numbers with no error at T=100); pad the rows, run it eagerly, or use 'sdpa'")  # fmt: skip
    if (device.type, dtype, compiled, grad) not in FLEX_PROVEN:
        mode = ("compiled" if compiled else "eager") + (" with gradients" if grad else " without gradients")
        return (f"attn_impl='flex' is not proven on {device.type} {str(dtype).removeprefix('torch.')} {mode}; use "
                "attn_impl='sdpa', or add the configuration to megacpp_lab.nn.mla.FLEX_PROVEN with a test against sdpa")  # fmt: skip
    return None


@torch.compiler.disable(
    reason="MultiLatentAttention refuses this compiled attention call (attn_impl 'flex': a context with a block mask "
    "built outside the compiled region, T a multiple of 128, a configuration in FLEX_PROVEN; 'varlen': see "
    "varlen_refusal); compiled without fullgraph, or run eagerly, it raises the exact reason"
)
def _refuse_compiled(error: Exception) -> NoReturn:
    # Outside the graph on purpose: a raise traced inside it, without fullgraph, only breaks the graph, and
    # the layer then re-runs eagerly, where is_compiling() is False and nothing refuses.
    raise error


# torch's flash varlen attention (torch.nn.attention.varlen, torch >= 2.10): one launch over the batch's documents
# laid end to end ([B*T, heads, D] and cu_seqlens), each query attending its own document's keys only; flash
# attention needs one head dim for q, k and v, so v is zero-padded to the q/k head dim and the output cut back.
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.10
    _varlen_attn = None
# Its causal switch, read once from the signature: torch 2.10 takes is_causal=True, later versions window_size=(-1, 0).
VARLEN_CAUSAL: dict[str, Any] = (
    {}
    if _varlen_attn is None
    else {"window_size": (-1, 0)}
    if "window_size" in inspect.signature(_varlen_attn).parameters
    else {"is_causal": True}
)
VARLEN_TAKES_SCALE = _varlen_attn is not None and "scale" in inspect.signature(_varlen_attn).parameters
VARLEN_MAX_HEAD_DIM = 256  # flash attention's largest head dim
# Where the varlen path has been checked on a GPU, as (CUDA capability, dtype, q/k head dim, v head dim): sm90 (an
# H100 tested) in bf16 at the base model's 192/128 (tests/test_mla_varlen.py against sdpa: eager and compiled, with
# gradients, the leak harness) and the tiny preset's 32/16 (tests/test_saved_graphs.py: a model step through saved
# graphs ran on an H100 at df0ede7; the test's comparison with the eager step, added in 37c2589, has not run on a GPU
# yet). Anything else is refused until a test proves it.
VARLEN_PROVEN: frozenset[tuple[tuple[int, int], torch.dtype, int, int]] = frozenset(
    {((9, 0), torch.bfloat16, 192, 128), ((9, 0), torch.bfloat16, 32, 16)}
)


class VarlenRefusedError(NotImplementedError):
    """attn_impl='varlen' cannot run this call (see varlen_refusal)."""


def varlen_refusal(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int,
                   capability: tuple[int, int] | None = None) -> str | None:  # fmt: skip
    """Why torch's flash varlen attention cannot run a call on `device` in `dtype` with these head dims, or None:
    it must be in VARLEN_PROVEN. capability: the device's CUDA capability (read from the device when None)."""
    if _varlen_attn is None:
        return f"attn_impl='varlen' needs torch >= 2.10 (torch.nn.attention.varlen); this is torch {torch.__version__}"
    if not VARLEN_TAKES_SCALE:
        return f"attn_impl='varlen' passes the layer's softmax scale, which this torch's varlen_attn ({torch.__version__}) does not take"
    if device.type != "cuda":
        return f"attn_impl='varlen' runs flash attention, CUDA only; got a {device.type} tensor: use 'sdpa'"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"attn_impl='varlen' needs float16 or bfloat16 (flash attention), got {str(dtype).removeprefix('torch.')}"
    if d_qk > VARLEN_MAX_HEAD_DIM or d_qk % 8:
        return f"attn_impl='varlen' needs a q/k head dim (d_nope + d_rope) <= {VARLEN_MAX_HEAD_DIM} and a multiple of 8, got {d_qk}"
    if d_v > d_qk:
        return f"attn_impl='varlen' pads v to the q/k head dim, so d_v must be <= d_nope + d_rope, got d_v={d_v} > {d_qk}"
    if capability is None:
        capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if (tuple(capability), dtype, d_qk, d_v) not in VARLEN_PROVEN:
        return (f"attn_impl='varlen' is not proven on CUDA capability {tuple(capability)} in "
                f"{str(dtype).removeprefix('torch.')} at head dims {d_qk}/{d_v}; use 'flex' or 'sdpa', or add the "
                "configuration to megacpp_lab.nn.mla.VARLEN_PROVEN with a test against sdpa")  # fmt: skip
    return None


def varlen_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                               cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                               **causal: Any) -> torch.Tensor:  # fmt: skip
    """varlen_attn's contract in plain torch (the tests' stand-in for the kernel on a CPU): [N, heads, D] q/k/v of
    documents laid end to end at cu_seq_q (= cu_seq_k), causal attention inside each document. `causal` is the
    keyword VARLEN_CAUSAL names (is_causal=True or window_size=(-1, 0)); any other mask is refused. max_q and
    max_k bound the documents' lengths, as the kernel's grid does."""
    if not (causal.get("is_causal") is True or tuple(causal.get("window_size", ())) == (-1, 0)) or len(causal) != 1:
        raise ValueError(f"varlen_attention_reference: causal attention only (is_causal=True or window_size=(-1, 0)), got {causal}")
    if not torch.equal(cu_seq_q, cu_seq_k):
        raise ValueError("varlen_attention_reference: self-attention only (cu_seq_q == cu_seq_k)")
    bounds = cu_seq_q.tolist()
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != query.shape[0] or min(lengths) <= 0 or max(lengths) > min(max_q, max_k):
        raise ValueError(f"varlen_attention_reference: cu_seqlens {bounds} must run 0..{query.shape[0]} in documents "
                         f"of 1..{min(max_q, max_k)} tokens")  # fmt: skip
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def varlen_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:  # fmt: skip
    """q, key [B,T,H,d_qk], value [B,T,H,d_v] of packed rows, cu_seqlens [S+1] int32 over the flattened B*T tokens
    -> [B,T,H,d_v]: causal attention inside each document, in one flash varlen launch. Its longest-document bound
    is T (a static bound, so a compiled region does not recompile per batch; the kernel's extra query tiles of
    shorter documents exit at once)."""
    B, T, H, d_qk = q.shape
    d_v = value.shape[-1]
    v = F.pad(value, (0, d_qk - d_v)) if d_v < d_qk else value
    flat = [t.reshape(B * T, H, d_qk) for t in (q, key, v)]
    out = _varlen_attn(*flat, cu_seqlens, cu_seqlens, T, T, scale=scale, **VARLEN_CAUSAL)
    return out[..., :d_v].reshape(B, T, H, d_v)


class MultiLatentAttention(nn.Module):
    """[B,T,d_model] -> [B,T,d_model] MLA over packed rows (the batch's PackedContext keeps documents apart)."""

    # the RoPE tables: the Triton kernels take fp32 cos/sin only, and bf16 tables would round the angles
    _fp32_params = ("rope_cos", "rope_sin")

    def __init__(self, config: MLAConfig, dsa: DSAConfig | None = None) -> None:
        super().__init__()
        self.config = c = config
        H = c.n_heads
        # DSA (nn/dsa.py): the lightning indexer that picks each query's keys; None: dense attention
        self.indexer = DSAIndexer(dsa, c.q_lora_rank) if dsa is not None else None
        if dsa is not None and c.attn_impl == "varlen":
            raise _fail("attn_impl", "not 'varlen' in a DSA layer (its attention is the indexer's selection: "
                        "DSAConfig.attn_impl)", c.attn_impl)  # fmt: skip
        if dsa is not None and dsa.attn_impl != "reference":
            for name in ("d_nope", "d_rope"):  # sparse_kl's two tl.dot pieces
                n = getattr(c, name)
                if n < 16 or n & (n - 1):
                    raise _fail(name, "a power of two >= 16 in a DSA layer whose attn_impl is not 'reference' "
                                "(the fused KL's tl.dot pieces)", n)  # fmt: skip
        if c.fused_down_proj:
            self.w_dqkv = nn.Linear(c.d_model, c.q_lora_rank + c.kv_lora_rank + c.d_rope, bias=False)
        else:
            self.w_dq = nn.Linear(c.d_model, c.q_lora_rank, bias=False)
            self.w_dkv = nn.Linear(c.d_model, c.kv_lora_rank + c.d_rope, bias=False)
        self.q_norm = nn.RMSNorm(c.q_lora_rank, eps=c.eps)
        self.kv_norm = nn.RMSNorm(c.kv_lora_rank, eps=c.eps)
        self.w_uq = nn.Linear(c.q_lora_rank, H * (c.d_nope + c.d_rope), bias=False)
        self.w_ukv = nn.Linear(c.kv_lora_rank, H * (c.d_nope + c.d_v), bias=False)
        self.w_o = nn.Linear(H * c.d_v, c.d_model, bias=False)
        cos, sin = rope_cos_sin(c.max_positions, c.d_rope, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # the cos/sin tables stay fp32 whatever dtype the module is cast to: rebuilt, not cast back
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32:
            c = self.config
            cos, sin = rope_cos_sin(c.max_positions, c.d_rope, c.rope_base, c.rope_scaling)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        return self

    # -- pieces

    def _use_triton(self, device: torch.device) -> bool:
        impl = self.config.rope_impl
        if impl == "auto":
            return device.type == "cuda"  # the kernels need a GPU; on CPU the reference is the only path
        if impl == "triton" and device.type != "cuda":
            if not TRITON_INTERPRET:
                raise RuntimeError("rope_impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
        return impl == "triton"

    def down_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        if c.fused_down_proj:
            return self.w_dqkv(x).split((c.q_lora_rank, c.kv_lora_rank, c.d_rope), dim=-1)
        q_lat = self.w_dq(x)
        c_lat, k_pe = self.w_dkv(x).split((c.kv_lora_rank, c.d_rope), dim=-1)
        return q_lat, c_lat, k_pe

    def q_up_rope(self, q_lat: torch.Tensor, positions: torch.Tensor | None = None, *,
                  ctx: PackedContext | None = None) -> torch.Tensor:  # fmt: skip
        c = self.config
        B, T = q_lat.shape[:2]
        q = self.w_uq(self.q_norm(q_lat)).view(B, T, c.n_heads, c.d_nope + c.d_rope)
        return self.rope(q, c.d_nope, positions, ctx=ctx)

    def rope(self, x: torch.Tensor, d_nope: int, positions: torch.Tensor | None = None, *,
             ctx: PackedContext | None = None) -> torch.Tensor:  # fmt: skip
        """Partial RoPE of x [B,T,H,d_nope+d_rope]: the Triton kernel (in place) or the reference. Positions:
        ctx (a PackedContext: the kernel's packed thd path over its cu_seqlens, validated when the context was
        built, so nothing is checked or derived again; the reference takes its positions), else positions
        [B,T], else 0..T-1 per row."""
        if self._use_triton(x.device):
            return mla_rope_q_(x, self.rope_cos, self.rope_sin, d_nope, positions=positions, ctx=ctx)
        positions = ctx.positions if ctx is not None else positions
        return mla_rope_q_reference(x, self.rope_cos, self.rope_sin, d_nope, positions=positions)

    def kv_up_rope(self, x: torch.Tensor, c_lat: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor | None = None,
                   *, ctx: PackedContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        c = self.config
        B, T = c_lat.shape[:2]
        if c.kv_fused_down_norm_up:  # latent recomputed from x in the backward, only rrms kept
            w_down = (self.w_dqkv.weight[c.q_lora_rank : c.q_lora_rank + c.kv_lora_rank] if c.fused_down_proj
                      else self.w_dkv.weight[: c.kv_lora_rank])  # fmt: skip
            kv = FusedDownNormUp.apply(x, w_down, self.kv_norm.weight, self.w_ukv.weight, c.eps)
        else:
            kv = self.w_ukv(self.kv_norm(c_lat))
        kv = kv.view(B, T, c.n_heads, c.d_nope + c.d_v)
        if self._use_triton(kv.device):
            return mla_rope_kv(kv, k_pe, self.rope_cos, self.rope_sin, c.d_nope, positions=positions, ctx=ctx)
        positions = ctx.positions if ctx is not None else positions
        return mla_rope_kv_reference(kv, k_pe, self.rope_cos, self.rope_sin, c.d_nope, positions=positions)

    def attends_through_flex(self, device: torch.device) -> bool:
        """Whether this layer's attention can run flex_attention on `device`: attn_impl 'flex', or 'auto' on a GPU
        (compiled), or a DSA layer's flex path (what regional compile and HybridLM.needs_block_mask ask)."""
        auto = self.config.attn_impl == "auto" and device.type == "cuda"
        return self.config.attn_impl == "flex" or auto or (self.indexer is not None and self.indexer.config.attn_impl != "reference")

    def auto_impl(self, device: torch.device, dtype: torch.dtype, *, compiling: bool, grad: bool, seq_len: int,
                   ctx: PackedContext | None) -> str:  # fmt: skip
        """What attn_impl='auto' runs (MLAConfig.attn_impl): compiled flex over the documents where a test proved
        it, else sdpa. Never varlen: measured slower than flex at the base model's head dims (MLAConfig)."""
        proven = (device.type, dtype, compiling, grad) in FLEX_PROVEN and seq_len % FLEX_BLOCK == 0
        return "flex" if device.type == "cuda" and compiling and ctx is not None and proven else "sdpa"

    def _attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: PackedContext | None) -> torch.Tensor:
        """q, key [B,T,H,d_nope+d_rope], value [B,T,H,d_v] -> [B,T,H,d_v], by MLAConfig.attn_impl."""
        c = self.config
        scale = 1.0 / math.sqrt(c.d_nope + c.d_rope)
        compiling = torch.compiler.is_compiling()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, key, value))
        B, T = q.shape[:2]
        impl = c.attn_impl
        if impl == "auto":
            impl = self.auto_impl(q.device, q.dtype, compiling=compiling, grad=grad, seq_len=T, ctx=ctx)
        if impl == "varlen":
            reason = varlen_refusal(q.device, q.dtype, q.shape[-1], value.shape[-1])
            if reason is not None:
                if compiling:
                    _refuse_compiled(VarlenRefusedError(reason))
                raise VarlenRefusedError(reason)
            # without a context, one causal document a row: its cu_seqlens are the rows' bounds
            cu = ctx.cu_seqlens if ctx is not None else torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
            return varlen_attention(q, key, value, cu, scale)
        q, key, value = (t.transpose(1, 2) for t in (q, key, value))
        if impl == "flex":
            block_mask = ctx.block_mask if ctx is not None else None
            reason = flex_refusal(q.device, q.dtype, compiled=compiling, grad=grad, seq_len=q.shape[2],
                                  has_block_mask=block_mask is not None)  # fmt: skip
            if reason is not None:
                if compiling:
                    _refuse_compiled(FlexNotProvenError(reason))
                raise FlexNotProvenError(reason)
            if block_mask is None:  # eager only (flex_refusal): built here from the context's doc_ids
                block_mask = doc_causal_block_mask(ctx.doc_ids if ctx is not None else None, batch=q.shape[0],
                                                   seq_len=q.shape[2], device=q.device)  # fmt: skip
            # contiguous: inductor's CPU flex lowering fails on q/k/v that are views of a concat
            out = flex_attention(q.contiguous(), key.contiguous(), value.contiguous(), block_mask=block_mask, scale=scale,
                                 kernel_options=flex_kernel_options(q.device, q.dtype, q.shape[-1], value.shape[-1]))
        elif ctx is None:
            out = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=_doc_causal_mask(ctx.doc_ids), scale=scale)
        return out.transpose(1, 2)

    # -- training forward

    def forward(self, x: torch.Tensor, *, ctx: PackedContext | None = None) -> torch.Tensor:
        """x [B,T,d_model]; ctx, the batch's PackedContext (validated once when it was built, taken as given),
        or None for one document per row (RoPE rows 0..T-1, causal attention). With ctx, RoPE runs the
        kernels' packed thd path on its cu_seqlens (no value check, no host sync; the reference takes its
        positions), attention reads its doc_ids (sdpa), its block_mask (flex; build_context(block_mask=True),
        outside any compiled region; an eager call without one has it built here) or its cu_seqlens (varlen)."""
        c = self.config
        B, T, _ = x.shape
        context_positions(ctx, tuple(x.shape))  # a context of another batch shape fails here, by name
        if T > c.max_positions:
            raise ValueError(f"sequence length {T} exceeds MLAConfig.max_positions={c.max_positions}")
        q_lat, c_lat, k_pe = self.down_proj(x)
        # ctx reaches a checkpointed function by closure, never as an argument: dynamo flattens a checkpoint's
        # arguments, reading every field of the frozen PackedContext, and guarded its int max_seqlen (one
        # recompile per new longest document; seen on an H100, torch 2.11)
        if c.recompute_q_upproj and torch.is_grad_enabled():
            q = checkpoint(lambda q_lat_: self.q_up_rope(q_lat_, None, ctx=ctx), q_lat, use_reentrant=False)
        else:
            q = self.q_up_rope(q_lat, None, ctx=ctx)
        if c.recompute_kv_upproj and torch.is_grad_enabled():
            key, value = checkpoint(lambda x_, c_lat_, k_pe_: self.kv_up_rope(x_, c_lat_, k_pe_, None, ctx=ctx),
                                    x, c_lat, k_pe, use_reentrant=False)  # fmt: skip
        else:
            key, value = self.kv_up_rope(x, c_lat, k_pe, None, ctx=ctx)
        out = self._attend(q, key, value, ctx) if self.indexer is None else self._attend_sparse(x, q_lat, q, key, value, ctx)
        return self.w_o(out.reshape(B, T, c.n_heads * c.d_v))

    def _attend_sparse(self, x: torch.Tensor, q_lat: torch.Tensor, q: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, ctx: PackedContext | None) -> torch.Tensor:  # fmt: skip
        """DSA (nn/dsa.py): the indexer's scores, the keys its phase attends ("warmup": every allowed key;
        "sparse": each query's top_k), and the indexer's KL loss attached to the output while training. The flex
        path or the reference (DSAConfig.attn_impl)."""
        c, dsa = self.config, self.indexer.config
        B, T = x.shape[:2]
        starts = document_starts(None if ctx is None else ctx.doc_ids, None if ctx is None else ctx.positions, B, T,
                                 x.device)  # fmt: skip
        scores = self.indexer(x, q_lat, starts)  # [B,T,T] fp32 (Triton: zero where a query may not select the key)
        scale = 1.0 / math.sqrt(c.d_nope + c.d_rope)
        sparse = self.indexer.phase == "sparse"
        train_kl = self.training and torch.is_grad_enabled() and dsa.loss_weight > 0
        impl = dsa.attn_impl if dsa.attn_impl != "auto" else ("flex" if x.is_cuda else "reference")
        if impl == "reference":
            doc_ids = ctx.doc_ids if ctx is not None else torch.zeros(B, T, dtype=torch.int64, device=x.device)
            mask = selection_mask(scores, dsa.top_k if sparse else T, doc_ids)
            out, probs = dsa_attention(q, key, value, mask, scale)
            return attach_loss(out, dsa.loss_weight * indexer_kl(probs, scores, mask)) if train_kl else out
        compiling = torch.compiler.is_compiling()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, key, value))
        block_mask = ctx.block_mask if ctx is not None else None
        reason = flex_refusal(q.device, q.dtype, compiled=compiling, grad=grad, seq_len=T,
                              has_block_mask=block_mask is not None)  # fmt: skip
        if reason is not None:
            reason = "a DSA layer's flex path (DSAConfig.attn_impl): " + reason.replace(
                "attn_impl='sdpa'", "DSAConfig.attn_impl='reference'")
            if compiling:
                _refuse_compiled(FlexNotProvenError(reason))
            raise FlexNotProvenError(reason)
        if block_mask is None:  # eager only (flex_refusal): built here
            block_mask = doc_causal_block_mask(ctx.doc_ids if ctx is not None else None, batch=B, seq_len=T,
                                               device=x.device)  # fmt: skip
        if sparse:
            thr, cut = select_thresholds(scores, starts, dsa.top_k)
            score_mod = selection_score_mod(scores, thr, cut)
        else:  # the warm-up keeps every allowed key: the block mask alone
            thr = torch.full((B, T), float("-inf"), device=x.device)
            cut = torch.full((B, T), T - 1, dtype=torch.int32, device=x.device)
            score_mod = None
        q_h, k_h, v_h = (t.transpose(1, 2).contiguous() for t in (q, key, value))
        out, aux = flex_attention(q_h, k_h, v_h, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  return_aux=AuxRequest(lse=True))  # fmt: skip
        lse = aux.lse
        out = out.transpose(1, 2)
        if not train_kl:
            return out
        kl = sparse_kl(q, key, lse, scores, starts, thr, cut, scale, c.d_nope)
        return attach_loss(out, dsa.loss_weight * kl.mean())

    # -- decode

    def _decode_selection(self, x: torch.Tensor, q_lat: torch.Tensor, cache: MLAKVCache, layer: int,
                          positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """A DSA layer's keys for T_new decoded queries, [B,T_new,S] bool: its indexer scores every cached key (the
        new ones' indexer keys written to the cache first), and each query keeps its top_k at or before it, ties to
        the lower index, as selection_mask does in training; in the warm-up phase every key at or before it."""
        ix = self.indexer
        c = ix.config
        B, T_new, _ = x.shape
        q_i = ix.w_q(ix.q_norm(q_lat)).view(B, T_new, c.n_heads, c.head_dim).float()
        keys = cache.update_index(layer, ix.k_norm(ix.w_k(x)))  # [B,S,d_I] fp32
        w = ix.w_w(x).float() * c.n_heads**-0.5
        scores = torch.einsum("bth,bths->bts", w, torch.einsum("bthd,bsd->bths", q_i, keys).relu())
        visible = torch.arange(keys.shape[1], device=x.device)[None, None, :] <= positions[None, :, None]
        if ix.phase != "sparse":
            return visible.expand(B, -1, -1)
        k = min(c.top_k, keys.shape[1])
        order = torch.sort(scores.masked_fill(~visible, float("-inf")), dim=-1, descending=True, stable=True).indices
        keep = torch.zeros(B, T_new, keys.shape[1], dtype=torch.bool, device=x.device).scatter(-1, order[..., :k], True)
        return keep & visible

    def decode(self, x: torch.Tensor, cache: MLAKVCache, layer: int, *, absorbed: bool = False) -> torch.Tensor:
        """T_new tokens [B,T_new,d_model] that follow the cache's current length (one document per row).
        Writes this layer's latent and rope row (and a DSA layer's indexer keys: the cache needs index_dims);
        the caller advances the cache after all layers."""
        c = self.config
        B, T_new, _ = x.shape
        L = cache.length
        positions = (L + torch.arange(T_new, device=x.device)).expand(B, T_new)
        q_lat, c_lat, k_pe = self.down_proj(x)
        q = self.q_up_rope(q_lat, positions)
        pe = self.rope(k_pe.unsqueeze(2).clone(), 0, positions)  # the cached row: the Q-side kernel, H=1
        selected = self._decode_selection(x, q_lat, cache, layer, positions[0]) if self.indexer is not None else None
        c_all, pe_all = cache.update(layer, self.kv_norm(c_lat), pe)
        S = c_all.shape[1]
        visible = torch.arange(S, device=x.device)[None, :] <= positions[0][:, None]  # [T_new, S]
        if selected is not None:  # a DSA layer: the keys its indexer keeps, [B,1,T_new,S]
            visible = (visible & selected)[:, None]
        scale = 1.0 / math.sqrt(c.d_nope + c.d_rope)
        w_ukv = self.w_ukv.weight.view(c.n_heads, c.d_nope + c.d_v, c.kv_lora_rank)
        q_nope, q_pe = q[..., : c.d_nope], q[..., c.d_nope :]
        if absorbed:  # W_uk folded into q, W_uv into the output: attention in kv_lora_rank dims
            q_abs = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_ukv[:, : c.d_nope].float())
            scores = torch.einsum("bthr,bsr->bhts", q_abs, c_all.float())
            scores = scores + torch.einsum("bthd,bsd->bhts", q_pe.float(), pe_all[:, :, 0].float())
            p = (scores * scale).masked_fill(~visible, float("-inf")).softmax(-1)
            o_lat = torch.einsum("bhts,bsr->bthr", p, c_all.float())
            out = torch.einsum("bthr,hvr->bthv", o_lat, w_ukv[:, c.d_nope :].float()).to(x.dtype)
        else:
            kv = self.w_ukv(c_all.to(x.dtype)).view(B, S, c.n_heads, c.d_nope + c.d_v)
            key = torch.cat((kv[..., : c.d_nope], pe_all.to(x.dtype).expand(-1, -1, c.n_heads, -1)), dim=-1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2), kv[..., c.d_nope :].transpose(1, 2),
                                                 attn_mask=visible, scale=scale).transpose(1, 2)  # fmt: skip
        return self.w_o(out.reshape(B, T_new, c.n_heads * c.d_v))


def reads_block_mask(module: nn.Module, device: torch.device) -> bool:
    """Whether an attention layer in `module` (itself included) reads the batch's flex block mask on `device`
    (MultiLatentAttention.attends_through_flex): whoever calls such a module compiled must hand it a context whose
    block mask was built outside the compiled region (PackedContext.with_block_mask)."""
    return any(isinstance(m, MultiLatentAttention) and m.attends_through_flex(device) for m in module.modules())
