"""Mamba-3's scan (Lahoti et al., ICLR 2026) over packed rows: the step-loop reference and the SSD-based scan.

Mamba-3 changes Mamba-2's SSD recurrence in three ways; the SISO form (one input and one output per head and
step) is

    theta_t = (theta_{t-1} + pi * tanh(angles_t) * dt_t) mod 2 pi          data-dependent rotary angles
    k_t = rot(B_t + b_bias, theta_t),  q_t = rot(C_t + c_bias, theta_t)   (a complex-valued state, as rotations)
    lam_t = sigmoid(trap_t),  alpha_t = exp(dt_t * A)
    S_t = alpha_t S_{t-1} + (1 - lam_t) dt_t alpha_t x_{t-1} k_{t-1}^T + lam_t dt_t x_t k_t^T    (trapezoid)
    y_t = S_t q_t + D x_t

with S [P,N] per head in fp32. The trapezoid mixes the current input and the previous one (which is why the
block needs no short convolution); with lam = 1 and no angles it is Mamba-2's SSD exactly (tests/test_mamba3.py
checks that against kernels/ssd.py's step loop). At every document start the whole state restarts: S, the
previous input and key (so the trapezoid's previous term is zero there) and the angles.

**MIMO** (rank R): each head takes R inputs x_r = x * mimo_x[h, r] (a learned scale per rank and channel), R
keys and R queries (B, C and their biases per rank), into one shared state: S_t = alpha_t S_{t-1} + sum_r (the
trapezoid's two terms of rank r), y_{t,r} = S_t q_{t,r} + D x_{t,r}. The state update is a rank-R matmul, which
raises the arithmetic intensity; R = 1 with mimo_x = 1 is SISO. The angles are shared by the ranks.

**The scan is Mamba-2's SSD with an input weight, over rank sub-tokens.** Token s's x_s k_s^T enters S_t
(t >= s) with weight (gamma_s + [t > s] delta_{s+1}) prod_{j=s+1..t} alpha_j, where gamma_s = lam_s dt_s and
delta_{s+1} = (1 - lam_{s+1}) dt_{s+1} (zero when s+1 starts a document): the trapezoid's previous term is token
s's contribution one step later. So the SSD scan (kernels/ssd.py: its chunked torch form, or the lab's Triton
op) runs with the input weight w = gamma + delta_next apart from the decay. For MIMO it runs over T*R
sub-tokens (t, r): rank 0 carries the step's decay, ranks r > 0 have dt = 0 (decay 1) and the same weight. The
SSD output at (t, r') then holds the same step's ranks r <= r' at weight w; the exact same-step term is gamma for
every rank, so y_{t,r'} += sum_r c_{r'r} (q_{t,r'} . k_{t,r}) x_{t,r} with c = gamma where r > r' and -delta_next
where r <= r' (for SISO, the diagonal -delta_next (q . k) x). That is the chunked torch path (the CPU's).

**The Triton op** (`megacpp::mamba3_scan_fwd`, kernel="triton", the GPU's) needs no correction: kernels/ssd.py's
kernels run in a Mamba-3 mode where a step's own inputs take gamma and every earlier step's take w (the decay mask
and the weights by step, so a step's ranks see each other), which makes the diagonal exact and each output free
of the next token's dt and trapezoid; the skip D x is added there too (one rounding of y), and its gradients come
from the backward's chunk pass. The op takes the angles' increments pi tanh(rate) dt (formed by the caller, without
a gradient of their own) and, for its backward only, the angle rates: the angle sums' block totals, then one Triton
pass takes the sums' second pass, stores the angles and rotates the keys and queries per head, stored in x's
dtype; the backward's angle gradient is taken against those same rounded keys (against the unrounded ones a
document's angle gradients stop summing to zero, and the suffix sums carry the difference). MIMO's rank inputs
x * mimo_x[r] are formed as the kernels read x, one row a step (kernels/ssd.py's rank_inputs), and the chunk pass
sums a step's ranks' angle gradients itself, and each chunk's sum of them; one pass over the chunks then takes the
suffix sums (a chunk's own, plus its document's later chunks' sums) and the increments' backward, the rates'
gradient and dt's part (_angle_grads_kernel). The angle sums
(doc_angle_sum, the chunked path's op) run as two Triton passes over blocks of tokens (block totals, then each
block's segmented sum plus the totals carried into it). The step loop is every path's oracle.

Shapes follow kernels/ssd.py: x [B,T,H,P], dt [B,T,H], A [H], the trapezoid logits trap [B,T,H], the angle
rates angles [B,T,H,N_a], or [B,T,1,N_a] shared by the heads (the layer's: one projection a token), with N_a <= N/2
(the pairs past N_a are not rotated), D [H]. SISO: B and C [B,T,G,N]
(G groups of heads, H % G == 0), the biases [H,N], y [B,T,H,P]. MIMO: B and C [B,T,R,G,N], the biases [H,R,N],
mimo_x [H,R,P], y [B,T,R,H,P] (one output per rank: the layer gates and combines them).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megacpp_lab.kernels import INTERPRETED, launchable
from megacpp_lab.kernels.ssd import (FLOAT_DTYPES, Mamba3Operands, chunk_log_decay, decay_mask, doc_start_mask,
                                     dot_types, launch_ssd_bwd_states, launch_ssd_fwd, rank_inputs, slot_chunk,
                                     slot_document, ssd_scan, states_dtype)
from megacpp_lab.varlen import PackedContext, check_context, check_cu_seqlens, documents_longest_first

__all__ = ["ANGLE_FIXED_POINT", "KERNELS", "doc_angle_sum", "doc_angle_sum_torch", "doc_angle_sum_triton",
           "doc_suffix_sum_torch", "doc_suffix_sum_triton", "mamba3_scan", "mamba3_scan_reference", "mamba3_step",
           "rotate_pairs"]

KERNELS = ("auto", "triton", "chunked", "reference")


def _check_float(name: str, t: torch.Tensor) -> None:
    # an integer or bool x once came back as an integer y (the step loop truncating, the kernels 6 off)
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"mamba3 {name} must be float32, bfloat16, float16 or float64, got {t.dtype}")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"mamba3 {name} must be a tensor of shape {list(shape)}, got "
                         f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")  # fmt: skip
    _check_float(name, t)


def rotate_pairs(v: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotate the first theta.shape[-1] pairs (v[2i], v[2i+1]) of v [..., N] by theta [..., N_a]."""
    n_a = theta.shape[-1]
    pairs = v[..., : 2 * n_a].unflatten(-1, (n_a, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = torch.cos(theta), torch.sin(theta)
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, v[..., 2 * n_a :]), dim=-1)


@torch.compiler.disable  # dynamo would unroll the T steps into one enormous graph
def mamba3_scan_reference(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, trap: torch.Tensor,
    angles: torch.Tensor, b_bias: torch.Tensor, c_bias: torch.Tensor, D: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, *, mimo_x: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The step loop (module docstring), SISO or MIMO (B and C with a rank dim, and mimo_x): fp32 state and
    angles (fp64 inputs stay fp64), every state restarted at each document start of cu_seqlens (over the
    flattened B*T tokens; None: one document per row). Returns y in x's dtype: [B,T,H,P], MIMO [B,T,R,H,P]."""
    B, T, H, P, G, N, n_a, R = _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, mimo_x)
    mimo = Bm.dim() == 5
    Bm, Cm, b_bias, c_bias = _ranked_keys(Bm, Cm, b_bias, c_bias)
    xr = _rank_inputs(x, mimo_x)
    acc = torch.promote_types(x.dtype, torch.float32)
    reset = doc_start_mask(cu_seqlens, B, T, x.device)
    per_head = H // G
    Bh = (Bm.to(acc).repeat_interleave(per_head, dim=3) + b_bias.transpose(0, 1).to(acc))  # [B,T,R,H,N]
    Ch = (Cm.to(acc).repeat_interleave(per_head, dim=3) + c_bias.transpose(0, 1).to(acc))
    xs, dts, Af, lam = xr.to(acc), dt.to(acc), A.to(acc), torch.sigmoid(trap.to(acc))  # xs [B,T,R,H,P]
    rates = torch.tanh(angles.to(acc)) * math.pi
    S = torch.zeros((B, H, P, N), dtype=acc, device=x.device)
    theta = torch.zeros((B, H, max(n_a, 0)), dtype=acc, device=x.device)
    k_prev = torch.zeros((B, R, H, N), dtype=acc, device=x.device)
    x_prev = torch.zeros((B, R, H, P), dtype=acc, device=x.device)
    ys = []
    for t in range(T):
        start = reset[:, t].view(B, 1, 1)
        S = torch.where(start[..., None], torch.zeros_like(S), S)
        theta = torch.where(start, torch.zeros_like(theta), theta)
        k_prev = torch.where(start[..., None], torch.zeros_like(k_prev), k_prev)
        x_prev = torch.where(start[..., None], torch.zeros_like(x_prev), x_prev)
        y, S, theta, k_prev, x_prev = mamba3_step(S, theta, k_prev, x_prev, xs[:, t], dts[:, t], Af, lam[:, t],
                                                  rates[:, t], Bh[:, t], Ch[:, t], D)  # fmt: skip
        ys.append(y)
    y = torch.stack(ys, dim=1)  # [B,T,R,H,P]
    return (y if mimo else y[:, :, 0]).to(x.dtype)


def mamba3_step(
    S: torch.Tensor, theta: torch.Tensor, k_prev: torch.Tensor, x_prev: torch.Tensor, x_r: torch.Tensor,
    dt: torch.Tensor, A: torch.Tensor, lam: torch.Tensor, rate: torch.Tensor, B_h: torch.Tensor, C_h: torch.Tensor,
    D: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One step of the recurrence (module docstring), in the dtype of its fp32 (or fp64) inputs: the state S
    [B,H,P,N], angles theta [B,H,N_a], previous keys [B,R,H,N] and rank inputs [B,R,H,P]; this token's rank
    inputs x_r [B,R,H,P], dt and lam = sigmoid(trap) [B,H], A [H], angle rate pi tanh(angles) [B,H,N_a], biased
    B_h and C_h [B,R,H,N]. Returns y [B,R,H,P] and the new S, theta, k_prev, x_prev. The step loop's body and the
    layer's decode step."""
    theta = torch.remainder(theta + rate * dt[..., None], 2 * math.pi)
    k, q = rotate_pairs(B_h, theta[:, None]), rotate_pairs(C_h, theta[:, None])  # [B,R,H,N]: angles shared by ranks
    alpha = torch.exp(dt * A)  # [B,H]
    prev_w, cur_w = ((1 - lam) * dt * alpha)[..., None, None], (lam * dt)[..., None, None]
    S = (alpha[..., None, None] * S + prev_w * torch.einsum("brhp,brhn->bhpn", x_prev, k_prev)
         + cur_w * torch.einsum("brhp,brhn->bhpn", x_r, k))  # fmt: skip
    y = torch.einsum("bhpn,brhn->brhp", S, q)
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * x_r
    return y, S, theta, k, x_r


def _ranked_keys(Bm, Cm, b_bias, c_bias):  # noqa: ANN001, ANN202
    """The rank form of either layout's keys: B, C [B,T,R,G,N], biases [H,R,N]."""
    if Bm.dim() == 4:
        return Bm[:, :, None], Cm[:, :, None], b_bias[:, None], c_bias[:, None]
    return Bm, Cm, b_bias, c_bias


def _rank_inputs(x, mimo_x):  # noqa: ANN001, ANN202
    """The rank inputs x_r = x * mimo_x[r] [B,T,R,H,P] in x's dtype (SISO: x itself, one rank); the Triton kernels
    form them as they read x (kernels/ssd.py's rank_inputs, the same rounding)."""
    return x[:, :, None] if mimo_x is None else x[:, :, None] * mimo_x.transpose(0, 1).to(x.dtype)


def _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, mimo_x) -> tuple[int, ...]:  # noqa: ANN001
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"mamba3 x must be a tensor [B,T,H,P], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")  # fmt: skip
    _check_float("x", x)
    B, T, H, P = x.shape
    if not isinstance(Bm, torch.Tensor) or Bm.dim() not in (4, 5):
        raise ValueError(f"mamba3 Bm must be [B,T,G,N] (SISO) or [B,T,R,G,N] (MIMO), got "
                         f"{list(Bm.shape) if isinstance(Bm, torch.Tensor) else type(Bm).__name__}")  # fmt: skip
    mimo = Bm.dim() == 5
    R = Bm.shape[2] if mimo else 1
    G, N = Bm.shape[-2], Bm.shape[-1]
    if H % G:
        raise ValueError(f"mamba3: the heads H={H} must be a multiple of the groups G={G} (Bm's dim {Bm.dim() - 2})")
    n_a = angles.shape[-1] if angles.dim() == 4 else -1
    ranked = (R,) if mimo else ()
    for name, t, shape in (("dt", dt, (B, T, H)), ("A", A, (H,)), ("Bm", Bm, (B, T, *ranked, G, N)),
                           ("Cm", Cm, (B, T, *ranked, G, N)), ("trap", trap, (B, T, H)),
                           ("angles", angles, (B, T, H if angles.dim() != 4 or angles.shape[2] != 1 else 1, n_a)),
                           ("b_bias", b_bias, (H, *ranked, N)),
                           ("c_bias", c_bias, (H, *ranked, N))):  # fmt: skip
        _check(name, t, shape)
    if not 0 <= 2 * n_a <= N:
        raise ValueError(f"mamba3 angles: at most N/2 = {N // 2} rotated pairs per head, got {n_a}")
    if D is not None:
        _check("D", D, (H,))
    if mimo:
        if mimo_x is None:
            raise ValueError("mamba3 mimo_x: MIMO (Bm [B,T,R,G,N]) needs the rank inputs' scale mimo_x [H,R,P]")
        _check("mimo_x", mimo_x, (H, R, P))
    elif mimo_x is not None:
        raise ValueError("mamba3 mimo_x is MIMO's (Bm [B,T,R,G,N]); SISO's Bm [B,T,G,N] takes none")
    return B, T, H, P, G, N, n_a, R


# the angle sums' fixed-point scale: steps of 1.5e-11 rad (fp32 resolves 4.8e-7 at 2 pi), and each increment below
# 2 pi * 2**36, so int64 holds the sum of 2**63 / (2 pi 2**36) = 21 million tokens of one document. (A lead, on branch
# lead/angle-turns, not on main: fp32 increments summed in int32 turns, 2**32 a turn, twice as fast; design.md.)
ANGLE_FIXED_POINT = 2.0**36


@torch.library.custom_op("megacpp::doc_angle_sum", mutates_args=())
def doc_angle_sum(inc: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """theta [B,T,...]: the increments inc [B,T,...] summed along T from each document start, mod 2 pi, in inc's
    dtype; cu_seqlens [D+1] int32 over the flattened B*T tokens (kernels/ssd.py's convention; one document a row
    is arange(0, B*T + 1, T)). The sum runs in int64 fixed point (each increment first taken mod 2 pi in fp64):
    integer sums are exact, so a document's angle takes no rounding from any other document, and a long document
    keeps its low bits, where an fp32 sum would lose them (hundreds of radians). A NaN or infinite increment has no
    integer (its conversion gives 0 on a GPU, INT64_MIN in torch): theta is NaN at its token, selected there on the
    output; the integer sums are left as they are, so the document's later angles in that column are finite but
    not defined (the key at that token is NaN, so the head's state and outputs are NaN from there on). A finite
    increment too large for fp64 to hold its fraction of a turn (above 2**53 radians; past about 1e24 its remainder
    overflows the int64 fixed point) is not caught: a wrong angle. On CUDA two Triton passes over blocks of tokens
    and columns (`doc_angle_sum_triton`); elsewhere plain torch (`doc_angle_sum_torch`);
    tests/test_mamba3.py holds the two equal (fp32: bit for bit at its seeds; fp64: within 1e-12). Not by
    construction: the final mod, x - 2 pi floor(x / (2 pi)) here (its floor by a product, _mod_two_pi) and torch's
    exact remainder there, can differ in fp64's last bit, which can flip an fp32 rounding of a result near zero, and
    an increment past 2 pi can land one fixed-point step apart. An opaque op: inductor's
    Triton codegen fails on this long scan over a middle dim (torch 2.11: `list indices must be integers` in SplitScan codegen, at
    [8,4096,16,32] on the H200), and torch's own int64 scan over a middle dim took 1.6 ms there, a fifth of the
    whole Mamba-3 scan's forward and backward."""
    if inc.is_cuda:
        return doc_angle_sum_triton(inc, cu_seqlens)
    return doc_angle_sum_torch(inc, cu_seqlens)


def doc_angle_sum_torch(inc: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """doc_angle_sum in plain torch: a cumsum over the whole row less the sum before each document's start, each
    step rounded as the Triton scan rounds it (ties up: floor(x + 1/2)), so the two stay equal; NaN where the
    increment is not finite, as there."""
    start = doc_start_mask(cu_seqlens, *inc.shape[:2], inc.device)
    steps = torch.floor(torch.remainder(inc.double(), 2 * math.pi) * ANGLE_FIXED_POINT + 0.5).to(torch.int64)
    total = torch.cumsum(steps, dim=1)
    own = total - torch.gather(total - steps, 1, _first_of_document(start, steps.shape))
    out = torch.remainder(own.double() / ANGLE_FIXED_POINT, 2 * math.pi)
    return torch.where(torch.isfinite(inc), out, math.nan).to(inc.dtype)


@doc_angle_sum.register_fake
def _(inc, cu_seqlens):  # noqa: ANN001, ANN202
    return inc.new_empty(inc.shape)  # contiguous, as the op returns it


def _first_of_document(start: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The index of each token's document start, [B,T] broadcast to `shape` for a gather along dim 1."""
    T = start.shape[1]
    first = torch.cummax(torch.where(start, torch.arange(T, device=start.device), 0), dim=1).values
    return first.view(*first.shape, *([1] * (len(shape) - 2))).expand(shape)


def _doc_angle_sum_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    """d inc_s = the sum of grad_t over t >= s in s's document (the mods have derivative 1)."""
    (cu_seqlens,) = ctx.saved_tensors
    return doc_suffix_sum(grad, cu_seqlens), None


@torch.library.custom_op("megacpp::doc_suffix_sum", mutates_args=())
def doc_suffix_sum(grad: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The angle sums' backward: grad [B,T,...] summed over t >= s within s's document (cu_seqlens as
    doc_angle_sum's), out in grad's dtype. On CUDA the Triton block scan in reverse
    (`doc_suffix_sum_triton`: in fp32, fp64 for fp64 gradients), elsewhere plain torch (`doc_suffix_sum_torch`, in
    fp64: a row's sum less the sum past the document, which must not round one document's gradient into another's).
    An opaque op, as the forward is: the backward graph would trace into the kernel."""
    if grad.is_cuda:
        return doc_suffix_sum_triton(grad, cu_seqlens)
    return doc_suffix_sum_torch(grad, cu_seqlens)


@doc_suffix_sum.register_fake
def _(grad, cu_seqlens):  # noqa: ANN001, ANN202
    return grad.new_empty(grad.shape)


def doc_suffix_sum_torch(grad: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The angle sums' backward in plain torch: a suffix sum over the whole row in fp64, less the suffix sum from
    the next document start. A difference: a later document's gradients reach an earlier one's in fp64 rounding
    (1e-16 relative), never in value (the Triton scan stops exactly at every document end)."""
    g = grad.double()
    B, T = g.shape[:2]
    start = doc_start_mask(cu_seqlens, B, T, g.device)
    suffix = torch.flip(torch.cumsum(torch.flip(g, (1,)), dim=1), (1,))  # S_t = sum_{s >= t} g_s
    suffix = torch.cat((suffix, torch.zeros_like(suffix[:, :1])), dim=1)  # S_T = 0
    # the next document start after each token (T past the last one): a reverse running minimum
    starts_after = torch.where(torch.cat((start[:, 1:], torch.ones_like(start[:, :1])), dim=1),
                               torch.arange(1, T + 1, device=g.device), T)  # fmt: skip
    nxt = torch.flip(torch.cummin(torch.flip(starts_after, (1,)), dim=1).values, (1,))
    end = nxt.view(*nxt.shape, *([1] * (g.dim() - 2))).expand(g.shape)
    return (suffix[:, :T] - torch.gather(suffix, 1, end)).to(grad.dtype)


doc_angle_sum.register_autograd(
    _doc_angle_sum_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[1])
)


# ----------------------------------------------------------------------------- the angle sums in Triton


@triton.jit
def _segmented_add(a, a_cut, b, b_cut):
    """A segmented sum's combine: b's run restarts where b holds a document boundary (cut)."""
    return tl.where(b_cut != 0, b, a + b), a_cut | b_cut


@triton.jit
def _mod_two_pi(x):
    """x mod 2 pi in fp64, in [0, 2 pi): the turns by a product with 1 / (2 pi), then one turn added or taken
    where that product's rounding put the floor a turn off (x within an ulp of a multiple of 2 pi). In place of
    floor(x / (2 pi)): an fp64 division is a dozen double-precision instructions an element (a reciprocal and its
    Newton steps), and the angle sums take two an increment (its mod, the output's mod) at the double-precision
    rate, a 64th of the fp32 one on an H100. Where the product's floor equals the quotient's, the result is the
    division's bit for bit (the same x - 2 pi q), except that an r the division left at exactly 2 pi is 0 here
    (the last select keeps every result in [0, 2 pi))."""
    two_pi = tl.full((), 6.283185307179586, tl.float64)  # a bare literal would be an fp32 constant
    r = x - two_pi * tl.floor(x * tl.full((), 0.15915494309189535, tl.float64))
    r = tl.where(r < 0, r + two_pi, r)
    return tl.where(r >= two_pi, r - two_pi, r)


@triton.jit
def _tanh(x):
    """tanh of fp32 x: libdevice's on a GPU (within 2 ulp of torch.tanh); under the interpreter, where libdevice
    has no value, (1 - e) / (1 + e) with e = exp(-2|x|) in fp64 (no cancellation to speak of at fp32's precision)."""
    if INTERPRETED:
        e = tl.exp(-2.0 * tl.abs(x.to(tl.float64)))
        t = ((1.0 - e) / (1.0 + e)).to(tl.float32)
        return tl.where(x < 0, -t, t)
    return libdevice.tanh(x)


@triton.jit
def _doc_block(v_ptr, cu_ptr, n_docs, N, C, block, col0, col_end, BT: tl.constexpr, BC: tl.constexpr,
               ANGLES: tl.constexpr, REVERSE: tl.constexpr, FIXED_POINT: tl.constexpr):  # fmt: skip
    """Token block `block`'s tile of the columns [col0, col_end) (BC lanes from col0) in scan order (REVERSE: the
    block's tokens from its last), each row's cut (where the scan restarts: a document's first token, REVERSE its
    last), the offsets, the masks, the bounds of the carry: the blocks whose totals reach this block's first
    rows ([lo, hi) block indices), and (ANGLES) where the increment is finite, taken before its int64 conversion."""
    b0 = block * BT
    r = tl.arange(0, BT)
    rt = b0 + BT - 1 - r if REVERSE else b0 + r
    mt = rt < N
    rc = col0 + tl.arange(0, BC)
    mc = rc < col_end
    # the document of the block's first token: cu[d] <= b0 < cu[d + 1] (a binary search over the boundaries)
    lo = tl.zeros((), dtype=tl.int32)
    hi = lo + n_docs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(cu_ptr + mid) <= b0
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    # the BT boundaries after it: at most BT - 1 fall inside the block, so these reach the first one past its last
    # token (a reverse cut's cu[d] - 1, and the carry's document end, included)
    rd = lo + 1 + tl.arange(0, BT)
    bounds = tl.load(cu_ptr + rd, mask=rd <= n_docs, other=2147483647)
    cut_at = rt + 1 if REVERSE else rt  # a document starts at cu[d]; one ends where the next starts
    cut = tl.max((bounds[None, :] == cut_at[:, None]).to(tl.int32), axis=1)
    if REVERSE:  # the blocks after this one, up to the one holding the end of this block's last document
        last = tl.minimum(b0 + BT, N) - 1
        doc_end = tl.min(tl.where(bounds > last, bounds, 2147483647), axis=0)
        carry_lo = block + 1
        carry_hi = tl.where(doc_end > b0 + BT, (doc_end - 1) // BT + 1, carry_lo)
    else:  # the blocks before this one, from the one holding this block's first document's start
        doc_start = tl.load(cu_ptr + lo)
        carry_hi = block
        carry_lo = tl.where(doc_start < b0, doc_start // BT, carry_hi)
    at = rt[:, None] * C + rc[None, :]
    m = mt[:, None] & mc[None, :]
    acc = tl.float64 if (ANGLES or v_ptr.dtype.element_ty == tl.float64) else tl.float32
    v = tl.load(v_ptr + at, mask=m, other=0.0).to(acc)
    fin = m  # the suffix sums' (unused)
    if ANGLES:  # each increment mod 2 pi in fp64, then in int64 fixed point: integer sums are exact in any order
        fin = tl.abs(v) < float("inf")  # False at NaN and +-inf, whose int64 conversion is arbitrary
        v = tl.where(m, tl.floor(_mod_two_pi(v) * FIXED_POINT + 0.5).to(tl.int64), 0)
    return v, cut, r, at, m, rc, mc, carry_lo, carry_hi, fin


@triton.jit(do_not_specialize=["n_docs"])
def _doc_scan_totals_kernel(v_ptr, cu_ptr, tot_ptr, n_docs, N, C, BT: tl.constexpr, BC: tl.constexpr,
                            ANGLES: tl.constexpr, REVERSE: tl.constexpr, FIXED_POINT: tl.constexpr):  # fmt: skip
    """The scan's first pass: each block's total from its last cut to its end in scan order (its last document's
    tokens in it; REVERSE its first document's), what it carries into the blocks after it (before it)."""
    v, cut, r, _at, _m, rc, mc, _lo, _hi, _fin = _doc_block(v_ptr, cu_ptr, n_docs, N, C, tl.program_id(0),
                                                            tl.program_id(1) * BC, C, BT, BC, ANGLES, REVERSE,
                                                            FIXED_POINT)  # fmt: skip
    last_cut = tl.max(tl.where(cut != 0, r, 0), axis=0)
    total = tl.sum(tl.where((r >= last_cut)[:, None], v, 0), axis=0)
    tl.store(tot_ptr + tl.program_id(0) * C + rc, total, mask=mc)


@triton.jit(do_not_specialize=["n_docs"])
def _doc_scan_kernel(v_ptr, cu_ptr, tot_ptr, out_ptr, n_docs, N, C, BT: tl.constexpr, BC: tl.constexpr,
                     LOOKBACK: tl.constexpr, ANGLES: tl.constexpr, REVERSE: tl.constexpr,
                     FIXED_POINT: tl.constexpr):  # fmt: skip
    """The scan's second pass: a segmented sum within the block (restarting at every cut), plus, for the rows
    before its first cut, the totals of the blocks between this one and its first document's start (REVERSE: its
    last document's end), summed LOOKBACK blocks a load. ANGLES: the forward's sums mod 2 pi in int64 fixed point,
    out mod 2 pi; else the backward's suffix sums in fp32 (fp64 for fp64 gradients)."""
    out, at, m = _doc_scan_tile(v_ptr, cu_ptr, tot_ptr, n_docs, N, C, tl.program_id(0), tl.program_id(1) * BC, C, BT,
                                BC, LOOKBACK, ANGLES, REVERSE, FIXED_POINT)  # fmt: skip
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _doc_scan_tile(v_ptr, cu_ptr, tot_ptr, n_docs, N, C, block, col0, col_end, BT: tl.constexpr, BC: tl.constexpr,
                   LOOKBACK: tl.constexpr, ANGLES: tl.constexpr, REVERSE: tl.constexpr,
                   FIXED_POINT: tl.constexpr):  # fmt: skip
    """The scan's second pass on token block `block`'s columns [col0, col_end) (_doc_block): its sums (ANGLES: mod
    2 pi, in fp64, NaN where the increment is not finite), their offsets and mask."""
    v, cut, _r, at, m, rc, mc, carry_lo, carry_hi, fin = _doc_block(v_ptr, cu_ptr, n_docs, N, C, block, col0,
                                                                    col_end, BT, BC, ANGLES, REVERSE,
                                                                    FIXED_POINT)  # fmt: skip
    carry = tl.zeros((BC,), dtype=v.dtype)
    for j in range(carry_lo, carry_hi, LOOKBACK):
        rj = j + tl.arange(0, LOOKBACK)
        tot = tl.load(tot_ptr + rj[:, None] * C + rc[None, :], mask=(rj < carry_hi)[:, None] & mc[None, :], other=0)
        carry += tl.sum(tot, axis=0)
    cuts = tl.broadcast_to(cut[:, None], v.shape)
    run, seen = tl.associative_scan((v, cuts), axis=0, combine_fn=_segmented_add)
    run = tl.where(seen != 0, run, run + carry[None, :])
    if ANGLES:
        out = _mod_two_pi(run.to(tl.float64) * (1.0 / FIXED_POINT))  # a power of two: exact
        out = tl.where(fin, out, float("nan"))  # bad input fails closed: the integer sum there is arbitrary
    else:
        out = run
    return out, at, m


def _doc_scan(v: torch.Tensor, cu_seqlens: torch.Tensor, *, angles: bool, reverse: bool) -> torch.Tensor:
    """Two passes over (block of SCAN_BLOCK_T tokens, SCAN_BLOCK_C columns or the next power of two of fewer)
    programs: each block's total, then each block's own segmented scan plus the totals it is carried. Every
    program's work is one block, however long its document: one program per document walked the longest
    document's blocks in a chain (154-188 us a forward call and 77-98 us a backward one at the base model's shape
    on an H100, profile_base_compiled at 56ef312; on the H200 at that shape, 8 documents a row,
    scripts/scan_probe.py read 0.213 and 0.120 ms for it against 0.176 and 0.083 for the two passes)."""
    v = v.contiguous()
    out = torch.empty_like(v)
    if out.numel() == 0:  # no rotated pairs (rope_pairs = 0): nothing to scan, and a launch grid may not be empty
        return out
    totals, grid, consts = _doc_block_totals(v, cu_seqlens, angles=angles, reverse=reverse)
    N, C = v.shape[0] * v.shape[1], v[0, 0].numel()
    _doc_scan_kernel[grid](v, cu_seqlens, totals, out, cu_seqlens.numel() - 1, N, C, LOOKBACK=SCAN_LOOKBACK, **consts)
    return out


def _doc_block_totals(v: torch.Tensor, cu_seqlens: torch.Tensor, *, angles: bool,
                      reverse: bool) -> tuple[torch.Tensor, tuple[int, int], dict[str, object]]:  # fmt: skip
    """The scans' first pass on v [B,T,...] (contiguous, not empty): each block's total [blocks, C] (int64 fixed point
    for the angles), with the launch grid and constants the second pass takes (_doc_scan, or the forward's
    _angle_keys_kernel on the same token blocks)."""
    C = v[0, 0].numel()
    N = v.shape[0] * v.shape[1]
    # fewer columns than a column block (tests, the tiny preset's 16; small, base and stack have H * n_a >= 96): a
    # block of their power of two, not SCAN_BLOCK_C lanes of padding (under the interpreter every padded lane costs
    # a Python combine call)
    block_c = min(SCAN_BLOCK_C, triton.next_power_of_2(C))
    grid = (triton.cdiv(N, SCAN_BLOCK_T), triton.cdiv(C, block_c))
    acc = torch.int64 if angles else (torch.float64 if v.dtype == torch.float64 else torch.float32)
    totals = torch.empty((grid[0], C), device=v.device, dtype=acc)
    consts = dict(BT=SCAN_BLOCK_T, BC=block_c, ANGLES=angles, REVERSE=reverse, FIXED_POINT=ANGLE_FIXED_POINT,
                  num_warps=SCAN_WARPS)  # fmt: skip
    _doc_scan_totals_kernel[grid](v, cu_seqlens, totals, cu_seqlens.numel() - 1, N, C, **consts)
    return totals, grid, consts


# a scan's tile, tokens x columns, its warps, and the carry's blocks a load. scripts/scan_probe.py on the H200 (at
# 3626dc0, GPU time of both scans, five shapes): 64 x 32 at 4 warps took 0.259 ms at the base model's M block against
# 0.333 for the one-program-per-document scan, 0.345 against 1.904 at T = 16384 in two documents. 32 x 64 and 32 x 32
# were within 5% of it at three shapes and 1.14 to 1.90 times it at the two with fewer, longer documents; 64 x 16,
# 128 x 16 and 8 warps took 1.16 to 1.91 times it at every shape. The angles' backward (_angle_grads_kernel) loads
# its document's later chunks' sums SCAN_LOOKBACK chunks at a time
SCAN_BLOCK_T = 64
SCAN_BLOCK_C = 32
SCAN_WARPS = 4
SCAN_LOOKBACK = 16


def doc_angle_sum_triton(inc: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """doc_angle_sum as the Triton block scan (_doc_scan; CUDA, or the CPU under TRITON_INTERPRET=1)."""
    return _doc_scan(inc, cu_seqlens, angles=True, reverse=False)


def doc_suffix_sum_triton(grad: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The angle sums' backward as the Triton block scan in reverse (_doc_scan: each block's rows from its last)."""
    return _doc_scan(grad, cu_seqlens, angles=False, reverse=True)


# ----------------------------------------------------------------------------- the Triton op: the SSD kernels in Mamba-3 mode




@triton.jit
def _cos(x):
    """cos of an angle in [0, 2 pi) (Mamba-3's document angle sums' range): the GPU's cos.approx.f32 (about 1e-6
    absolute, below a bf16 key's rounding and within the fp32 tests' 1e-5), libdevice's under the interpreter. The
    keys' exact cos and sin took about half of the key pass's time on the H100 (0.24 ms forward at the issue's
    shape)."""
    if INTERPRETED:
        return tl.cos(x)
    return tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _sin(x):
    """sin as _cos is cos."""
    if INTERPRETED:
        return tl.sin(x)
    return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rotate(v, cos, sin, ROWS: tl.constexpr, N: tl.constexpr):
    """Rotate the interleaved pairs (v[2i], v[2i+1]) of v [ROWS, N] by angles whose cos and sin are [ROWS, N // 2]."""
    re, im = tl.split(tl.reshape(v, (ROWS, N // 2, 2)))
    return tl.reshape(tl.join(re * cos - im * sin, re * sin + im * cos), (ROWS, N))


@triton.jit
def _step_angles(th_ptr, t, m, hd, H, n_a, col0, BN: tl.constexpr, RANK: tl.constexpr, EVICT: tl.constexpr):
    """cos and sin [len(t), BN // 2] of head hd's angles at the tokens t (mask m), for the pairs of the state columns
    col0 + arange(BN): Mamba-3's theta [B*T, H, n_a] fp32, one row a step (a rank sub-token t reads step t // RANK);
    the pairs past n_a are not rotated (angle 0)."""
    pr = col0 // 2 + tl.arange(0, BN // 2)
    th = tl.load(th_ptr + ((t // RANK) * H + hd)[:, None] * n_a + pr[None, :], mask=m[:, None] & (pr < n_a)[None, :],
                 other=0.0, eviction_policy=EVICT)  # fmt: skip
    return _cos(th), _sin(th)


@triton.jit
def _unrotate(d, v, cos, sin, ROWS: tl.constexpr, BN: tl.constexpr):
    """A gradient d [ROWS, BN] at the rotated keys v (fp32, as stored) back through the rotation by the angles
    whose cos and sin are [ROWS, BN // 2]: rot(d, -theta) (the rotation's transpose), and each pair's angle
    gradient d_im v_re - d_re v_im (d rot(u, theta) / d theta = (-v_im, v_re))."""
    d_re, d_im = tl.split(tl.reshape(d, (ROWS, BN // 2, 2)))
    v_re, v_im = tl.split(tl.reshape(v, (ROWS, BN // 2, 2)))
    return _rotate(d, cos, -sin, ROWS, BN), d_im * v_re - d_re * v_im


@triton.jit
def _rotate_keys(b_ptr, c_ptr, bb_ptr, cb_ptr, th_ptr, k_ptr, q_ptr, t, m, hd0, n_heads, H, G, n_a, RANK: tl.constexpr,
                 BT: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """k = rot(B + b_bias, theta) and q = rot(C + c_bias, theta) of the heads hd0 .. hd0 + n_heads - 1 (of one group)
    at the sub-tokens t (mask m), in k's dtype: their group's B and C loaded once, fp32 arithmetic."""
    rn = tl.arange(0, N)
    at = (t[:, None] * G + hd0 // (H // G)) * N + rn[None, :]
    Bg = tl.load(b_ptr + at, mask=m[:, None], other=0.0).to(tl.float32)
    Cg = tl.load(c_ptr + at, mask=m[:, None], other=0.0).to(tl.float32)
    for j in range(0, n_heads):
        hd = hd0 + j
        cos, sin = _step_angles(th_ptr, t, m, hd, H, n_a, 0, N, RANK, "")
        bias_at = ((hd * RANK + t % RANK) * N)[:, None] + rn[None, :]
        out_at = (t[:, None] * H + hd) * N + rn[None, :]
        k = _rotate(Bg + tl.load(bb_ptr + bias_at), cos, sin, BT, N)
        tl.store(k_ptr + out_at, k.to(k_ptr.dtype.element_ty), mask=m[:, None])
        q = _rotate(Cg + tl.load(cb_ptr + bias_at), cos, sin, BT, N)
        tl.store(q_ptr + out_at, q.to(q_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def _keys_kernel(b_ptr, c_ptr, bb_ptr, cb_ptr, th_ptr, k_ptr, q_ptr, TOTAL, H, G, n_a,
                 RANK: tl.constexpr, BT: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """The key pass on given angles (the backward's, where it recomputes the keys, and the forward's with no rotated
    pairs): k and q per head (_rotate_keys), one program per BT sub-tokens (over the flattened B*T*R) and group."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    _rotate_keys(b_ptr, c_ptr, bb_ptr, cb_ptr, th_ptr, k_ptr, q_ptr, t, t < TOTAL, tl.program_id(1) * (H // G), H // G,
                 H, G, n_a, RANK, BT, N)  # fmt: skip


@triton.jit(do_not_specialize=["n_docs"])
def _angle_keys_kernel(inc_ptr, cu_ptr, tot_ptr, th_ptr, b_ptr, c_ptr, bb_ptr, cb_ptr, k_ptr, q_ptr, n_docs, STEPS, H, G,
                       n_a, BS: tl.constexpr, BA: tl.constexpr, LOOKBACK: tl.constexpr, FIXED_POINT: tl.constexpr,
                       RANK: tl.constexpr, BT: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """The forward's angles and keys in one pass: program (block of BS steps, head hd) takes the angle sums' second
    pass (_doc_scan_tile, after _doc_scan_totals_kernel's block totals) on the head's n_a columns, stores theta
    [B*T, H, n_a] (the backward reads it), then rotates the block's keys and queries of that head BT sub-tokens at a
    time (_rotate_keys, theta read back as stored; its group's B and C read by each of the group's heads, from L2
    after the first). In place of doc_angle_sum's own second pass and the key pass: the increments read once, theta
    written once and read back from cache, one launch fewer. A program a head, not a group: with one group of 32
    heads (the base model's M blocks) a program a group left 256 programs for 132 SMs (docs/design.md has the
    measurements)."""
    blk = tl.program_id(0)
    hd = tl.program_id(1)
    col0 = hd * n_a
    theta, at, m = _doc_scan_tile(inc_ptr, cu_ptr, tot_ptr, n_docs, STEPS, H * n_a, blk, col0, col0 + n_a, BS, BA,
                                  LOOKBACK, True, False, FIXED_POINT)  # fmt: skip
    tl.store(th_ptr + at, theta.to(th_ptr.dtype.element_ty), mask=m)
    tl.debug_barrier()  # the rotation reads angles other threads stored: every thread sees them
    for s0 in range(0, BS * RANK, BT):
        t = blk * (BS * RANK) + s0 + tl.arange(0, BT)
        _rotate_keys(b_ptr, c_ptr, bb_ptr, cb_ptr, th_ptr, k_ptr, q_ptr, t, t < STEPS * RANK, hd, 1, H, G, n_a, RANK,
                     BT, N)  # fmt: skip


# ----------------------------------------------------------------------------- the backward's chunk pass


@triton.jit
def _key_grad_back(d, v, cos, sin, out_ptr, bias_ptr, m, hd, slot, sums_row, rn, kq_at, RANK: tl.constexpr,
                   CHUNK: tl.constexpr, BN: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """One [CHUNK, BN] block of dk (or dq) at the keys v as stored (fp32), taken back through the rotation by the
    angles whose cos and sin are [CHUNK, BN // 2]: the gradient of B + b_bias per head into out_ptr and the bias's
    partial sums over the chunk's sub-tokens, per rank; returns the block's pairs' angle gradients, summed over a
    step's ranks ([CHUNK // RANK, BN // 2]). MIMO: a chunk holds whole steps, so each rank's bias sum is one
    reduction of the block seen as [steps, RANK, BN] (compiled for sm_90, kernels/resources: at R = 4, with x read a
    step at a time, the chunk kernel's shuffles went from 848 to 528 and its spills from 336/392 to 308/328 bytes a
    thread, against stores per sub-token and a masked sum per rank; taking cos and sin once a step and broadcasting
    them to the ranks spilled more: 708/808 against 524/604, both measured with dx summed over the ranks in the
    kernel, since dropped)."""
    back, dth = _unrotate(d, v, cos, sin, CHUNK, BN)
    tl.store(out_ptr + kq_at + rn[None, :], back.to(out_ptr.dtype.element_ty), mask=m[:, None])
    # rows past the chunk's end are zero
    if RANK == 1:
        tl.store(bias_ptr + slot * sums_row + hd * N + rn, tl.sum(back, 0))
    else:
        STEPS: tl.constexpr = CHUNK // RANK
        rr = tl.arange(0, RANK)
        tl.store(bias_ptr + slot * sums_row + ((hd * RANK + rr) * N)[:, None] + rn[None, :],
                 tl.sum(tl.reshape(back, (STEPS, RANK, BN)), axis=0))  # fmt: skip
        dth = tl.sum(tl.reshape(dth, (STEPS, RANK, BN // 2)), axis=1)
    return dth


@triton.jit
def _store_angle_grads(dth, dth_ptr, dtt_ptr, t, m, first, end, hd, H, n_a, slot, col0, WHOLE: tl.constexpr,
                       ADD: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr, BN: tl.constexpr,
                       KEEP: tl.constexpr, DROP: tl.constexpr):  # fmt: skip
    """A block's pairs' angle gradients [CHUNK // RANK, BN // 2] (its columns col0 + arange(BN)) into dth_ptr
    ([B*T, H, n_a], one row a step). WHOLE: the keys' and the queries' parts are both in (ADD: the queries' part read
    back from dth_ptr, where their sweep stored it), and their sum over the chunk's steps, per pair, goes to dtt_ptr
    [slots, H, n_a] (what _angle_grads_kernel carries into the document's earlier chunks); else the queries' part
    alone, stored for the keys' sweep to read."""
    pr = col0 // 2 + tl.arange(0, BN // 2)
    if RANK == 1:
        pm = m[:, None] & (pr < n_a)[None, :]
        th_at = dth_ptr + (t * H + hd)[:, None] * n_a + pr[None, :]
    else:
        STEPS: tl.constexpr = CHUNK // RANK
        steps = first // RANK + tl.arange(0, STEPS)
        pm = (steps < end // RANK)[:, None] & (pr < n_a)[None, :]
        th_at = dth_ptr + (steps * H + hd)[:, None] * n_a + pr[None, :]
    if ADD:
        dth += tl.load(th_at, mask=pm, other=0.0, eviction_policy=DROP)
    if WHOLE:
        pa = pr < n_a
        tl.store(dtt_ptr + (slot * H + hd) * n_a + pr, tl.sum(tl.where(pa[None, :], dth, 0.0), axis=0), mask=pa)
    tl.store(th_at, dth, mask=pm, eviction_policy="" if WHOLE else KEEP)


@triton.jit
def _key_grads_out(d, v, th_ptr, dth_ptr, dtt_ptr, out_ptr, bias_ptr, t, m, first, end, hd, H, n_a, slot, sums_row,
                   col0, rn, kq_at, FIRST: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr, BN: tl.constexpr,
                   N: tl.constexpr, KEEP: tl.constexpr, DROP: tl.constexpr):  # fmt: skip
    """The two sweeps' block of dk (or dq, FIRST) back through the rotation (_key_grad_back) at the block's angles,
    its angle gradients stored (FIRST, the queries': for the keys' sweep to add to; else whole, with their chunk
    sum: _store_angle_grads)."""
    # the queries' sweep (FIRST) reads the angles and stores their gradients for the keys' sweep to read again
    cos, sin = _step_angles(th_ptr, t, m, hd, H, n_a, col0, BN, RANK, KEEP if FIRST else DROP)
    dth = _key_grad_back(d, v, cos, sin, out_ptr, bias_ptr, m, hd, slot, sums_row, rn, kq_at, RANK, CHUNK, BN, N)
    if FIRST:
        _store_angle_grads(dth, dth_ptr, dtt_ptr, t, m, first, end, hd, H, n_a, slot, col0, False, False, RANK, CHUNK,
                           BN, KEEP, DROP)  # fmt: skip
    else:
        _store_angle_grads(dth, dth_ptr, dtt_ptr, t, m, first, end, hd, H, n_a, slot, col0, True, True, RANK, CHUNK,
                           BN, KEEP, DROP)  # fmt: skip


@triton.jit
def _m3_bwd_chunk_rows(dt_ptr, w_ptr, a_ptr, cu_ptr, H, D, CHUNK: tl.constexpr, RANK: tl.constexpr):
    """A chunk-pass program's slot and head (its program ids) and its chunk: the sub-tokens t [CHUNK] and their mask
    (first >= end: a gap slot), each one's step, the head's rate A, dt, the cumulative log-decay cs and its last
    value, the input weight xw and w = exp(cs_last - cs) (the decay from each token to the chunk's end)."""
    slot = tl.program_id(0)
    hd = tl.program_id(1)
    first, end = slot_chunk(cu_ptr, slot, D, CHUNK)
    A_h = tl.load(a_ptr + hd).to(tl.float32)
    rl = tl.arange(0, CHUNK)
    t = first + rl
    m = t < end
    dt, cs, cs_last = chunk_log_decay(dt_ptr, t, m, hd, H, A_h, rl, CHUNK)
    xw = tl.load(w_ptr + t * H + hd, mask=m, other=0.0)
    return slot, hd, first, end, t, m, rl // RANK, A_h, dt, cs, cs_last, xw, tl.exp(cs_last - cs)


@triton.jit
def _m3_bwd_own_terms(x_ptr, xs_ptr, gam_ptr, skip_ptr, k_ptr, q_ptr, dst_ptr, dy_ptr, dx_ptr, dw_ptr, dgam_ptr,
                      dskip_ptr, t, m, step, cs, xw, w, slot, hd, H, sums_row, P: tl.constexpr, N: tl.constexpr,
                      BN1: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                      SDOT: tl.constexpr, RANK: tl.constexpr, KEEP: tl.constexpr):  # fmt: skip
    """The chunk pass's steps 1 and 2 (_m3_bwd_chunk_kernel): the reductions over N and the chunk's own terms.
    Stores dx (at the rank inputs, one row a sub-token), d weight, d gamma and dD's partial sum; returns
    L * (dy x^T) * W in the dots' dtype, the log-decay gradient's in-chunk part dcs (less R) and the sum of
    R = w xw (x . Q) over the chunk (the inputs' part of the decay to the chunk's end; the sweeps need only its sum)."""
    rp = tl.arange(0, P)
    dst_at = dst_ptr + (slot * H + hd) * P * N
    kq_at = (t[:, None] * H + hd) * N
    xp_at = (t[:, None] * H + hd) * P + rp[None, :]
    # 1. the reductions over N in blocks of BN1 columns (SDOT: the state dots' operands, fp32 (tf32 for 16-bit
    # inputs) or the inputs' dtype)
    CB = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    Q = tl.zeros((CHUNK, P), dtype=tl.float32)  # [j] = dS' k_j
    for nb in tl.static_range(N // BN1):
        rn = nb * BN1 + tl.arange(0, BN1)
        kc = tl.load(k_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=KEEP)
        qc = tl.load(q_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=KEEP)
        dS = tl.load(dst_at + rp[:, None] * N + rn[None, :], eviction_policy=KEEP)
        CB += tl.dot(qc.to(DOT), tl.trans(kc.to(DOT)), input_precision=PRECISION)
        Q += tl.dot(kc.to(SDOT), tl.trans(dS.to(SDOT)), input_precision=PRECISION)
    # 2. the chunk's own terms, in an order that lets each tile go as soon as it can (Q first, then CB)
    x = rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P, RANK).to(DOT)
    dy = tl.load(dy_ptr + xp_at, mask=m[:, None], other=0.0, eviction_policy=KEEP).to(DOT)
    wxQ = w * tl.sum(x.to(tl.float32) * Q, axis=1)  # x_j . Q_j at the decay to the chunk's end
    dx = (xw * w)[:, None] * Q + tl.load(skip_ptr + hd) * dy.to(tl.float32)  # the skip D x
    tl.store(dskip_ptr + slot * sums_row + hd, tl.sum(tl.sum(dy.to(tl.float32) * x.to(tl.float32), axis=1), axis=0))
    earlier = step[:, None] > step[None, :]
    W = tl.where(earlier, xw[None, :], tl.load(gam_ptr + t * H + hd, mask=m, other=0.0)[None, :])
    Lm = decay_mask(cs, step)
    CBL = CB * Lm
    dx += tl.dot(tl.trans((CBL * W).to(DOT)), dy, input_precision=PRECISION)
    tl.store(dx_ptr + xp_at, dx.to(dx_ptr.dtype.element_ty), mask=m[:, None])
    dYX = tl.dot(dy, tl.trans(x), input_precision=PRECISION)  # [i, j] = dy_i . x_j
    dW = CBL * dYX  # the gradient of every W[i, j]
    tl.store(dgam_ptr + t * H + hd, tl.sum(tl.where(earlier, 0.0, dW), axis=0), mask=m)
    tl.store(dw_ptr + t * H + hd, tl.sum(tl.where(earlier, dW, 0.0), axis=0) + wxQ, mask=m)
    Sm = dW * W  # = (L * dy x^T * W) * CB: +/- each exp(cs_i - cs_j) of the log-decay gradient
    R = xw * wxQ
    return (Lm * dYX * W).to(DOT), tl.sum(Sm, axis=1) - tl.sum(Sm, axis=0) - R, tl.sum(R, axis=0)


@triton.jit
def _m3_dqdk_block(nb, dcs, SdS, dye, uw, LdYU, k_ptr, q_ptr, th_ptr, dth_ptr, dtt_ptr, dq_ptr, dk_ptr, dqb_ptr, dkb_ptr,
                   st_at, dst_at, kq_at, rp, t, m, first, end, hd, H, n_a, slot, sums_row, P: tl.constexpr,
                   N: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                   SDOT: tl.constexpr, RANK: tl.constexpr, KEEP: tl.constexpr, DROP: tl.constexpr):  # fmt: skip
    """The one sweep's block nb of BN state columns (M3_BWD_ONE_SWEEP): dq and dk on one read of the block's keys,
    queries, states and angles (their last reads), one cos and sin, the two angle gradients summed in registers and
    stored once with their chunk sum; returns dcs and SdS with the block's shares."""
    rn = nb * BN + tl.arange(0, BN)
    kc = tl.load(k_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=DROP)
    qc = tl.load(q_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=DROP)
    S = tl.load(st_at + rp[:, None] * N + rn[None, :], eviction_policy=DROP)
    dS = tl.load(dst_at + rp[:, None] * N + rn[None, :], eviction_policy=DROP)
    dyS = tl.dot(dye, S.to(SDOT), input_precision=PRECISION)
    dcs += tl.sum(dyS * qc.to(tl.float32), axis=1)
    dq = tl.dot(LdYU, kc.to(DOT), input_precision=PRECISION) + dyS
    dk = (tl.dot(tl.trans(LdYU), qc.to(DOT), input_precision=PRECISION)
          + tl.dot(uw, dS.to(SDOT), input_precision=PRECISION))
    SdS += tl.sum(dS.to(tl.float32) * S.to(tl.float32), axis=1)
    cos, sin = _step_angles(th_ptr, t, m, hd, H, n_a, nb * BN, BN, RANK, DROP)
    dth = _key_grad_back(dq, qc.to(tl.float32), cos, sin, dq_ptr, dqb_ptr, m, hd, slot, sums_row, rn, kq_at, RANK,
                         CHUNK, BN, N)  # fmt: skip
    dth += _key_grad_back(dk, kc.to(tl.float32), cos, sin, dk_ptr, dkb_ptr, m, hd, slot, sums_row, rn, kq_at, RANK,
                          CHUNK, BN, N)  # fmt: skip
    _store_angle_grads(dth, dth_ptr, dtt_ptr, t, m, first, end, hd, H, n_a, slot, nb * BN, True, False, RANK, CHUNK, BN,
                       KEEP, DROP)  # fmt: skip
    return dcs, SdS


@triton.jit
def _m3_bwd_key_sweeps(LdYU, dcs, sum_R, x_ptr, xs_ptr, dy_ptr, k_ptr, q_ptr, th_ptr, st_ptr, dst_ptr, ddt_ptr, da_ptr,
                       dk_ptr, dq_ptr, dth_ptr, dtt_ptr, dkb_ptr, dqb_ptr, t, m, first, end, A_h, dt, cs, cs_last, xw, w, slot,
                       hd, H, n_a, sums_row, P: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
                       PRECISION: tl.constexpr, DOT: tl.constexpr, SDOT: tl.constexpr, RANK: tl.constexpr,
                       KEEP: tl.constexpr, DROP: tl.constexpr, ONE_SWEEP: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """The chunk pass's steps 3 and 4 (_m3_bwd_chunk_kernel), from step 2's LdYU, dcs and sum(R): the sweeps over N for
    dq and dk (each taken back through the rotation, _key_grad_back), then the log-decay gradient: ddt and dA's
    partial sum. x and dy are read again here (a step-2 tile held across the sweeps costs registers). ONE_SWEEP: dq
    and dk in one sweep (_m3_dqdk_block), a loop of num_stages=STAGES (Triton's pipeliner loads the next block during
    this one), in place of the two unrolled sweeps."""
    rp = tl.arange(0, P)
    st_at = st_ptr + (slot * H + hd) * P * N
    dst_at = dst_ptr + (slot * H + hd) * P * N
    kq_at = (t[:, None] * H + hd) * N
    xp_at = (t[:, None] * H + hd) * P + rp[None, :]
    # 3. dq = (L * dy x^T * W) k + exp(cs) dy S, with the log-decay gradient's state term q_i . (exp(cs_i) dy_i S).
    # (Reading each block as its pairs' real and imaginary columns apart, two [.., BN // 2] dots each, so that nothing
    # splits a tile to rotate it back, compiled worse for sm_90: spills 444/452 against 312/340, barriers 231 to 147.)
    dy = tl.load(dy_ptr + xp_at, mask=m[:, None], other=0.0, eviction_policy=DROP).to(tl.float32)
    dye = (dy * tl.exp(cs)[:, None]).to(SDOT)
    if ONE_SWEEP:
        x = rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P, RANK).to(tl.float32)
        uw = (x * (xw * w)[:, None]).to(SDOT)
        SdS = tl.zeros((P,), dtype=tl.float32)
        for nb in tl.range(0, N // BN, num_stages=STAGES):
            dcs, SdS = _m3_dqdk_block(nb, dcs, SdS, dye, uw, LdYU, k_ptr, q_ptr, th_ptr, dth_ptr, dtt_ptr, dq_ptr, dk_ptr,
                                      dqb_ptr, dkb_ptr, st_at, dst_at, kq_at, rp, t, m, first, end, hd, H, n_a, slot,
                                      sums_row, P, N, BN, CHUNK, PRECISION, DOT, SDOT, RANK, KEEP, DROP)  # fmt: skip
    else:
        dcs, SdS = _m3_two_sweeps(dcs, dye, LdYU, x_ptr, xs_ptr, k_ptr, q_ptr, th_ptr, dth_ptr, dtt_ptr, dq_ptr, dk_ptr,
                                  dqb_ptr, dkb_ptr, st_at, dst_at, kq_at, rp, t, m, first, end, hd, H, n_a, slot,
                                  sums_row, xw, w, P, N, BN, CHUNK, PRECISION, DOT, SDOT, RANK, KEEP, DROP)  # fmt: skip
    # 4. the log-decay gradient: cs_i sums a_0..a_i, so da_k = sum_{i >= k} dcs_i; cs_last reaches every token
    to_last = tl.exp(cs_last) * tl.sum(SdS, axis=0) + sum_R
    dloga = tl.cumsum(dcs, axis=0, reverse=True) + to_last
    tl.store(ddt_ptr + t * H + hd, (dloga * A_h).to(ddt_ptr.dtype.element_ty), mask=m)
    tl.store(da_ptr + slot * sums_row + hd, tl.sum(tl.where(m, dloga * dt, 0.0), axis=0))


@triton.jit
def _m3_two_sweeps(dcs, dye, LdYU, x_ptr, xs_ptr, k_ptr, q_ptr, th_ptr, dth_ptr, dtt_ptr, dq_ptr, dk_ptr, dqb_ptr,
                   dkb_ptr, st_at, dst_at, kq_at, rp, t, m, first, end, hd, H, n_a, slot, sums_row, xw, w,
                   P: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                   DOT: tl.constexpr, SDOT: tl.constexpr, RANK: tl.constexpr, KEEP: tl.constexpr,
                   DROP: tl.constexpr):  # fmt: skip
    """Step 3 as two unrolled sweeps over N, the queries' then the keys' (each block of keys, queries and states
    read in both); returns dcs and SdS."""
    for nb in tl.static_range(N // BN):
        rn = nb * BN + tl.arange(0, BN)
        kc = tl.load(k_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=KEEP)
        qc = tl.load(q_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=KEEP).to(tl.float32)
        S = tl.load(st_at + rp[:, None] * N + rn[None, :], eviction_policy=KEEP)
        dyS = tl.dot(dye, S.to(SDOT), input_precision=PRECISION)
        dcs += tl.sum(dyS * qc, axis=1)
        dq = tl.dot(LdYU, kc.to(DOT), input_precision=PRECISION) + dyS
        _key_grads_out(dq, qc, th_ptr, dth_ptr, dtt_ptr, dq_ptr, dqb_ptr, t, m, first, end, hd, H, n_a, slot, sums_row, nb * BN,
                       rn, kq_at, True, RANK, CHUNK, BN, N, KEEP, DROP)  # fmt: skip
    tl.debug_barrier()  # the keys' sweep adds to the angle gradients the queries' stored: every thread sees them
    # ... and dk = (L * dy x^T * W)^T q + w x dS' (x at its input weight)
    x = rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P, RANK).to(tl.float32)
    uw = (x * (xw * w)[:, None]).to(SDOT)
    SdS = tl.zeros((P,), dtype=tl.float32)
    for nb in tl.static_range(N // BN):
        rn = nb * BN + tl.arange(0, BN)
        qc = tl.load(q_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=DROP)
        S = tl.load(st_at + rp[:, None] * N + rn[None, :], eviction_policy=DROP)
        dS = tl.load(dst_at + rp[:, None] * N + rn[None, :], eviction_policy=DROP)
        dk = (tl.dot(tl.trans(LdYU), qc.to(DOT), input_precision=PRECISION)
              + tl.dot(uw, dS.to(SDOT), input_precision=PRECISION))
        kc = tl.load(k_ptr + kq_at + rn[None, :], mask=m[:, None], other=0.0, eviction_policy=DROP).to(tl.float32)
        _key_grads_out(dk, kc, th_ptr, dth_ptr, dtt_ptr, dk_ptr, dkb_ptr, t, m, first, end, hd, H, n_a, slot, sums_row, nb * BN,
                       rn, kq_at, False, RANK, CHUNK, BN, N, KEEP, DROP)  # fmt: skip
        SdS += tl.sum(dS.to(tl.float32) * S.to(tl.float32), axis=1)
    return dcs, SdS


@triton.jit
def _m3_bwd_gap_slot(da_ptr, dskip_ptr, dkb_ptr, dqb_ptr, slot, hd, sums_row, N: tl.constexpr, RANK: tl.constexpr):
    """A gap slot's zeros in its partial sums (dD's, dA's and the biases'): _mamba3_backward sums every slot."""
    tl.store(dskip_ptr + slot * sums_row + hd, 0.0)
    tl.store(da_ptr + slot * sums_row + hd, 0.0)
    rows = (hd * RANK + tl.arange(0, RANK))[:, None]
    rn = tl.arange(0, N)[None, :]
    tl.store(dkb_ptr + slot * sums_row + rows * N + rn, tl.zeros((RANK, N), tl.float32))
    tl.store(dqb_ptr + slot * sums_row + rows * N + rn, tl.zeros((RANK, N), tl.float32))


@triton.jit
def _m3_bwd_chunk_kernel(
    x_ptr, xs_ptr, dt_ptr, w_ptr, gam_ptr, a_ptr, skip_ptr, k_ptr, q_ptr, th_ptr, cu_ptr, st_ptr, dst_ptr, dy_ptr,
    dx_ptr, ddt_ptr, dw_ptr, dgam_ptr, da_ptr, dskip_ptr, dk_ptr, dq_ptr, dth_ptr, dtt_ptr, dkb_ptr, dqb_ptr,
    H, D, n_a, sums_row,
    P: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, BN1: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
    DOT: tl.constexpr, SDOT: tl.constexpr, RANK: tl.constexpr, KEEP: tl.constexpr, DROP: tl.constexpr,
    ONE_SWEEP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The backward's parallel pass (every chunk of every document at once, one program per chunk and head) for
    the forward output kernel's Mamba-3 mode: y = (q k^T * L * W) x + exp(cs) (q S^T) + D x, W[i, j] = w_j (the input
    weight) for an earlier step j and gamma_j for the same one, with the keys k and queries q per head (the
    SSD's B and C). In an order that keeps few tiles live at once (kernels/ssd.py's Mamba-2 order, with W's extra
    [CHUNK, CHUNK] tiles):
      1. over N: CB = q k^T and Q = k dS'^T (the leaving state's gradient at each input);
      2. the chunk's own terms: dx (stored), d weight and d gamma (stored), the log-decay gradient's in-chunk
         part, and L * (dy x^T) * W kept in the dots' dtype;
      3. over N: dq with the log-decay gradient's state term and dk with sum(S * dS'), in one sweep
         (M3_BWD_ONE_SWEEP, the default) or two (the queries', then the keys');
      4. the log-decay gradient: ddt and this chunk's dA.
    Steps 1-2 are _m3_bwd_own_terms, 3-4 _m3_bwd_key_sweeps (as two kernels, step 2's results through memory,
    they took longer: M3_BWD_SPLIT, removed; see the launch constants).
    SDOT: the operands' dtype of the four dots against the state S and its gradient dS' (fp32, or DOT).
    dk and dq go back through the rotation here, unrounded (_key_grad_back; _store_angle_grads stores the angle
    gradients): dB and dC per head in their pointers'
    dtype, the angles' gradient per step [B*T, H, n_a] (summed over a step's ranks) and its sum over the chunk
    [slots, H, n_a], and the biases' partial sums per
    chunk (rows of the launcher's sums buffer, sums_row apart, beside dA's and dD's: [H, R, N] each). (This replaced a
    pass of their own over dk and dq stored in fp32 per head: no fp32 dk and dq go to memory, and one launch fewer.)
    MIMO (RANK > 1): x [B*T, H, P] is read a step at a time and scaled by mimo_x [H, R, P] at xs_ptr (rank_inputs);
    dx is the rank inputs' gradient, one row a sub-token: the autograd backward combines the ranks (summing them here
    took the MIMO kernel's spills from 360/400 to 524/604 bytes a thread, compiled for sm_90 by kernels/resources)."""
    slot, hd, first, end, t, m, step, A_h, dt, cs, cs_last, xw, w = _m3_bwd_chunk_rows(dt_ptr, w_ptr, a_ptr, cu_ptr,
                                                                                       H, D, CHUNK, RANK)  # fmt: skip
    if first >= end:
        _m3_bwd_gap_slot(da_ptr, dskip_ptr, dkb_ptr, dqb_ptr, slot, hd, sums_row, N, RANK)
    else:
        LdYU, dcs, sum_R = _m3_bwd_own_terms(x_ptr, xs_ptr, gam_ptr, skip_ptr, k_ptr, q_ptr, dst_ptr, dy_ptr, dx_ptr,
                                             dw_ptr, dgam_ptr, dskip_ptr, t, m, step, cs, xw, w, slot, hd, H, sums_row,
                                             P, N, BN1, CHUNK, PRECISION, DOT, SDOT, RANK, KEEP)  # fmt: skip
        _m3_bwd_key_sweeps(LdYU, dcs, sum_R, x_ptr, xs_ptr, dy_ptr, k_ptr, q_ptr, th_ptr, st_ptr, dst_ptr, ddt_ptr, da_ptr,
                           dk_ptr, dq_ptr, dth_ptr, dtt_ptr, dkb_ptr, dqb_ptr, t, m, first, end, A_h, dt, cs, cs_last,
                           xw, w, slot, hd, H, n_a, sums_row, P, N, BN, CHUNK, PRECISION, DOT, SDOT, RANK, KEEP,
                           DROP, ONE_SWEEP, STAGES)  # fmt: skip


@triton.jit
def _angle_grads_block(dth_ptr, dtt_ptr, dt_ptr, ddt_ptr, th, slot, last, steps, m, hd0, H, n_a, STEPS: tl.constexpr,
                       RANK: tl.constexpr, HB: tl.constexpr, BA: tl.constexpr, LOOKBACK: tl.constexpr):  # fmt: skip
    """_angle_grads_kernel's work for the HB heads from hd0 of one chunk: each angle increment's gradient (the
    chunk's suffix sums of dth plus the document's later chunks' totals), dt's part added to ddt, and the rates'
    gradient before tanh's derivative, g dt [STEPS, HB*BA] fp32 (th: the rates' tanh on the same lanes)."""
    lane = tl.arange(0, HB * BA)
    col = (hd0 + lane // BA) * n_a + lane % BA  # the lane's column of a [H, n_a] row
    pa = lane % BA < n_a
    carry = tl.zeros((HB * BA,), dtype=tl.float32)
    for j in range(slot + 1, last, LOOKBACK):
        rj = j + tl.arange(0, LOOKBACK)
        tot = tl.load(dtt_ptr + (rj * (H * n_a))[:, None] + col[None, :], mask=(rj < last)[:, None] & pa[None, :],
                      other=0.0)  # fmt: skip
        carry += tl.sum(tot, axis=0)
    mm = m[:, None] & pa[None, :]
    d_inc = tl.cumsum(tl.load(dth_ptr + (steps * (H * n_a))[:, None] + col[None, :], mask=mm, other=0.0), axis=0,
                      reverse=True) + carry[None, :]  # fmt: skip
    heads = hd0 + tl.arange(0, HB)
    dt_at = ((steps * RANK) * H)[:, None] + heads[None, :]  # [STEPS, HB]
    dt = tl.load(dt_ptr + dt_at, mask=m[:, None], other=0.0)
    g = d_inc * 3.141592653589793
    d_dt = tl.sum(tl.reshape(tl.where(mm, g * th, 0.0), (STEPS, HB, BA)), axis=2)
    tl.store(ddt_ptr + dt_at, tl.load(ddt_ptr + dt_at, mask=m[:, None], other=0.0) + d_dt, mask=m[:, None])
    return g * tl.reshape(tl.broadcast_to(dt[:, :, None], (STEPS, HB, BA)), (STEPS, HB * BA))


@triton.jit
def _angle_grads_kernel(dth_ptr, dtt_ptr, rate_ptr, dt_ptr, cu_ptr, drate_ptr, ddt_ptr, H, D, n_a, CHUNK: tl.constexpr,
                        RANK: tl.constexpr, HB: tl.constexpr, BA: tl.constexpr, LOOKBACK: tl.constexpr,
                        SHARED_RATES: tl.constexpr, SUM_HEADS: tl.constexpr):  # fmt: skip
    """The angles' backward from the chunk pass's angle gradients: program (slot, block of HB heads) takes its
    chunk's steps' dth [steps, HB, n_a] (dth_ptr [B*T, H, n_a]), their suffix sums within the chunk plus the sums of
    the document's later chunks (the chunk pass's per-chunk totals at dtt_ptr [slots, H, n_a], LOOKBACK a load): the
    gradient of each angle increment, the document sum of every later angle's. Then through inc = pi tanh(rate) dt:
    the rates' gradient (drate_ptr, the rates' dtype) and dt's part, added to ddt at the step's rank-0 sub-token
    (ddt_ptr [B*T*RANK, H] fp32, the chunk pass's). In place of the angle sums' reverse scan over blocks of steps (two
    launches, its cuts found per block) and the increments' backward in a kernel of their own: a chunk never spans
    two documents, so one pass over the chunk pass's slots needs no cut. Lane j of a row is head j // BA's pair
    j % BA (BA = n_a's power of two; the pairs past n_a masked). SHARED_RATES: the rates are one row a step for every
    head (rate_ptr [B*T, 1, n_a]); their gradient is stored per head [B*T, H, n_a] fp32, for _mamba3_backward to sum
    over the heads, or with SUM_HEADS (HB = 1, one program a slot) summed here over the heads, in order, in fp32,
    and stored once [B*T, 1, n_a] (no per-head buffer written and read back)."""
    slot = tl.program_id(0)
    d, doc_start = slot_document(cu_ptr, slot, D, CHUNK)
    first = doc_start + (slot - doc_start // CHUNK - d) * CHUNK
    doc_end = tl.load(cu_ptr + d + 1)
    if first < doc_end:  # else a gap slot
        STEPS: tl.constexpr = CHUNK // RANK
        steps = first // RANK + tl.arange(0, STEPS)
        m = steps < tl.minimum(first + CHUNK, doc_end) // RANK
        last = doc_start // CHUNK + d + tl.cdiv(doc_end - doc_start, CHUNK)  # past the document's last chunk's slot
        lane = tl.arange(0, HB * BA)
        mm = m[:, None] & (lane % BA < n_a)[None, :]
        if SUM_HEADS:
            rate_at = (steps * n_a)[:, None] + lane[None, :]
            th = _tanh(tl.load(rate_ptr + rate_at, mask=mm, other=0.0).to(tl.float32))
            g_dt = tl.zeros((STEPS, HB * BA), dtype=tl.float32)
            for hd in range(0, H):
                g_dt += _angle_grads_block(dth_ptr, dtt_ptr, dt_ptr, ddt_ptr, th, slot, last, steps, m, hd, H, n_a,
                                           STEPS, RANK, HB, BA, LOOKBACK)  # fmt: skip
            tl.store(drate_ptr + rate_at, (g_dt * (1.0 - th * th)).to(drate_ptr.dtype.element_ty), mask=mm)
        else:
            hd0 = tl.program_id(1) * HB
            at = (steps * (H * n_a))[:, None] + ((hd0 + lane // BA) * n_a + lane % BA)[None, :]
            rate_at = (steps * n_a)[:, None] + (lane % BA)[None, :] if SHARED_RATES else at
            th = _tanh(tl.load(rate_ptr + rate_at, mask=mm, other=0.0).to(tl.float32))
            g_dt = _angle_grads_block(dth_ptr, dtt_ptr, dt_ptr, ddt_ptr, th, slot, last, steps, m, hd0, H, n_a, STEPS,
                                      RANK, HB, BA, LOOKBACK)  # fmt: skip
            tl.store(drate_ptr + at, (g_dt * (1.0 - th * th)).to(drate_ptr.dtype.element_ty), mask=mm)


@triton.jit
def _group_sum_kernel(dbh_ptr, dch_ptr, db_ptr, dc_ptr, ROWS, H, G, N: tl.constexpr, BR: tl.constexpr):
    """dB and dC of B's groups from the chunk pass's per-head parts [ROWS, H, N] (ROWS = B*T*R): each group's heads
    added in order in fp32, stored in db_ptr's dtype; a program a block of BR rows and a group. One launch for both
    in place of two torch reductions and two casts (and their fp32 [ROWS, G, N] intermediates)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    rn = tl.arange(0, N)
    m = (r < ROWS)[:, None]
    acc_b = tl.zeros((BR, N), dtype=tl.float32)
    acc_c = tl.zeros((BR, N), dtype=tl.float32)
    for j in range(0, H // G):
        at = (r[:, None] * H + g * (H // G) + j) * N + rn[None, :]
        acc_b += tl.load(dbh_ptr + at, mask=m, other=0.0).to(tl.float32)
        acc_c += tl.load(dch_ptr + at, mask=m, other=0.0).to(tl.float32)
    out = (r[:, None] * G + g) * N + rn[None, :]
    tl.store(db_ptr + out, acc_b.to(db_ptr.dtype.element_ty), mask=m)
    tl.store(dc_ptr + out, acc_c.to(dc_ptr.dtype.element_ty), mask=m)


# rows a program of _group_sum_kernel (4 warps: 32 x 128 fp32 accumulators, two of them)
GROUP_SUM_ROWS = 32


def group_sums(dBh: torch.Tensor, dCh: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dB and dC [B, T*R, G, N] from per-head parts [B, T*R, H, N] (contiguous, one dtype): _group_sum_kernel,
    group g the heads g*H/G .. (g+1)*H/G - 1 (as the forward's keys read B). Bad input raises a ValueError naming it."""
    if dBh.dim() != 4:
        raise ValueError(f"group_sums: dBh must be [B, T*R, H, N], got shape {tuple(dBh.shape)}")
    B, TR, H, N = dBh.shape
    if dCh.shape != dBh.shape or dCh.dtype != dBh.dtype or dCh.device != dBh.device:
        raise ValueError(f"group_sums: dCh ({tuple(dCh.shape)}, {dCh.dtype}, {dCh.device}) must match dBh "
                         f"({tuple(dBh.shape)}, {dBh.dtype}, {dBh.device})")  # fmt: skip
    if not (dBh.is_contiguous() and dCh.is_contiguous()):
        raise ValueError("group_sums: dBh and dCh must be contiguous (the kernel reads rows H*N apart)")
    if not isinstance(G, int) or G < 1 or H % G:
        raise ValueError(f"group_sums: G={G!r} must be a positive divisor of the heads H={H}")
    if N < 1 or N & (N - 1):
        raise ValueError(f"group_sums: N={N} must be a power of two (the kernel's tile is N columns)")
    dB = torch.empty((B, TR, G, N), device=dBh.device, dtype=dBh.dtype)
    dC = torch.empty_like(dB)
    _group_sum_kernel[(triton.cdiv(B * TR, GROUP_SUM_ROWS), G)](dBh, dCh, dB, dC, B * TR, H, G, N=N,
                                                                BR=GROUP_SUM_ROWS, num_warps=4)  # fmt: skip
    return dB, dC


# sub-tokens per key program (_keys_kernel, 4 warps; on the H200 at [8,4096,16,128], 16 took 210 us, 32 302)
KEYS_BLOCK_T = 16
# the rotation's tile in _angle_keys_kernel, whose program covers SCAN_BLOCK_T * R sub-tokens: it must divide that
# (past the program's block a tile would read angles the next program has not stored; _angles_and_keys checks). On
# the H100 at bench ssd's main shape (scripts/mamba3_probe.py, one call) 32 took the kernel 0.263 ms against 16's 0.288
ANGLE_KEYS_BLOCK_T = 32
# the backward's chunk pass (_m3_bwd_chunk_kernel): state columns per sweep step and warps (on the H100 at the issue's
# shape, 64 columns and 4 warps took 1.69 ms, 32 columns 1.65, 128 2.03, 8 warps 1.90-2.06; with the two sweeps at
# 8d139e5, 32 columns 1.322 against 64's 1.061: the one sweep below takes 32)
M3_BWD_BLOCK_N = 32
# the chunk pass's step 1 (the reductions over N, q k^T and k dS'^T) in blocks of its own width: on an H100 at bench
# ssd's main shape (scripts/mamba3_probe.py at a342a06, one call, profiles/nvidia-h100-80gb-hbm3/ssd/lead_reduce_block/)
# the chunk kernel took 0.877 ms at 64 columns against 1.020 at 32 and 0.916 at 128; at H = 32, 0.893 against 1.041
M3_BWD_REDUCE_BLOCK_N = 64
M3_BWD_WARPS = 4
# the chunk pass's L2 eviction hints: a tile it reads again later (k, q, dS' and dy in steps 1-2; with two sweeps
# also S, the angles and the queries' angle gradients) loaded "evict_last", its last read "evict_first". Its rereads
# of a program's own tiles miss
# L2 (Nsight Compute at bench ssd's main shape on an H100: 56% L2 hits, 1.83 GB from DRAM where the kernel's tensors
# hold about 1.1 GB; lead_ncu_host/), and the pass is latency-bound: a hit is the shorter wait
M3_BWD_EVICT = True
# the chunk pass's step 3: dq and dk in one sweep over N (M3_BWD_ONE_SWEEP: each block's keys, queries, states and
# angles read once, one cos and sin, the angle gradients stored once), a loop of num_stages=M3_BWD_STAGES, in place
# of two unrolled sweeps. On an H100 at bench ssd's main shape (scripts/mamba3_probe.py at 8d139e5, one call,
# profiles/nvidia-h100-80gb-hbm3/ssd/lead_one_sweep/) the kernel took 1.006 ms at 32 columns and 3 stages against the
# two sweeps' 1.061 (64 columns): 2 stages 1.078, 1 (a rolled loop) 1.172, 64 columns at 2 stages 1.045
M3_BWD_ONE_SWEEP = True
M3_BWD_STAGES = 3
# heads a program of the angles' backward (_angle_grads_kernel) where it does not sum over the heads (rates per head,
# or ANGLE_GRADS_SUM_HEADS off), at most (a power of two): gcd(H, this). On the H100
# at bench ssd's main shape (scripts/mamba3_probe.py, profiles/nvidia-h100-80gb-hbm3/ssd/lead_angle_grads/
# mamba3_probe_heads_bc8cbac.json, one call) the kernel took 0.084 ms at one head a program (9216 programs of [64, 32]
# lanes: 576 chunk slots by 16 heads), 0.095 at two, 0.123 at four
ANGLE_GRADS_HEADS = 1
# rates shared by the heads (the layer's one row a token): the angles' backward sums their gradient over the heads
# itself, a program a chunk looping over the heads, and stores it once in the rates' shape and dtype; off, it stores
# [B, T, H, n_a] fp32 per head, 67 MB at bench ssd's main shape, read back by an inductor sum. On an H100 there
# (scripts/mamba3_probe.py at 88667a0, one call, two rows each: profiles/nvidia-h100-80gb-hbm3/ssd/
# lead_angle_grads_sum_heads/) forward and backward took 1.830 / 1.830 ms against 1.848 / 1.848 off (the sum 0.033 ms).
# It changes the op's d rates (shape, dtype), so the autograd formula passes it to mamba3_scan_bwd as an argument:
# a traced graph holds the value it was traced with, and its fake and its kernels agree whatever the constant is later
ANGLE_GRADS_SUM_HEADS = True
# (Forms of the chunk pass measured slower and removed: M3_BWD_SPLIT, steps 1-2 and 3-4 as two kernels, step 2's
# [CHUNK, CHUNK] tile, a vector and a sum per program through memory, which spilled less at 32 columns and took 2.063 ms
# forward and backward against the one kernel's 1.996 (profiles/nvidia-h200/ssd/mamba3_fwd_bwd.json at 418f173) and, at
# 88667a0 on an H100 (M3_BWD_REDUCE_BLOCK_N = 64), 2.008 against 1.837 while its first kernel spilled 44 bytes a thread
# to the one kernel's 24 (profiles/nvidia-h100-80gb-hbm3/ssd/mamba3_fwd_bwd.json's M3_BWD_SPLIT row and
# tests/pytest_gpu_88667a0_mamba3_resources.log); the split under a cap of 128 registers at 8 warps (H200: 0.92 + 0.87
# ms); step 3 a program per block of 32 state columns (0.82 ms beside the first kernel's 0.60 where the one kernel took
# 1.01, each block program repeating the chunk's prologue: profiles/nvidia-h100-80gb-hbm3/ssd/lead_sweep_per_block/).)
# the chunk pass's dots against the stored state and its gradient (kernels/ssd.states_dtype: bf16 for bf16 inputs): in
# the inputs' own dtype (True, mamba_ssm's choice: half the registers and twice the MMA rate), or fp32 operands (False:
# TF32 for 16-bit inputs, on the stored values). fp32 inputs take fp32 either way, as does the interpreter. `bench ssd`
# measures the other setting beside the default, as its own row of profiles/<device>/ssd/mamba3_fwd_bwd.json.
STATE_DOTS_IN_INPUT_DTYPE = True


def _keys_grid(total: int, G: int, block: int) -> tuple[int, int]:
    return (triton.cdiv(total, block), G)


def _rotated_keys(Bm, Cm, theta, b_bias, c_bias, H, rank, dtype) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    B, TR, G, N = Bm.shape
    k = torch.empty((B, TR, H, N), device=Bm.device, dtype=dtype)
    q = torch.empty_like(k)
    _keys_kernel[_keys_grid(B * TR, G, KEYS_BLOCK_T)](Bm, Cm, b_bias, c_bias, theta, k, q, B * TR, H, G,
                                                      theta.shape[-1], RANK=rank, BT=KEYS_BLOCK_T, N=N, num_warps=4)  # fmt: skip
    return k, q


def _angles_and_keys(inc, cu_steps, Bm, Cm, b_bias, c_bias, H, rank, dtype) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """theta = doc_angle_sum(inc) [B,T,H,n_a] and the rotated keys and queries per head [B,T*R,H,N] in `dtype`: the
    angle sums' block totals (_doc_scan_totals_kernel), then their second pass and the key pass in one
    (_angle_keys_kernel). Bit for bit doc_angle_sum_triton's theta and _rotated_keys's keys on it (the same jit
    code on the same values; tests/test_mamba3.py holds them equal)."""
    B, TR, G, N = Bm.shape
    theta = torch.empty_like(inc)
    n_a = inc.shape[-1]
    if n_a == 0:  # no rotated pairs: nothing to scan (and a scan's grid may not be empty); the keys only biased
        return (theta, *_rotated_keys(Bm, Cm, theta, b_bias, c_bias, H, rank, dtype))
    if (SCAN_BLOCK_T * rank) % ANGLE_KEYS_BLOCK_T:
        raise ValueError(f"mamba3: ANGLE_KEYS_BLOCK_T ({ANGLE_KEYS_BLOCK_T}) must divide SCAN_BLOCK_T * R "
                         f"({SCAN_BLOCK_T} * {rank}): the angle-and-key pass rotates its block of sub-tokens in tiles "
                         "of ANGLE_KEYS_BLOCK_T")  # fmt: skip
    totals, (blocks, _), _ = _doc_block_totals(inc, cu_steps, angles=True, reverse=False)
    k = torch.empty((B, TR, H, N), device=Bm.device, dtype=dtype)
    q = torch.empty_like(k)
    _angle_keys_kernel[(blocks, H)](
        inc, cu_steps, totals, theta, Bm, Cm, b_bias, c_bias, k, q, cu_steps.numel() - 1, inc.shape[0] * inc.shape[1],
        H, G, n_a, BS=SCAN_BLOCK_T,
        BA=triton.next_power_of_2(n_a), LOOKBACK=SCAN_LOOKBACK, FIXED_POINT=ANGLE_FIXED_POINT, RANK=rank,
        BT=ANGLE_KEYS_BLOCK_T, N=N, num_warps=4,
    )  # fmt: skip
    return theta, k, q


@torch.library.custom_op("megacpp::mamba3_scan_fwd", mutates_args=())
def mamba3_scan_fwd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, inc: torch.Tensor,
    rates: torch.Tensor, b_bias: torch.Tensor, c_bias: torch.Tensor, weight: torch.Tensor, gamma: torch.Tensor, D: torch.Tensor,
    mimo_x: Optional[torch.Tensor], cu_steps: torch.Tensor, cu_seqlens: torch.Tensor, order: torch.Tensor,  # noqa: UP045
    chunk: int, rank: int, save: bool, keep_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """y [B,T*R,H,P] over rank sub-tokens, the skip D x included (D [H] fp32), the saved chunk states, the keys
    and queries kept for the backward (keep_keys, as keeps_keys decides; else empty), and the angles theta
    [B,T,H,n_a] fp32 (doc_angle_sum of the increments inc, which the backward reads). The angles and the keys and
    queries per head, k = rot(B + b_bias, theta) in x's dtype, in two Triton passes (_angles_and_keys), then
    kernels/ssd.py's kernels in Mamba-3 mode: a step's own inputs weighted by gamma, every later step's by weight
    (the trapezoid's exact diagonal; a step's ranks see each other). x [B,T,H,P], one row a step: MIMO's rank
    inputs x * mimo_x[r] (mimo_x [H,R,P] fp32; None for SISO) are formed as the kernels read x; dt (rank 0's, the
    others 0), weight and gamma [B,T*R,H] fp32; B and C [B,T*R,G,N]; the angle increments inc [B,T,H,n_a] fp32
    (pi tanh(rates) dt, formed by the caller without a gradient of their own) and the angle rates [B,T,H,n_a] as the
    layer gives them (any float dtype; [B,T,1,n_a] where the heads share them, _rates): the op's backward
    differentiates the increments itself, to the rates and dt
    (_angle_grads_kernel: in an elementwise kernel of inductor's it took 70 us of the scan's backward at bench
    ssd's main shape on an H100, and forming the increments inside the angle passes in place of reading them took
    those passes 0.13 ms longer there); the biases [H,R,N] fp32; cu_steps over the steps (doc_angle_sum's), cu_seqlens over the
    sub-tokens (R times it; the same tensor for SISO), order its documents longest first (the state passes' start
    order: varlen.documents_longest_first, PackedContext.longest_first). Contiguous, validated by mamba3_scan. One op for the
    angles and the scan: the angle sums as ops of their own cost two dispatches and a launch a forward and backward,
    where an H100 box's host took 2.11 ms to issue the old ops' compiled forward and backward at bench ssd's main
    shape and an H200 runs their kernels in 2.04 (scripts/mamba3_probe.py)."""
    theta, k, q = _angles_and_keys(inc, cu_steps, Bm, Cm, b_bias, c_bias, x.shape[2], rank, x.dtype)
    y, states = launch_ssd_fwd(x, dt, A, k, q, cu_seqlens, order, chunk, save, weight, x.dtype,
                               Mamba3Operands(gamma, rank, D, mimo_x))  # fmt: skip
    if save and keep_keys:
        return y, states, k, q, theta
    return y, states, k.new_empty((0,)), q.new_empty((0,)), theta


def keeps_keys(x: torch.Tensor, Bm: torch.Tensor) -> bool:
    """x [B,T,H,P] and B [B,T*R,G,N] as mamba3_scan_fwd takes them: whether the forward keeps its rotated keys and
    queries for the backward, which then takes them in place of B and C and runs no key pass of its own. Where they
    are in B's dtype and nothing asks for activation memory back (inductor's activation_memory_budget at 1, as eager
    runs and as apply_ac leaves a block at budget 1: the op's outputs cannot be recomputed, where B and C, saved in
    their place, can, so a budget below 1 keeps the key pass). At any G: with fewer groups than heads the kept keys
    are H / G times B's size (the base model's M block, G = 1, H = 32: 268 MB a layer at B=4 T=4096 in bf16), the
    memory a budget of 1 says to spend, and the key pass they spare took 0.147 ms of that layer's backward on an H100
    (profiles/nvidia-h100-80gb-hbm3/compile/, 860c8e6; 0.143 ms a call at bench ssd's H=32 shape, the probe at
    16f4aee). At bench ssd's main shape (G = H) it took 0.16 ms of the
    scan's 2.6 (probe, H200)."""
    return Bm.dtype == x.dtype and torch._functorch.config.activation_memory_budget >= 1.0


@mamba3_scan_fwd.register_fake
def _(x, dt, A, Bm, Cm, inc, rates, b_bias, c_bias, weight, gamma, D, mimo_x, cu_steps, cu_seqlens, order, chunk, rank,  # noqa: ANN001, ANN202
      save, keep_keys):  # fmt: skip
    B, TR = dt.shape[:2]
    H, P = x.shape[2:]
    n_slots = B * TR // chunk + cu_seqlens.shape[0] - 1  # kernels/ssd.py's slot bound
    keys = (B, TR, H, Bm.shape[-1]) if save and keep_keys else (0,)
    return (x.new_empty((B, TR, H, P)),
            x.new_empty((n_slots if save else 0, H, P, Bm.shape[-1]), dtype=states_dtype(x.dtype)),
            x.new_empty(keys), x.new_empty(keys), torch.empty_like(inc))  # fmt: skip


@torch.library.custom_op("megacpp::mamba3_scan_bwd", mutates_args=())
def mamba3_scan_bwd(
    dy: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
    theta: torch.Tensor, rates: torch.Tensor, b_bias: torch.Tensor, c_bias: torch.Tensor, weight: torch.Tensor,
    gamma: torch.Tensor, D: torch.Tensor, mimo_x: Optional[torch.Tensor], cu_steps: torch.Tensor,  # noqa: UP045
    cu_seqlens: torch.Tensor, order: torch.Tensor, states: torch.Tensor, chunk: int, rank: int, rotated: bool,
    groups: int, sum_heads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:  # fmt: skip
    """d x_r [B,T*R,H,P] (the rank inputs' gradient, one row a sub-token: _mamba3_backward combines the ranks), ddt
    (the angle increments' part included), dB, dC (B's dtype), d rates (the angles' gradient, summed over the
    ranks in the chunk pass, then over each document's later steps and through the increments pi tanh(rates) dt by
    _angle_grads_kernel, in this op as the forward's sums are in its: the rates' shape and dtype, summed over the
    heads there where they share the rates; with sum_heads False, such rates' gradient is [B,T,H,n_a] fp32, which
    _mamba3_backward sums over the heads: _d_rates_layout), d weight, d gamma, and the
    per-chunk partial gradients of A, D and the two biases in one fp32 buffer [slots, 2H + 2HRN] (_mamba3_backward
    sums the slots and split_sums parts the sum: a custom op's outputs may not be views of one another, and four
    reductions over the chunks would be four launches).
    rotated: Bm and Cm are the forward's rotated keys and queries per head (keeps_keys), else B and C, and the keys
    are recomputed; groups: B's G either way (dB and dC are [B,T*R,G,N]); sum_heads: ANGLE_GRADS_SUM_HEADS as the
    autograd formula read it. SSD's sequential state pass, then the chunk pass (_m3_bwd_chunk_kernel), which also
    takes dk and dq back through the rotation, unrounded."""
    B, TR, _, N = Bm.shape
    G = groups
    H, P, R, n_a = x.shape[2], x.shape[3], rank, theta.shape[-1]
    if G < 1 or H % G or Bm.shape[2] != (H if rotated else G):
        raise ValueError(f"mamba3_scan_bwd: groups={G} must divide H={H}, and Bm's dim 2 ({Bm.shape[2]}) be "
                         f"{'H (rotated keys)' if rotated else 'groups'}")  # fmt: skip
    if rates.shape[2] not in (1, H):
        raise ValueError(f"mamba3_scan_bwd: rates must be [B,T,H,n_a] or [B,T,1,n_a] (one row for every head), got "
                         f"{list(rates.shape)} with H={H}")  # fmt: skip
    k, q = (Bm, Cm) if rotated else _rotated_keys(Bm, Cm, theta, b_bias, c_bias, H, R, x.dtype)
    dy = dy.contiguous()
    dstates = launch_ssd_bwd_states(dy, dt, A, q, cu_seqlens, order, states, chunk, x.dtype)
    dots = dot_types(x.dtype)
    sdot = dots["DOT"] if STATE_DOTS_IN_INPUT_DTYPE else tl.float32
    n_slots = states.shape[0]
    dx = torch.empty((B, TR, H, P), device=x.device, dtype=x.dtype)
    ddt, dw, dgam = torch.empty_like(dt), torch.empty_like(weight), torch.empty_like(gamma)
    # the per-chunk partial sums of dA, dD and the two biases' gradients in one [slots, row] buffer, returned as it is:
    # _mamba3_backward sums the slots at once (one reduction, not four), outside the op, where inductor fuses it
    sums = torch.empty((n_slots, 2 * H + 2 * H * R * N), device=x.device, dtype=torch.float32)
    dA, dD, dbb, dcb = sums.split([H, H, H * R * N, H * R * N], dim=1)  # strided views: the kernel's rows are sums'
    xs = mimo_x if R > 1 else dt  # SISO: a placeholder pointer the kernels never read
    dth = torch.empty_like(theta)  # one row a step: the kernels sum a step's ranks
    dtt = torch.empty((n_slots, H, n_a), device=x.device, dtype=torch.float32)  # dth's sum over each chunk
    # dB and dC per head in B's dtype: one head a group, the gradients themselves; else each head's part, summed over
    # the group below in fp32 (_group_sum_kernel)
    dBh = torch.empty((B, TR, H, N), device=x.device, dtype=Bm.dtype)
    dCh = torch.empty_like(dBh)
    consts = dict(P=P, N=N, BN=min(M3_BWD_BLOCK_N, N), CHUNK=chunk, **dots, SDOT=sdot, RANK=R,
                  KEEP="evict_last" if M3_BWD_EVICT else "", DROP="evict_first" if M3_BWD_EVICT else "",
                  num_warps=M3_BWD_WARPS, num_stages=1)  # fmt: skip
    sweeps = dict(ONE_SWEEP=M3_BWD_ONE_SWEEP, STAGES=M3_BWD_STAGES)
    for name, width in (("M3_BWD_BLOCK_N", M3_BWD_BLOCK_N), ("M3_BWD_REDUCE_BLOCK_N", M3_BWD_REDUCE_BLOCK_N)):
        if width < 16 or width & (width - 1):  # as ANGLE_GRADS_HEADS's check below: cheap on every backward
            raise ValueError(f"mamba3_scan_bwd: {name}={width!r} must be a power of two >= 16 (a block of state "
                             "columns is a dot's operand; N, a power of two >= 16, then holds whole blocks)")  # fmt: skip
    reduce_block = min(M3_BWD_REDUCE_BLOCK_N, N)
    n_docs = cu_seqlens.numel() - 1
    _m3_bwd_chunk_kernel[(n_slots, H)](
        x, xs, dt, weight, gamma, A, D, k, q, theta, cu_seqlens, states, dstates, dy,
        dx, ddt, dw, dgam, dA, dD, dBh, dCh, dth, dtt, dbb, dcb, H, n_docs, n_a, sums.shape[1], BN1=reduce_block,
        **consts, **sweeps,
    )  # fmt: skip
    dB, dC = (dBh, dCh) if G == H else group_sums(dBh, dCh, G)
    shared = _shares_rates(rates, H)
    shape, dtype = _d_rates_layout(rates, H, sum_heads)
    d_rates = torch.empty(shape, device=x.device, dtype=dtype)
    if n_a:  # the angles' suffix sums and the increments' backward, dt's part added to ddt
        if ANGLE_GRADS_HEADS < 1 or ANGLE_GRADS_HEADS & (ANGLE_GRADS_HEADS - 1):
            raise ValueError(f"mamba3_scan_bwd: ANGLE_GRADS_HEADS={ANGLE_GRADS_HEADS} must be a power of two >= 1 (a "
                             "program's lanes are its heads times n_a's power of two)")  # fmt: skip
        in_kernel_sum = shared and sum_heads  # (rates per head have nothing to sum)
        hb = 1 if in_kernel_sum else math.gcd(H, ANGLE_GRADS_HEADS)
        _angle_grads_kernel[(n_slots, 1 if in_kernel_sum else H // hb)](
            dth, dtt, rates, dt, cu_seqlens, d_rates, ddt, H, n_docs, n_a, CHUNK=chunk, RANK=R, HB=hb,
            BA=triton.next_power_of_2(n_a), LOOKBACK=SCAN_LOOKBACK, SHARED_RATES=shared, SUM_HEADS=in_kernel_sum,
            num_warps=4)  # fmt: skip
    return dx, ddt, dB, dC, d_rates, dw, dgam, sums


@mamba3_scan_bwd.register_fake
def _(dy, x, dt, A, Bm, Cm, theta, rates, b_bias, c_bias, weight, gamma, D, mimo_x, cu_steps, cu_seqlens, order,  # noqa: ANN001, ANN202
      states, chunk, rank, rotated, groups, sum_heads):  # fmt: skip
    B, TR = dt.shape[:2]
    H, P, N = x.shape[2], x.shape[3], Bm.shape[-1]
    dB = Bm.new_empty((B, Bm.shape[1], groups, N))
    shape, dtype = _d_rates_layout(rates, H, sum_heads)
    d_rates = rates.new_empty(shape, dtype=dtype)  # contiguous, as the real op's
    return (x.new_empty((B, TR, H, P)), torch.empty_like(dt), dB, torch.empty_like(dB), d_rates,
            torch.empty_like(weight), torch.empty_like(gamma),
            x.new_empty((states.shape[0], 2 * H + 2 * H * rank * N), dtype=torch.float32))  # fmt: skip


def _mamba3_setup(ctx, inputs, output):  # noqa: ANN001, ANN202
    x, dt, A, Bm, Cm, _inc, rates, b_bias, c_bias, weight, gamma, D, mimo_x, cu_steps, cu_seqlens, order, chunk, rank, \
        _save, _keep = inputs
    _y, states, k, q, theta = output
    ctx.rotated = k.numel() > 0  # the rotated keys kept (keeps_keys): saved in place of B and C
    ctx.groups = Bm.shape[2]
    if ctx.rotated:
        Bm, Cm = k, q
    ctx.save_for_backward(x, dt, A, Bm, Cm, theta, rates, b_bias, c_bias, weight, gamma, D, mimo_x, cu_steps,
                          cu_seqlens, order, states)  # fmt: skip
    ctx.chunk, ctx.rank = chunk, rank
    ctx.set_materialize_grads(False)


def _d_rates_layout(rates: torch.Tensor, H: int, sum_heads: bool) -> tuple[tuple[int, ...], torch.dtype]:
    """mamba3_scan_bwd's d rates, shape and dtype: the rates' own, except where the heads share the rates and the
    angles' backward does not sum over the heads (sum_heads False): per head in fp32, [B,T,H,n_a]."""
    if _shares_rates(rates, H) and not sum_heads:
        return (*rates.shape[:2], H, rates.shape[3]), torch.float32
    return tuple(rates.shape), rates.dtype


def _shares_rates(rates: torch.Tensor, H: int) -> bool:
    """Whether the heads share the rates' one row a step ([B,T,1,n_a] with H > 1): mamba3_scan_bwd then sums their
    gradient over the heads in the angles' backward (sum_heads), or returns it per head in fp32 [B,T,H,n_a] for
    _mamba3_backward to sum."""
    return rates.shape[2] == 1 and H > 1


def split_sums(sums: torch.Tensor, H: int, R: int, N: int) -> tuple[torch.Tensor, ...]:
    """mamba3_scan_bwd's partial sums summed over the slots, [2H + 2HRN] -> dA [H], dD [H], the biases' gradients
    [H,R,N] each (views)."""
    dA, dD, dbb, dcb = sums.split([H, H, H * R * N, H * R * N])
    return dA, dD, dbb.view(H, R, N), dcb.view(H, R, N)


def _mamba3_backward(ctx, dy, _dstates, _dk, _dq, _dtheta):  # noqa: ANN001, ANN202
    x, dt, A, Bm, Cm, theta, rates, b_bias, c_bias, weight, gamma, D, mimo_x, cu_steps, cu_seqlens, order, states = (
        ctx.saved_tensors)
    if states.numel() == 0:
        raise RuntimeError("mamba3_scan_fwd ran with save=False; its output cannot be differentiated")
    dxr, ddt, dB, dC, d_rates, dw, dgam, sums = mamba3_scan_bwd(dy, x, dt, A, Bm, Cm, theta, rates, b_bias, c_bias,
                                                               weight, gamma, D, mimo_x, cu_steps, cu_seqlens, order,
                                                               states, ctx.chunk, ctx.rank, ctx.rotated,
                                                               ctx.groups, ANGLE_GRADS_SUM_HEADS)  # fmt: skip
    # the per-chunk partial sums (and, with ANGLE_GRADS_SUM_HEADS off, the shared rates' per-head gradients) are
    # summed here, outside the op, where inductor fuses each reduction into the kernel that consumes it (inside the op
    # each was an aten reduction of its own: on the H100's compiled base step, 12 + 32 us an M block, c4f5642's trace). (The rates' rows stored
    # head-major, so that their sum reads contiguous slabs, left bench ssd's 34 us inductor sum as it was: H100 probe
    # of 63a6a0e, profiles/nvidia-h100-80gb-hbm3/ssd/lead_sweep_per_block/; not kept)
    if d_rates.shape[2] != rates.shape[2]:  # shared rates' rows per head in fp32 (ANGLE_GRADS_SUM_HEADS off)
        d_rates = d_rates.sum(2, keepdim=True).to(rates.dtype)
    # views of one vector: these four gradients share a storage, each its own disjoint part of it
    dA, dD, dbb, dcb = split_sums(sums.sum(0), x.shape[2], ctx.rank, Bm.shape[-1])
    dx, dmx = dxr, None
    if mimo_x is not None:  # through x_r = x * mimo_x[r] (rank_inputs' rounding): elementwise work inductor fuses
        B, T, H, P = x.shape
        dxr = dxr.view(B, T, ctx.rank, H, P).float()
        scale = mimo_x.transpose(0, 1).to(x.dtype).float()  # as the kernels scaled x
        dx = (dxr * scale).sum(2).to(x.dtype) if ctx.needs_input_grad[0] else None
        dmx = (dxr * x.float()[:, :, None]).sum((0, 1)).transpose(0, 1) if ctx.needs_input_grad[12] else None
    return (dx, ddt, dA.to(A.dtype), dB, dC, None, d_rates, dbb, dcb, dw, dgam, dD, dmx, None, None, None, None, None,
            None, None)


mamba3_scan_fwd.register_autograd(_mamba3_backward, setup_context=_mamba3_setup)


def _keys(Bm: torch.Tensor, bias: torch.Tensor, theta: torch.Tensor, H: int) -> torch.Tensor:
    """The rotated keys (or queries) per head in theta's dtype, [B,T,R,H,N] (the chunked path): B [B,T,R,G,N] read
    by each head of its group, plus the bias [H,R,N], rotated by theta [B,T,1,H,N_a]."""
    acc = theta.dtype
    return rotate_pairs(Bm.to(acc).repeat_interleave(H // Bm.shape[3], dim=3) + bias.transpose(0, 1).to(acc), theta)


def _mamba3_triton(x, mimo_x, dt, A, Bm, Cm, angles, b_bias, c_bias, weight, gamma, D, cu_seqlens, order, chunk):  # noqa: ANN001, ANN202
    """The Triton op on x [B,T,H,P] (MIMO: with its rank scale mimo_x [H,R,P], applied in the kernels; SISO: None),
    the rank form of the keys (_ranked_keys's B, C [B,T,R,G,N] and biases [H,R,N]) and the angle rates [B,T,H,n_a]
    (or [B,T,1,n_a], shared by the heads)
    (their increments formed here without a gradient, summed into the angles in the op, and differentiated by its
    backward): y [B,T,R,H,P] with D x (D None: no skip)."""
    B, T, H, P = x.shape
    R = Bm.shape[2]
    if R == 1 and mimo_x is not None:  # rank-1 MIMO is SISO on the scaled inputs (the kernels take a scale for R > 1)
        x, mimo_x = x * mimo_x[:, 0].to(x.dtype), None
    if chunk % R:
        raise ValueError(f"mamba3: the Triton scan's chunk ({chunk} sub-tokens) must hold whole steps of R={R} ranks")
    for name, n in (("chunk", chunk), ("P (x's head dim)", P), ("N (Bm's state dim)", Bm.shape[-1])):
        if n < 16 or n & (n - 1):
            raise ValueError(f"the Triton Mamba-3 scan needs {name} a power of two >= 16 (tl.dot tiles), got {n}")
    if not launchable(x.device):
        raise RuntimeError(f"kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests); x is on {x.device}")
    if x.dtype == torch.float64:
        raise ValueError("the Triton Mamba-3 scan takes float32, bfloat16 or float16 x; float64 is for the torch paths")
    N = Bm.shape[-1]
    n_docs = cu_seqlens.shape[0] - 1
    # the saved states, and the keys per head and sub-token
    elements = max((B * T * R // chunk + n_docs) * H * P * N, B * T * R * H * max(P, N))
    if elements >= 2**31:  # the kernels index in int32
        raise ValueError(f"the Triton Mamba-3 scan indexes in int32: x {tuple(x.shape[:2])} x {R} ranks with H={H}, "
                         f"P={P}, N={N}, chunk={chunk} and {n_docs} documents needs {elements} elements in one buffer "
                         f"(limit 2**31); split the batch")  # fmt: skip
    sub = lambda t: t.reshape(B, T * R, *t.shape[3:]).contiguous()  # noqa: E731  [B,T,R,...] -> [B,T*R,...]
    fp32_sub = lambda t: sub(t[:, :, None].expand(B, T, R, H).float())  # noqa: E731
    dt_sub = torch.cat((dt[:, :, None].float(), dt.new_zeros((B, T, R - 1, H), dtype=torch.float32)), dim=2)
    # no generator expression: dynamo cannot trace one under fullgraph
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or dt.requires_grad or A.requires_grad or Bm.requires_grad or Cm.requires_grad
        or angles.requires_grad or b_bias.requires_grad or c_bias.requires_grad or weight.requires_grad
        or gamma.requires_grad or (D is not None and D.requires_grad) or (mimo_x is not None and mimo_x.requires_grad)
    )  # fmt: skip
    skip = D.float().contiguous() if D is not None else A.new_zeros((H,), dtype=torch.float32)
    Bs, Cs = sub(Bm), sub(Cm)
    cu_steps = cu_seqlens.to(torch.int32)
    y, *_ = mamba3_scan_fwd(
        x.contiguous(), sub(dt_sub), A.float().contiguous(), Bs, Cs,
        _angle_increments(angles.detach(), dt.detach(), torch.float32).contiguous(), _rates(angles),
        b_bias.float().contiguous(), c_bias.float().contiguous(), fp32_sub(weight), fp32_sub(gamma), skip,
        None if mimo_x is None else mimo_x.float().contiguous(), cu_steps,
        cu_steps if R == 1 else (cu_seqlens * R).to(torch.int32), order, chunk, R, needs_grad,
        needs_grad and keeps_keys(x, Bs),
    )  # fmt: skip
    return y.view(B, T, R, H, P)


def _rates(angles: torch.Tensor) -> torch.Tensor:
    """The angle rates as the op saves them for its backward: [B,T,1,n_a] where every head reads the same row (the
    layer's rates, one projection a token: given as [B,T,1,n_a], or expanded over the heads with a stride-0 head dim),
    else [B,T,H,n_a]. The shared form spares a copy of them per head (at the base model's M block, B=4 T=4096 H=32 and
    32 pairs in fp32, 67 MB a layer written in the forward, saved, and read again in the backward)."""
    if angles.shape[2] > 1 and angles.stride(2) == 0:
        return angles[:, :, :1].contiguous()
    return angles.contiguous()


def _angle_increments(angles: torch.Tensor, dt: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The angles' increments pi tanh(angles) dt [B,T,H,N_a] in the accumulation dtype: theta is their sum from each
    document start, mod 2 pi (doc_angle_sum; the Triton op takes them in its own passes)."""
    return torch.tanh(angles.to(acc)) * math.pi * dt.to(acc)[..., None]


def mamba3_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor, trap: torch.Tensor,
    angles: torch.Tensor, b_bias: torch.Tensor, c_bias: torch.Tensor, D: torch.Tensor | None = None, *,
    mimo_x: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, ctx: PackedContext | None = None,
    chunk: int = 64, kernel: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """The Mamba-3 scan over packed rows, SISO or MIMO (B and C with a rank dim, and mimo_x), y in x's dtype
    ([B,T,H,P], MIMO [B,T,R,H,P]), through the SSD scan (module docstring). The documents: ctx (the batch's
    PackedContext), or bare cu_seqlens, or neither (one document per row). kernel: "triton" (the lab's SSD
    Triton op), "chunked" (plain torch, compilable), "reference" (the step loop), "auto" (Triton on CUDA,
    chunked elsewhere). chunk counts SSD tokens: MIMO's chunk covers chunk / R steps."""
    if kernel not in KERNELS:
        raise ValueError(f"mamba3 kernel must be one of {KERNELS}, got {kernel!r}")
    if ctx is not None:
        check_context(ctx)
        if cu_seqlens is not None:
            raise ValueError("mamba3: give ctx or cu_seqlens, not both")
        cu_seqlens = ctx.cu_seqlens
    B, T, H, P, G, N, n_a, R = _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, mimo_x)
    if B == 0 or T == 0:  # an empty batch has no document: it failed deep inside the chunking before
        raise ValueError(f"mamba3 x must hold tokens, got [B,T,H,P] = {list(x.shape)}")
    if ctx is not None:
        if ctx.shape != (B, T):
            raise ValueError(f"mamba3: ctx is for [B,T] = {ctx.shape}, x is {tuple(x.shape)}")
    elif cu_seqlens is not None:  # bare boundaries: checked here, against the tokens, not the sub-tokens
        check_cu_seqlens(cu_seqlens, B * T, device=x.device, row_len=T)
    if kernel == "reference":
        return mamba3_scan_reference(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, cu_seqlens, mimo_x=mimo_x)
    mimo = Bm.dim() == 5
    Bm, Cm, b_bias, c_bias = _ranked_keys(Bm, Cm, b_bias, c_bias)
    acc = torch.promote_types(x.dtype, torch.float32)
    if cu_seqlens is None:  # one document a row
        cu_seqlens = torch.arange(0, B * T + 1, T, device=x.device, dtype=torch.int32)
    # [B,T] document starts: the batch's context holds them (no mask built in every M block); bare cu_seqlens build it
    start = ctx.starts if ctx is not None else doc_start_mask(cu_seqlens, B, T, x.device)
    dts, lam = dt.to(acc), torch.sigmoid(trap.to(acc))
    # delta_next: the next token's previous-input weight, zero where the next token starts a document (or past the row)
    continues = torch.cat((~start[:, 1:], torch.zeros_like(start[:, :1])), dim=1)
    delta_next = torch.cat((((1 - lam) * dts)[:, 1:], torch.zeros_like(dts[:, :1])), dim=1) * continues[..., None]
    gamma = lam * dts
    weight = gamma + delta_next  # [B,T,H]
    if kernel == "auto":
        kernel = "triton" if x.device.type == "cuda" else "chunked"
    if kernel == "triton":  # one op: keys and queries biased and rotated in the kernels, the diagonal exact, D x added
        order = ctx.longest_first if ctx is not None else documents_longest_first(cu_seqlens)
        y = _mamba3_triton(x, mimo_x, dt, A, Bm, Cm, angles, b_bias, c_bias, weight, gamma, D, cu_seqlens, order,
                           chunk)  # fmt: skip
    else:
        xr = _rank_inputs(x, mimo_x)
        # the increments [B,T,H,N_a]; theta, their document sums, is shared by the ranks
        theta = doc_angle_sum(_angle_increments(angles, dt, acc), cu_seqlens)
        y = _mamba3_chunked(xr, dts, A, Bm, Cm, theta[:, :, None], b_bias, c_bias, weight, gamma, delta_next,
                            cu_seqlens, chunk)  # fmt: skip
        if D is not None:
            y = y + D.to(acc)[:, None] * xr.to(acc)
    # SISO: the one rank's dim dropped by a view, not a select (a select's backward wrote dy into a fresh zero
    # [B,T,1,H,P] buffer before the op's backward: a 41 us copy a call at bench ssd's main shape, H100)
    return (y if mimo else y.view(B, T, H, P)).to(x.dtype)


def _mamba3_chunked(xr, dt, A, Bm, Cm, theta, b_bias, c_bias, weight, gamma, delta_next, cu_seqlens, chunk):  # noqa: ANN001, ANN202
    """The scan through the SSD's chunked torch form (the CPU path, compilable): the rank form's keys and queries
    rotated in fp32, the SSD with weight w over the rank sub-tokens, then the same step's exact weights by an
    R x R correction (module docstring). y [B,T,R,H,P] in fp32 (fp64 for fp64 inputs), without D x."""
    B, T, R, H, P = xr.shape
    acc = theta.dtype
    k, q = _keys(Bm, b_bias, theta, H), _keys(Cm, c_bias, theta, H)
    # the SSD over T*R sub-tokens (t, r): rank 0 carries the step's decay, the others decay by 1
    sub = lambda t: t.reshape(B, T * R, *t.shape[3:])  # noqa: E731  [B,T,R,...] -> [B,T*R,...]
    dt_sub = torch.cat((dt[:, :, None], torch.zeros_like(dt[:, :, None]).expand(B, T, R - 1, H)), dim=2)
    w_sub = weight[:, :, None].expand(B, T, R, H)
    cu_sub = None if cu_seqlens is None else cu_seqlens * R
    # y comes back in fp32: the correction below takes the next token's weight back out of it, and from a bf16 y
    # that left the next token's dt in this token's output at up to 17 bf16 ulps
    y = ssd_scan(sub(xr), sub(dt_sub), A, sub(k), sub(q), cu_seqlens=cu_sub, chunk=chunk,
                 kernel="chunked", x_weight=sub(w_sub), checked=True, y_fp32=True).view(B, T, R, H, P).to(acc)  # fmt: skip
    # the same step's exact weights: gamma for every rank (the SSD gave w to ranks r <= r' and none to r > r')
    # Products and sums, not einsum: an einsum over R x R per token becomes a batched matmul of [R, N] x [N, R]
    # blocks, one per token and head (half a million 1 x 1 products at R = 1), where inductor fuses these.
    later = torch.ones(R, R, dtype=torch.bool, device=xr.device).triu(1)[:, :, None]  # [r', r, 1]: r > r'
    coef = torch.where(later, gamma[:, :, None, None], -delta_next[:, :, None, None])  # [B,T,R',R,H]
    qk = (q[:, :, :, None] * k[:, :, None]).sum(-1)  # [B,T,R',R,H]
    return y + ((qk * coef)[..., None] * xr.to(acc)[:, :, None]).sum(3)
