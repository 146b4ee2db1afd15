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
where r <= r' (for SISO, the diagonal -delta_next (q . k) x). `mamba3_scan` is that; the step loop is its oracle.

Shapes follow kernels/ssd.py: x [B,T,H,P], dt [B,T,H], A [H], the trapezoid logits trap [B,T,H], the angle
rates angles [B,T,H,N_a] with N_a <= N/2 (the pairs past N_a are not rotated), D [H]. SISO: B and C [B,T,G,N]
(G groups of heads, H % G == 0), the biases [H,N], y [B,T,H,P]. MIMO: B and C [B,T,R,G,N], the biases [H,R,N],
mimo_x [H,R,P], y [B,T,R,H,P] (one output per rank: the layer gates and combines them).
"""

from __future__ import annotations

import math

import torch

from megacpp_lab.kernels.ssd import doc_start_mask, ssd_scan
from megacpp_lab.varlen import PackedContext, check_cu_seqlens

__all__ = ["ANGLE_FIXED_POINT", "KERNELS", "doc_angle_sum", "mamba3_scan", "mamba3_scan_reference", "mamba3_step",
           "rotate_pairs"]

KERNELS = ("auto", "triton", "chunked", "reference")


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"mamba3 {name} must be a tensor of shape {list(shape)}, got "
                         f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")  # fmt: skip


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
    Bm, Cm, b_bias, c_bias, xr = _ranked(x, Bm, Cm, b_bias, c_bias, mimo_x)
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


def _ranked(x, Bm, Cm, b_bias, c_bias, mimo_x):  # noqa: ANN001, ANN202
    """The rank form of either layout: B, C [B,T,R,G,N], biases [H,R,N], the rank inputs x_r [B,T,R,H,P]."""
    if Bm.dim() == 4:
        return Bm[:, :, None], Cm[:, :, None], b_bias[:, None], c_bias[:, None], x[:, :, None]
    return Bm, Cm, b_bias, c_bias, x[:, :, None] * mimo_x.transpose(0, 1).to(x.dtype)


def _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, mimo_x) -> tuple[int, ...]:  # noqa: ANN001
    if x.dim() != 4:
        raise ValueError(f"mamba3 x must be [B,T,H,P], got {list(x.shape)}")
    B, T, H, P = x.shape
    if Bm.dim() not in (4, 5):
        raise ValueError(f"mamba3 Bm must be [B,T,G,N] (SISO) or [B,T,R,G,N] (MIMO), got {list(Bm.shape)}")
    mimo = Bm.dim() == 5
    R = Bm.shape[2] if mimo else 1
    G, N = Bm.shape[-2], Bm.shape[-1]
    if H % G:
        raise ValueError(f"mamba3: the heads H={H} must be a multiple of the groups G={G} (Bm's dim {Bm.dim() - 2})")
    n_a = angles.shape[-1] if angles.dim() == 4 else -1
    ranked = (R,) if mimo else ()
    for name, t, shape in (("dt", dt, (B, T, H)), ("A", A, (H,)), ("Bm", Bm, (B, T, *ranked, G, N)),
                           ("Cm", Cm, (B, T, *ranked, G, N)), ("trap", trap, (B, T, H)),
                           ("angles", angles, (B, T, H, n_a)), ("b_bias", b_bias, (H, *ranked, N)),
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
# 2 pi * 2**36, so int64 holds the sum of 2**63 / (2 pi 2**36) = 21 million tokens of one document
ANGLE_FIXED_POINT = 2.0**36


@torch.library.custom_op("megacpp::doc_angle_sum", mutates_args=())
def doc_angle_sum(inc: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """theta [B,T,...]: the increments inc [B,T,...] summed along T from each document start (start [B,T] bool),
    mod 2 pi, in inc's dtype. The sum runs in int64 fixed point (each increment first taken mod 2 pi): integer
    sums are exact, so a document's angle is its running sum minus the sum before its start with no rounding
    from any other document, and a long document keeps its low bits, where an fp32 sum would lose them (hundreds
    of radians). An opaque op: inductor's Triton codegen fails on this long scan over a middle dim (torch 2.11:
    `list indices must be integers` in SplitScan codegen, at [8,4096,16,32] on the H200)."""
    steps = torch.round(torch.remainder(inc.double(), 2 * math.pi) * ANGLE_FIXED_POINT).to(torch.int64)
    total = torch.cumsum(steps, dim=1)
    own = total - torch.gather(total - steps, 1, _first_of_document(start, steps.shape))
    return torch.remainder(own.double() / ANGLE_FIXED_POINT, 2 * math.pi).to(inc.dtype)


@doc_angle_sum.register_fake
def _(inc, start):  # noqa: ANN001, ANN202
    return inc.new_empty(inc.shape)  # contiguous, as the op returns it


def _first_of_document(start: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The index of each token's document start, [B,T] broadcast to `shape` for a gather along dim 1."""
    T = start.shape[1]
    first = torch.cummax(torch.where(start, torch.arange(T, device=start.device), 0), dim=1).values
    return first.view(*first.shape, *([1] * (len(shape) - 2))).expand(shape)


def _doc_angle_sum_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    """d inc_s = the sum of grad_t over t >= s in s's document (the mods have derivative 1): a suffix sum in fp64,
    less the suffix sum from the next document start. A difference, unlike the forward's integer sums: a later
    document's gradients reach an earlier one's in fp64 rounding (1e-16 relative), never in value."""
    (start,) = ctx.saved_tensors
    g = grad.double()
    T = g.shape[1]
    suffix = torch.flip(torch.cumsum(torch.flip(g, (1,)), dim=1), (1,))  # S_t = sum_{s >= t} g_s
    suffix = torch.cat((suffix, torch.zeros_like(suffix[:, :1])), dim=1)  # S_T = 0
    # the next document start after each token (T past the last one): a reverse running minimum
    starts_after = torch.where(torch.cat((start[:, 1:], torch.ones_like(start[:, :1])), dim=1),
                               torch.arange(1, T + 1, device=g.device), T)  # fmt: skip
    nxt = torch.flip(torch.cummin(torch.flip(starts_after, (1,)), dim=1).values, (1,))
    end = nxt.view(*nxt.shape, *([1] * (g.dim() - 2))).expand(g.shape)
    return (suffix[:, :T] - torch.gather(suffix, 1, end)).to(grad.dtype), None


doc_angle_sum.register_autograd(
    _doc_angle_sum_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[1])
)


def _angles(angles: torch.Tensor, dt: torch.Tensor, start: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """theta [B,T,H,N_a] in the accumulation dtype: the increments pi tanh(angles) dt summed from each document
    start, mod 2 pi (doc_angle_sum)."""
    inc = torch.tanh(angles.to(acc)) * math.pi * dt.to(acc)[..., None]  # [B,T,H,n_a]
    return doc_angle_sum(inc, start)


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
        if cu_seqlens is not None:
            raise ValueError("mamba3: give ctx or cu_seqlens, not both")
        cu_seqlens = ctx.cu_seqlens
    B, T, H, P, G, N, n_a, R = _validate(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, mimo_x)
    if ctx is not None:
        if ctx.shape != (B, T):
            raise ValueError(f"mamba3: ctx is for [B,T] = {ctx.shape}, x is {tuple(x.shape)}")
    elif cu_seqlens is not None:  # bare boundaries: checked here, against the tokens, not the sub-tokens
        check_cu_seqlens(cu_seqlens, B * T, device=x.device, row_len=T)
    if kernel == "reference":
        return mamba3_scan_reference(x, dt, A, Bm, Cm, trap, angles, b_bias, c_bias, D, cu_seqlens, mimo_x=mimo_x)
    mimo = Bm.dim() == 5
    Bm, Cm, b_bias, c_bias, xr = _ranked(x, Bm, Cm, b_bias, c_bias, mimo_x)
    acc = torch.promote_types(x.dtype, torch.float32)
    start = doc_start_mask(cu_seqlens, B, T, x.device)  # [B,T]
    dts, lam = dt.to(acc), torch.sigmoid(trap.to(acc))
    theta = _angles(angles, dt, start, acc)[:, :, None]  # [B,T,1,H,N_a]: shared by the ranks
    per_head = H // G
    k = rotate_pairs(Bm.to(acc).repeat_interleave(per_head, dim=3) + b_bias.transpose(0, 1).to(acc), theta)
    q = rotate_pairs(Cm.to(acc).repeat_interleave(per_head, dim=3) + c_bias.transpose(0, 1).to(acc), theta)
    # delta_next: the next token's previous-input weight, zero where the next token starts a document (or past the row)
    continues = torch.cat((~start[:, 1:], torch.zeros_like(start[:, :1])), dim=1)
    delta_next = torch.cat((((1 - lam) * dts)[:, 1:], torch.zeros_like(dts[:, :1])), dim=1) * continues[..., None]
    gamma = lam * dts
    weight = gamma + delta_next  # [B,T,H]
    # the SSD over T*R sub-tokens (t, r): rank 0 carries the step's decay, the others decay by 1
    sub = lambda t: t.reshape(B, T * R, *t.shape[3:])  # noqa: E731  [B,T,R,...] -> [B,T*R,...]
    dt_sub = torch.cat((dt[:, :, None], torch.zeros_like(dt[:, :, None]).expand(B, T, R - 1, H)), dim=2)
    w_sub = weight[:, :, None].expand(B, T, R, H)
    cu_sub = None if cu_seqlens is None else cu_seqlens * R
    # k and q go to the SSD in fp32 (its dots still take x's dtype): the SSD returns dk and dq in their dtype, and
    # the angles' gradient, dk . dk/dtheta over a pair, cancels: with dk rounded to bf16 it was 8-17% off. y comes
    # back in fp32 too: the correction below takes the next token's weight back out of it, and from a bf16 y that
    # left the next token's dt in this token's output at up to 17 bf16 ulps
    y = ssd_scan(sub(xr), sub(dt_sub), A, sub(k), sub(q), cu_seqlens=cu_sub, chunk=chunk,
                 kernel=kernel, x_weight=sub(w_sub), checked=True, y_fp32=True).view(B, T, R, H, P).to(acc)  # fmt: skip
    # the same step's exact weights: gamma for every rank (the SSD gave w to ranks r <= r' and none to r > r')
    # Products and sums, not einsum: an einsum over R x R per token becomes a batched matmul of [R, N] x [N, R]
    # blocks, one per token and head (half a million 1 x 1 products at R = 1), where inductor fuses these.
    later = torch.ones(R, R, dtype=torch.bool, device=x.device).triu(1)[:, :, None]  # [r', r, 1]: r > r'
    coef = torch.where(later, gamma[:, :, None, None], -delta_next[:, :, None, None])  # [B,T,R',R,H]
    qk = (q[:, :, :, None] * k[:, :, None]).sum(-1)  # [B,T,R',R,H]
    y = y + ((qk * coef)[..., None] * xr.to(acc)[:, :, None]).sum(3)
    if D is not None:
        y = y + D.to(acc)[:, None] * xr.to(acc)
    return (y if mimo else y[:, :, 0]).to(x.dtype)
