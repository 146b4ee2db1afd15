"""Mamba-3's step-loop reference (kernels/mamba3.py): with the trapezoid at 1 and no angles it is Mamba-2's SSD
step loop; over packed rows it equals each document run alone (every state restarts at a document start); it
matches mamba_ssm's own step reference where the peer checkout is beside the repo; bad shapes fail naming the
field. CPU, fp64 and fp32."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from megacpp_lab.kernels import TRITON_INTERPRET
from megacpp_lab.kernels.mamba3 import mamba3_scan, mamba3_scan_reference
from megacpp_lab.kernels.ssd import rank_inputs, ssd_scan_reference
from megacpp_lab.testing import LAUNCHER_PLUMBING, assert_no_leaks, each_document_alone, launcher_operators
from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, packed_cu_seqlens

PEER = Path(__file__).resolve().parents[2] / "shared" / "peers" / "mamba3"


@pytest.fixture
def chunk_pass(monkeypatch):
    """The backward's chunk pass under the interpreter at 16 state columns a sweep step, so N = 32 takes two blocks
    of rotated pairs (the angle and bias gradients cross a block's edge; on a GPU the launcher's own block:
    kernels/ssd.py saw narrow blocks miscompile)."""
    from megacpp_lab.kernels import mamba3 as m3

    if not torch.cuda.is_available():
        monkeypatch.setattr(m3, "M3_BWD_BLOCK_N", 16)
        monkeypatch.setattr(m3, "M3_BWD_REDUCE_BLOCK_N", 16)  # step 1's reductions over N in two blocks too


def _inputs(B=2, T=48, H=4, G=2, P=8, N=16, n_a=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(x=r(B, T, H, P), dt=torch.nn.functional.softplus(r(B, T, H)) * 0.5, A=-torch.rand(H, generator=g, dtype=dtype) - 0.1,
                Bm=r(B, T, G, N) * 0.5, Cm=r(B, T, G, N) * 0.5, trap=r(B, T, H), angles=r(B, T, H, n_a),
                b_bias=r(H, N) * 0.1, c_bias=r(H, N) * 0.1, D=r(H))  # fmt: skip


def _cu(B, T, docs, seed=1):
    return packed_cu_seqlens(B, T, docs, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("docs", [1, 5])
def test_with_the_trapezoid_at_one_and_no_angles_it_is_mamba2s_ssd(docs):
    a = _inputs()
    B, T = a["x"].shape[:2]
    cu = _cu(B, T, docs)
    y3 = mamba3_scan_reference(**{**a, "trap": torch.full_like(a["trap"], 40.0), "angles": torch.zeros_like(a["angles"]),
                                  "b_bias": torch.zeros_like(a["b_bias"]), "c_bias": torch.zeros_like(a["c_bias"]), "D": None},
                               cu_seqlens=cu)  # fmt: skip
    y2 = ssd_scan_reference(a["x"], a["dt"], a["A"], a["Bm"], a["Cm"], cu_seqlens=cu)
    torch.testing.assert_close(y3, y2, atol=1e-12, rtol=1e-10)
    # each change on its own moves the output away from Mamba-2's: the trapezoid, the angles, the biases
    base = {**a, "trap": torch.full_like(a["trap"], 40.0), "angles": torch.zeros_like(a["angles"]),
            "b_bias": torch.zeros_like(a["b_bias"]), "c_bias": torch.zeros_like(a["c_bias"]), "D": None}
    for change in ("trap", "angles", "b_bias"):
        moved = mamba3_scan_reference(**{**base, change: a[change]}, cu_seqlens=cu)
        assert (moved - y2).abs().max() > 1e-3, change


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_rows_equal_each_document_alone(dtype):
    a = _inputs(dtype=dtype)
    B, T = a["x"].shape[:2]
    cu = _cu(B, T, 6)
    doc_ids = doc_ids_from_cu_seqlens(cu, B, T)
    packed = mamba3_scan_reference(**a, cu_seqlens=cu)
    per_token = ("x", "dt", "Bm", "Cm", "trap", "angles")
    fixed = {k: v for k, v in a.items() if k not in per_token}

    def alone(x, dt, Bm, Cm, trap, angles):
        return mamba3_scan_reference(x, dt, a["A"], Bm, Cm, trap, angles, fixed["b_bias"], fixed["c_bias"], fixed["D"])

    ref = each_document_alone(alone, doc_ids, *(a[k] for k in per_token))
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, ref, **tol)  # alone, every state starts at zero: angles and trapezoid too


@pytest.mark.parametrize("docs, chunk", [(1, 16), (6, 8), (6, 64)])
def test_the_chunked_scan_through_ssd_equals_the_step_loop_in_value_and_every_gradient(docs, chunk):
    a = _inputs()
    B, T = a["x"].shape[:2]
    cu = _cu(B, T, docs)
    _chunked_equals_the_step_loop(a, cu, chunk, torch.randn_like(a["x"]))


def _chunked_equals_the_step_loop(a, cu, chunk, dy):
    """The chunked scan against the step loop: the value, and every input's gradient (each one nonzero)."""
    leaves = {k: v.clone().requires_grad_() for k, v in a.items()}
    outs, grads = [], []
    for kernel in ("reference", "chunked"):
        y = mamba3_scan(**leaves, cu_seqlens=cu, chunk=chunk, kernel=kernel)
        outs.append(y.detach())
        grads.append(torch.autograd.grad(y, list(leaves.values()), dy))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-10, rtol=1e-8)
    for name, g_ref, g in zip(leaves, *grads):
        assert g_ref.abs().sum() > 0, name
        torch.testing.assert_close(g, g_ref, atol=1e-9, rtol=1e-7, msg=lambda m, n=name: f"d{n}: {m}")


def test_long_documents_keep_their_angles_in_fp32():
    """Angle sums of hundreds of radians (dt ~ 2, T = 700, 3 documents; the scan sums them in int64 fixed point,
    kernels/mamba3.doc_angle_sum): the fp32 chunked scan against the fp64 step loop on the same values."""
    a = _inputs(B=1, T=700, H=2, G=1, P=4, N=8, n_a=4, dtype=torch.float64, seed=4)
    a["dt"] = a["dt"] * 4 + 1.0
    a["A"] = a["A"] * 0.05  # slow decay: the early tokens' rotations still count late in a document
    cu = torch.tensor([0, 37, 450, 700], dtype=torch.int32)
    ref = mamba3_scan_reference(**a, cu_seqlens=cu)
    got = mamba3_scan(**{k: v.float() for k, v in a.items()}, cu_seqlens=cu, chunk=64, kernel="chunked")
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < 2e-5, rel


@pytest.mark.parametrize("increments", ["small negative", "one-signed, about a radian", "random sign"])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_fp32_angle_sums_keep_their_low_bits_over_a_long_document(increments, path):
    """fp32 increments over one 16384-token document (a second one after it) against an fp64 cumsum mod 2 pi: the
    integer sum keeps the low bits a float sum loses. Its bound holds any integer sum whose steps are at most
    2 pi / 2**32 (the int64 fixed point's are 2**-36 rad; the turns of branch lead/angle-turns 1.5e-9 rad, 1.2e-5
    rad over 16384 tokens at worst) and the fp32 output's own rounding (4.8e-7 at 2 pi). Turns whose fraction was
    taken in fp32 (1 - |t| of a small negative increment keeps 2**-24 of a turn; fp32's 1 / (2 pi) is 4e-8 off)
    drifted 6.6e-4 to 2.9e-3 rad here."""
    from megacpp_lab.kernels import TRITON_INTERPRET
    from megacpp_lab.kernels.mamba3 import doc_angle_sum_torch, doc_angle_sum_triton

    if path == "triton" and not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(12)
    T = 16384 + 512
    inc = {"small negative": torch.full((1, T, 2), -3e-3, dtype=torch.float64),
           "one-signed, about a radian": 0.5 + torch.rand(1, T, 2, generator=g, dtype=torch.float64),
           "random sign": torch.randn(1, T, 2, generator=g, dtype=torch.float64) * 1e-3}[increments].float()  # fmt: skip
    cu = torch.tensor([0, 16384, T], dtype=torch.int32)
    got = (doc_angle_sum_triton if path == "triton" else doc_angle_sum_torch)(inc.to(device), cu.to(device)).cpu()
    want = torch.cat([torch.remainder(torch.cumsum(inc[:, lo:hi].double(), 1), 2 * math.pi)
                      for lo, hi in ((0, 16384), (16384, T))], dim=1)  # fmt: skip
    err = torch.remainder(got.double() - want + math.pi, 2 * math.pi) - math.pi  # the difference on the circle
    assert err.abs().max().item() < 1.3e-5, (increments, err.abs().max().item())


def test_the_document_angle_sum_and_its_gradient_against_a_per_document_loop():
    from megacpp_lab.kernels.mamba3 import doc_angle_sum

    g = torch.Generator().manual_seed(6)
    inc = torch.rand(2, 30, 3, generator=g, dtype=torch.float64).requires_grad_()
    cu = torch.tensor([0, 4, 5, 30, 41, 60], dtype=torch.int32)
    out = doc_angle_sum(inc, cu)
    flat, want = inc.view(60, 3), []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want.append(torch.remainder(torch.cumsum(flat[lo:hi], 0), 2 * math.pi))
    torch.testing.assert_close(out.view(60, 3), torch.cat(want), atol=1e-9, rtol=0)  # fixed point: 1.5e-11 a step
    assert torch.autograd.gradcheck(lambda x: doc_angle_sum(x, cu), (inc,))
    # exactly no dependence across documents, rounding included: another first document, the same others
    other = inc.detach().clone()
    other.view(60, 3)[:4] *= 1e3
    again = doc_angle_sum(other, cu)
    assert torch.equal(again.view(60, 3)[4:], out.detach().view(60, 3)[4:])


def test_bf16_outputs_do_not_carry_the_next_tokens_weight():
    """Token t's SSD input carries the next token's trapezoid weight, taken back out of y afterwards: from a bf16 y
    that left token t+1's dt and trapezoid in y_t at up to 17 bf16 ulps. The SSD's y now comes back in fp32:
    changing token t+1's dt (x20) or trapezoid moves no earlier output by a bf16 ulp."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    B, T, H, G, P, N = 1, 64, 2, 2, 16, 32
    a = dict(x=r(B, T, H, P).bfloat16(), dt=torch.nn.functional.softplus(r(B, T, H)), A=-torch.rand(H, generator=g) * 4 - 0.5,
             Bm=torch.nn.functional.rms_norm(r(B, T, G, N), (N,)).bfloat16(), Cm=torch.nn.functional.rms_norm(r(B, T, G, N), (N,)).bfloat16(),
             trap=r(B, T, H) - 3, angles=r(B, T, H, 4), b_bias=1 + 0.1 * r(H, N), c_bias=1 + 0.1 * r(H, N))  # fmt: skip
    y0 = mamba3_scan(**a, chunk=16, kernel="chunked").float()
    t = 30
    for field, value in (("dt", a["dt"][:, t + 1] * 20), ("trap", torch.full_like(a["trap"][:, t + 1], 8.0))):
        b = {k: v.clone() for k, v in a.items()}
        b[field][:, t + 1] = value
        y1 = mamba3_scan(**b, chunk=16, kernel="chunked").float()
        ulp = y0[:, t].abs().max() * 2**-8
        assert (y1[:, : t + 1] - y0[:, : t + 1]).abs().max() < ulp, field


@pytest.mark.parametrize("B, T, H, G, N, n_a, cu", [
    (1, 40, 2, 1, 16, 2, [0, 17, 40]),  # a document starting inside a chunk; heads sharing one B/C group
    (2, 48, 4, 2, 32, 8, [0, 5, 48, 60, 96]),  # rows of several documents, every row start one
    (1, 64, 2, 2, 32, 16, None),  # every pair rotated; one document a row
    (1, 32, 2, 1, 16, 0, [0, 9, 32]),  # no pair rotated (rope_pairs = 0): empty angle scans
])  # fmt: skip
def test_the_triton_op_equals_the_step_loop_in_value_and_every_gradient_under_the_interpreter(B, T, H, G, N, n_a, cu,
                                                                                              chunk_pass):
    """megacpp::mamba3_scan_fwd/bwd (the SSD's kernels in Mamba-3 mode: the exact same-step weight gamma, no
    correction term) against the fp64-built step loop in fp32, forward and every input's gradient."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = {k: v.float().to(device).requires_grad_() for k, v in _inputs(B=B, T=T, H=H, G=G, P=16, N=N, n_a=n_a).items()}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    dy = torch.randn(B, T, H, 16, generator=torch.Generator().manual_seed(3)).to(device)
    _triton_against_the_step_loop(a, cu_t, dy, tol=2e-5)


def _triton_against_the_step_loop(a, cu, dy, *, tol):
    """The Triton path's y and every gradient against the step loop's on the same leaves a (chunks of 16)."""
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton")
    grads = torch.autograd.grad(y, list(a.values()), dy)
    ref = mamba3_scan_reference(**a, cu_seqlens=cu)
    grads_ref = torch.autograd.grad(ref, list(a.values()), dy)
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    for name, g, g_ref in zip(a, grads, grads_ref):
        assert g.shape == g_ref.shape, name
        if g_ref.numel() == 0:  # no rotated pairs: an empty angles gradient
            continue
        rel = ((g - g_ref).norm() / g_ref.norm()).item()
        assert rel < tol / 2, f"d{name}: relative error {rel:.2e}"


def test_the_op_takes_the_state_passes_order_from_the_context_or_the_boundaries(monkeypatch):
    """The Triton op's state passes start the longest documents first: the op is handed the context's
    longest_first (found once a batch) where a context is given, else varlen.documents_longest_first of the bare
    boundaries (once a scan call; tests/test_ssd.py holds that the kernels read it and that any order gives the same
    bits)."""
    from megacpp_lab.kernels import mamba3 as m3
    from megacpp_lab.varlen import build_context, doc_ids_from_cu_seqlens, documents_longest_first

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = {k: v.float().to(device) for k, v in _inputs(B=2, T=32, H=2, G=2, P=16, N=16).items()}
    cu = torch.tensor([0, 20, 32, 45, 64], dtype=torch.int32)
    seen = []
    real = m3.mamba3_scan_fwd
    monkeypatch.setattr(m3, "mamba3_scan_fwd", lambda *args: seen.append(args[15]) or real(*args))
    ctx = build_context(doc_ids_from_cu_seqlens(cu, 2, 32), cu_seqlens=cu).to(device)
    mamba3_scan(**a, ctx=ctx, chunk=16, kernel="triton")
    assert seen[-1] is ctx.longest_first
    mamba3_scan(**a, cu_seqlens=cu.to(device), chunk=16, kernel="triton")
    assert seen[-1].tolist() == documents_longest_first(cu).tolist() == [0, 3, 2, 1, 4]


@pytest.mark.parametrize("R", [1, 4])
def test_the_chunk_pass_sweep_forms_equal_each_other_bit_for_bit(R, monkeypatch):
    """The chunk pass's step 3 as M3_BWD_ONE_SWEEP's one sweep (dq and dk together, the queries' and keys' angle
    gradients added in registers: fp32 addition commutes) and as two sweeps (the queries', then the keys', the angle
    gradients summed through memory) run the same arithmetic. Under the interpreter every gradient is the same bits,
    SISO and MIMO, with gap slots (documents shorter than a chunk) and two blocks of state columns. On a GPU, ptxas
    may fuse a multiply into an add differently in another kernel: there, within 1e-6."""
    from megacpp_lab.kernels import mamba3 as m3

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(m3, "M3_BWD_BLOCK_N", 16)  # N = 32: the sweeps cross a block's edge
        monkeypatch.setattr(m3, "M3_BWD_REDUCE_BLOCK_N", 16)
    a = {k: v.float().to(device).requires_grad_() for k, v in _inputs(B=2, T=48, H=2, G=1, P=16, N=32, n_a=4).items()}
    cu = torch.tensor([0, 5, 30, 48, 61, 96], dtype=torch.int32, device=device)
    if R > 1:
        g = torch.Generator().manual_seed(7)
        a["Bm"] = torch.randn(2, 48, R, 1, 32, generator=g).to(device).requires_grad_()
        a["Cm"] = torch.randn(2, 48, R, 1, 32, generator=g).to(device).requires_grad_()
        a["b_bias"] = (0.1 * torch.randn(2, R, 32, generator=g)).to(device).requires_grad_()
        a["c_bias"] = (0.1 * torch.randn(2, R, 32, generator=g)).to(device).requires_grad_()
        a["mimo_x"] = (1 + 0.1 * torch.randn(2, R, 16, generator=g)).to(device).requires_grad_()
    grads = {}
    for other in (False, True):
        monkeypatch.setattr(m3, "M3_BWD_ONE_SWEEP", other)
        y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton")
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
        grads[other] = torch.autograd.grad(y, list(a.values()), dy)
    for name, one, two in zip(a, grads[False], grads[True]):
        if device == "cpu":
            assert torch.equal(one, two), f"d{name} differs between the two sweeps and the one sweep"
        else:  # by norm: ddt sums cancelling terms, where an element near zero moves by more than 1e-6 of itself
            assert ((two - one).norm() / one.norm()).item() < 1e-6, f"d{name}: the one sweep against the two"


@pytest.mark.parametrize("R,G", [(1, 2), (4, 2), (1, 1), (4, 1)])
def test_kept_keys_spare_the_backward_its_key_pass_and_change_no_gradient(R, G, monkeypatch):
    """The forward keeps its rotated keys and queries per head for the backward (keeps_keys), saved in place of B and
    C, with a group per head (G == H) and with fewer groups (G < H: dB and dC still B's shape, the heads' parts summed
    over each group): one key pass in a forward and backward, where recomputing them runs two, and every gradient the
    same bits as the recomputing backward's (the same kernels on the same keys). Under an activation-memory budget
    below 1, or keys in another dtype than B's, nothing is kept."""
    from megacpp_lab.kernels import mamba3 as m3

    device = "cuda" if torch.cuda.is_available() else "cpu"
    make = _inputs if R == 1 else functools.partial(_mimo_inputs, R=R)
    a = {k: v.float().to(device).requires_grad_() for k, v in make(B=2, T=32, H=2, G=G, P=16, N=16).items()}
    cu = torch.tensor([0, 20, 32, 45, 64], dtype=torch.int32, device=device)
    passes = []  # the key passes: the forward's (with the angles, _angles_and_keys) and a recomputing backward's
    for name in ("_rotated_keys", "_angles_and_keys"):
        monkeypatch.setattr(m3, name, functools.partial(lambda fn, *args: passes.append(1) or fn(*args),
                                                        getattr(m3, name)))  # fmt: skip

    def grads(keep):
        monkeypatch.setattr(m3, "keeps_keys", lambda x, Bm: keep)
        passes.clear()
        y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton")
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device)
        return torch.autograd.grad(y, list(a.values()), dy), len(passes)

    (kept, n_kept), (recomputed, n_recomputed) = grads(True), grads(False)
    assert (n_kept, n_recomputed) == (1, 2)
    for name, one, two in zip(a, kept, recomputed):
        assert one.shape == a[name].shape, f"d{name}: {tuple(one.shape)} for {tuple(a[name].shape)}"
        assert torch.equal(one, two), f"d{name} differs between kept and recomputed keys"
    monkeypatch.undo()
    x, Bm = a["x"], a["Bm"] if R == 1 else a["Bm"][:, :, 0]
    assert m3.keeps_keys(x, Bm) and m3.keeps_keys(x, Bm[:, :, :1])  # a group per head, and one group for all
    assert not m3.keeps_keys(x, Bm.double())  # the kept keys are in x's dtype: B's gradient must be B's dtype
    with torch._functorch.config.patch(activation_memory_budget=0.5):  # memory asked back: B and C can be recomputed
        assert not m3.keeps_keys(x, Bm)


@pytest.mark.parametrize("R, shared, sum_heads", [(1, False, True), (2, False, True), (1, True, True),
                                                   (1, True, False)])  # fmt: skip
def test_the_backward_launcher_leaves_its_reductions_to_the_autograd_formula(R, shared, sum_heads, monkeypatch):
    """mamba3_scan_bwd's partial sums per chunk (dA, dD, both biases' gradients) share one buffer, which the autograd
    formula sums once outside the op (where inductor fuses the reduction into its consumers), as it sums the shared
    rates' per-head gradients where the angles' backward does not (ANGLE_GRADS_SUM_HEADS off); MIMO's angle
    gradients come out of the kernel summed over a step's ranks. With a group per head (no group sums), SISO or
    MIMO, with rates shared by the heads, the operators the op calls directly are allocations, views and the
    interpreter's copies on a CPU: no reduction (each operator is host work in every M block's backward, and an aten
    reduction inside the op is a kernel inductor cannot fuse)."""
    from megacpp_lab.kernels import mamba3 as m3

    monkeypatch.setattr(m3, "ANGLE_GRADS_SUM_HEADS", sum_heads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    make = _inputs if R == 1 else functools.partial(_mimo_inputs, R=R)
    a = {k: v.float().to(device).requires_grad_() for k, v in make(B=2, T=32, H=2, G=2, P=16, N=16).items()}
    if shared:  # one row of rates a token, a stride-0 head dim (nn/mamba3.py's expand): the op keeps that one row
        leaf = a["angles"][:, :, :1].detach().clone().requires_grad_()
        a["angles"] = leaf.expand(-1, -1, 2, -1)
    cu = torch.tensor([0, 20, 32, 45, 64], dtype=torch.int32, device=device)
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton")
    _, called = launcher_operators(lambda: y.sum().backward(), "megacpp::mamba3_scan_bwd")
    assert [name for name in called if name not in LAUNCHER_PLUMBING] == [], called


@pytest.mark.parametrize("sum_heads", [True, False])
@pytest.mark.parametrize("R, H, shared", [(1, 2, False), (1, 2, True), (1, 1, True), (2, 2, True)])
def test_the_backward_ops_fake_matches_its_real_outputs(R, H, shared, sum_heads, monkeypatch):
    """mamba3_scan_bwd's fake (what a compiled backward is traced with) against the op itself, by
    torch.library.opcheck on the arguments the autograd formula hands it: the per-chunk partial sums [slots, row]
    and d rates (in the rates' shape and dtype; where the heads share the rates and ANGLE_GRADS_SUM_HEADS is off,
    per head in fp32), SISO and MIMO, rates shared or per head, and one head (where shared rates are already per
    head)."""
    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    from megacpp_lab.kernels import mamba3 as m3

    monkeypatch.setattr(m3, "ANGLE_GRADS_SUM_HEADS", sum_heads)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    make = _inputs if R == 1 else functools.partial(_mimo_inputs, R=R)
    a = {k: v.float().to(device).requires_grad_() for k, v in make(B=2, T=32, H=H, G=H, P=16, N=16).items()}
    # the rates in bf16 (the layer's dtype): a fake in the rates' dtype where the op's are fp32 is told apart
    rates = a["angles"].detach()[:, :, :1] if shared else a["angles"].detach()
    a["angles"] = rates.to(torch.bfloat16).requires_grad_().expand(-1, -1, H, -1)
    cu = torch.tensor([0, 20, 32, 45, 64], dtype=torch.int32, device=device)
    calls = []
    real = m3.mamba3_scan_bwd
    monkeypatch.setattr(m3, "mamba3_scan_bwd", lambda *args: calls.append(args) or real(*args))
    mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton").sum().backward()
    (args,) = calls
    outs = real(*args)
    n_a, rates = args[6].shape[-1], args[7]
    per_head = rates.shape[2] == 1 and H > 1 and not sum_heads  # shared rates' rows per head, summed outside
    assert outs[4].shape == (2, 32, H if per_head or rates.shape[2] > 1 else 1, n_a)
    assert outs[4].dtype == (torch.float32 if per_head else rates.dtype)
    assert outs[7].shape == (args[17].shape[0], 2 * H + 2 * H * R * 16)  # a row of partial sums a chunk slot
    torch.library.opcheck(real, args, test_utils=("test_schema", "test_faketensor"))


@triton.jit
def _rank_inputs_probe(x_ptr, xs_ptr, out_ptr, TOTAL, H, P: tl.constexpr, RANK: tl.constexpr, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    hd = tl.program_id(1)
    rp = tl.arange(0, P)
    m = t < TOTAL
    x = rank_inputs(x_ptr, xs_ptr, t, m, hd, H, rp, P, RANK)
    tl.store(out_ptr + (t[:, None] * H + hd) * P + rp[None, :], x, mask=m[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_the_kernels_rank_inputs_are_torchs_bit_for_bit(R, dtype):
    """kernels/ssd.py's rank_inputs (how every Mamba-3 kernel reads x): MIMO's x * mimo_x[r] formed from x [B,T,H,P]
    as the kernels read it, bit for bit torch's x[:, :, None] * mimo_x.transpose(0, 1).to(x.dtype) (the chunked path
    and the step loop's rank inputs), one row a rank sub-token; R = 1 reads x itself."""
    if not torch.cuda.is_available():
        if not TRITON_INTERPRET:
            pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
        if dtype == torch.bfloat16:  # its fp32 -> bf16 casts truncate, where the GPU's (and torch's) round to nearest
            pytest.skip("bf16 rounding needs a CUDA device: the interpreter truncates fp32 -> bf16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    B, T, H, P = 2, 23, 3, 16  # B*T*R sub-tokens never a multiple of the program's 16: its mask is exercised
    x = torch.randn(B, T, H, P, generator=g).to(device, dtype)
    mimo_x = (1 + 0.3 * torch.randn(H, R, P, generator=g)).to(device)
    out = torch.empty(B, T * R, H, P, device=device, dtype=dtype)
    total = B * T * R
    _rank_inputs_probe[(triton.cdiv(total, 16), H)](x, mimo_x, out, total, H, P=P, RANK=R, BT=16)
    want = x[:, :, None] * mimo_x.transpose(0, 1).to(dtype) if R > 1 else x[:, :, None]
    assert torch.equal(out.view(B, T, R, H, P), want)


@pytest.mark.parametrize("kernel", ["chunked", "reference", "triton"])
def test_a_documents_first_angle_rate_has_no_gradient(kernel, chunk_pass):
    """Rotating a whole document changes nothing (q_t . k_s depends on theta_t - theta_s only), and a document's
    first increment rotates all of it: the angles' gradient at every document start is zero, up to rounding,
    on every path (fp32; the bf16 interpreter test checks it with keys stored in bf16). A document's angle
    gradients sum to zero: the property the backward must keep."""
    device = "cuda" if torch.cuda.is_available() and kernel == "triton" else "cpu"
    a = {k: v.float().to(device).requires_grad_() for k, v in _inputs(B=2, T=48, H=2, G=1, P=16, N=16, n_a=4).items()}
    cu = torch.tensor([0, 5, 30, 48, 61, 96], dtype=torch.int32, device=device)
    dy = torch.randn(2, 48, 2, 16, generator=torch.Generator().manual_seed(5)).to(device)
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel=kernel)
    (d_angles,) = torch.autograd.grad(y, [a["angles"]], dy)
    first = d_angles.view(96, 2, 4)[cu[:-1].long()]
    assert first.abs().max() < 1e-5 * d_angles.abs().max(), (first.abs().max(), d_angles.abs().max())


@pytest.mark.parametrize("reverse, dtype", [(False, torch.float32), (False, torch.float64), (True, torch.float32),
                                            (True, torch.float64)])
def test_the_triton_document_scans_equal_their_torch_forms_under_the_interpreter(reverse, dtype):
    """The angle sums (int64 fixed point) and their backward's suffix sums (fp32 and fp64, against the torch form's
    fp64) as Triton scans over token blocks: equal to the torch forms (fp32 angles bit for bit), over documents
    longer than one block of SCAN_BLOCK_T tokens (the carry between blocks), documents of one token, and more
    columns than one block; and with 3 columns and 1 (one block of their power of two: a padded lane, and none)."""
    from megacpp_lab.kernels import TRITON_INTERPRET
    from megacpp_lab.kernels.mamba3 import (doc_angle_sum_torch, doc_angle_sum_triton, doc_suffix_sum_torch,
                                            doc_suffix_sum_triton)  # fmt: skip

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(8)
    B, T = 3, 300
    cu = torch.tensor([0, 1, 2, 140, 300, 301, 600, 630, 899, 900], dtype=torch.int32).to(device)
    for columns in ((3, 13), (1, 3), (1, 1)):  # 39 columns (over one block of SCAN_BLOCK_C), 3 and 1
        v = (torch.randn(B, T, *columns, generator=g, dtype=dtype) * 4).to(device)
        if reverse:  # fp32: a few roundings of a sum of up to 300 terms of |v| ~ 4; a gradient crossing a document
            # boundary, or one term lost, is off by O(1)
            tol = 1e-12 if dtype == torch.float64 else 2e-4
            torch.testing.assert_close(doc_suffix_sum_triton(v, cu), doc_suffix_sum_torch(v, cu), atol=tol, rtol=tol)
        elif dtype == torch.float32:
            assert torch.equal(doc_angle_sum_triton(v, cu), doc_angle_sum_torch(v, cu)), columns
        else:  # the same integer sums; the last fp64 mod 2 pi rounds as each side's division does (5.7e-14 seen)
            torch.testing.assert_close(doc_angle_sum_triton(v, cu), doc_angle_sum_torch(v, cu), atol=1e-12, rtol=0)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_document_scans_carry_across_many_blocks_and_through_blocks_of_many_documents(reverse):
    """The scans run one program per block of SCAN_BLOCK_T tokens and SCAN_BLOCK_C columns: a block's rows before its
    first document boundary take the totals of the blocks back to their document's start (the suffix sum: forward
    to its end), summed SCAN_LOOKBACK blocks a load. A document over more than SCAN_LOOKBACK blocks (several loads
    of totals), a block of one-token documents (a boundary on every row and at its end: every one of the boundaries
    a block loads is needed), documents ending on block edges, a last block cut short and more columns than one
    column block, against the torch forms. The increments stay under 2 pi (the model's are pi tanh(.) dt), where
    the two forms' mods agree (doc_angle_sum's docstring)."""
    from megacpp_lab.kernels import TRITON_INTERPRET
    from megacpp_lab.kernels.mamba3 import (SCAN_BLOCK_C, SCAN_BLOCK_T, SCAN_LOOKBACK, doc_angle_sum_torch,
                                            doc_angle_sum_triton, doc_suffix_sum_torch, doc_suffix_sum_triton)  # fmt: skip

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bt = SCAN_BLOCK_T
    long_doc = (SCAN_LOOKBACK * 2 + 3) * bt + 5  # three loads of totals, ending mid-block
    first = -(-long_doc // bt) + 1  # a whole block of one-token documents, and three more after it
    ones = list(range(first * bt, (first + 1) * bt + 3))
    edge = -(-ones[-1] // bt) * bt + bt  # a document ending on a block edge
    total = edge + 2 * bt + 7  # the row's last block cut short
    cu = torch.tensor([0, long_doc, *ones, edge, edge + bt, total], dtype=torch.int32)
    assert cu.diff().min() > 0
    g = torch.Generator().manual_seed(14)
    v = ((torch.rand(1, total, SCAN_BLOCK_C + 3, generator=g) * 2 - 1) * 3).to(device)
    cu = cu.to(device)
    if reverse:  # fp32 sums of up to ~2300 terms of |v| < 3 in another order than torch's fp64
        torch.testing.assert_close(doc_suffix_sum_triton(v, cu), doc_suffix_sum_torch(v, cu), atol=2e-3, rtol=1e-5)
    else:
        assert torch.equal(doc_angle_sum_triton(v, cu), doc_angle_sum_torch(v, cu))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy casts NaN
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_angle_sums_are_nan_exactly_at_a_non_finite_increment(dtype):
    """The sums run in int64 fixed point, where a NaN or infinite increment becomes an arbitrary integer (0 on a
    GPU, INT64_MIN in the torch twin): its angle came out finite, a silent wrong number. Bad input fails closed: the
    angle is NaN exactly where the increment is not finite (NaN, +inf, -inf); every angle before it in its document,
    in its token's other columns and in the other documents is the clean input's, bit for bit; the Triton scan and
    the torch twin agree there and on where the NaNs are. Past the bad token, in its document and column, the
    integer sum's value is left as it falls (the keys at the bad token are NaN, so the scan's output is NaN from
    there on): not compared. Documents over more than one block of SCAN_BLOCK_T tokens (the carry)."""
    from megacpp_lab.kernels.mamba3 import doc_angle_sum_torch, doc_angle_sum_triton

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(30)
    B, T, C = 2, 150, 3
    cu = torch.tensor([0, 20, 150, 151, 230, 300], dtype=torch.int32)
    clean = (torch.rand(B, T, C, generator=g, dtype=dtype) * 2 - 1) * 3
    inc = clean.clone()
    bad = [(0, 7, 1, math.nan), (0, 100, 2, math.inf), (1, 50, 0, -math.inf)]  # documents [0,20), [20,150), [151,230)
    for b, t, c, value in bad:
        inc[b, t, c] = value
    # the positions whose angle the fix defines: all but those past a bad token in its document and column
    defined = torch.ones(B * T, C, dtype=torch.bool)
    for b, t, c, _ in bad:
        s = b * T + t
        end = cu[cu > s].min().item()
        defined[s + 1 : end, c] = False
    defined = defined.view(B, T, C)
    cu = cu.to(device)
    ok = defined & torch.isfinite(inc)
    outs = []
    for fn in (doc_angle_sum_triton, doc_angle_sum_torch):
        out = fn(inc.to(device), cu).cpu()
        assert torch.equal(torch.isnan(out), ~torch.isfinite(inc)), fn.__name__
        assert torch.isfinite(out[~torch.isnan(out)]).all(), fn.__name__
        assert torch.equal(out[ok], fn(clean.to(device), cu).cpu()[ok]), fn.__name__
        outs.append(out)
    tri, twin = outs
    if dtype == torch.float32:
        assert torch.equal(tri[ok], twin[ok])
    else:  # the final mod's last fp64 bit (doc_angle_sum's docstring)
        torch.testing.assert_close(tri[ok], twin[ok], atol=1e-12, rtol=0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy casts NaN
@pytest.mark.parametrize("kernel", ["triton", "chunked"])
def test_a_nan_angle_makes_the_output_nan_from_its_token_to_its_documents_end(kernel):
    """A NaN angle rate at one token and head: in the step loop theta is NaN from there to the document's end (the
    sum carries it), so are that head's keys, state and output, and nothing else is. The Triton and chunked paths
    are NaN there too (before the fix their int64 angle sums made the NaN token's angle finite: a silent wrong
    number). Their SSD spreads a NaN further, never silently: C B^T is multiplied by the causal decay mask, whose 0
    times a NaN key is NaN at the chunk's earlier tokens (Triton: its chunks hold one document's tokens); the
    chunked torch form's chunks cross documents and its state passes a document start by a decay of
    exp(-inf) = 0, so that head's row from the token's chunk on (here the whole row). Everywhere else the output is
    the clean input's, bit for bit."""
    if kernel == "triton" and not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() and kernel == "triton" else "cpu"
    a = {k: v.float().to(device) for k, v in _inputs(B=2, T=48, H=2, G=1, P=16, N=16, n_a=4).items()}
    cu = torch.tensor([0, 5, 30, 48, 61, 96], dtype=torch.int32, device=device)
    clean = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel=kernel).cpu()
    a["angles"][0, 12, 1, 2] = math.nan  # document [5, 30) of row 0, head 1
    ref = mamba3_scan(**a, cu_seqlens=cu, kernel="reference").cpu()
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel=kernel).cpu()
    expect = torch.zeros_like(y, dtype=torch.bool)
    expect[0, 12:30, 1] = True
    assert torch.equal(torch.isnan(ref), expect)
    assert torch.isnan(y[expect]).all()
    reach = torch.zeros_like(expect)  # where the path's SSD may spread it (docstring)
    if kernel == "triton":
        reach[0, 5:30, 1] = True
    else:
        reach[0, :, 1] = True
    assert not torch.isnan(y[~reach]).any()
    assert torch.equal(y[~reach], clean[~reach])


@pytest.mark.parametrize("R, H, n_a, heads, shared, sum_heads", [
    (1, 2, 4, 1, False, True), (2, 2, 4, 1, False, True), (1, 4, 3, 1, False, True), (2, 2, 4, 2, False, True),
    (1, 4, 3, 4, False, True), (1, 4, 3, 1, True, True), (2, 2, 4, 1, True, True), (2, 2, 4, 2, True, True),
    (1, 4, 3, 1, True, False), (2, 2, 4, 2, True, False)])  # fmt: skip
def test_the_angles_backward_carries_across_more_chunks_than_a_load_holds(R, H, n_a, heads, shared, sum_heads,
                                                                          monkeypatch):  # fmt: skip
    """The Triton op's angle gradients (the chunk pass's per-chunk sums of dth, each chunk's suffix sums plus its
    document's later chunks' sums, LOOKBACK chunks a load, then through pi tanh(rate) dt) against the chunked torch
    path's (doc_angle_sum's autograd): the angle rates' gradient and dt's, with a document of more than LOOKBACK + 1
    chunks (the carry takes two loads), one shorter than a chunk, and one ending mid-chunk; SISO and MIMO (a
    step's rank sub-tokens in one chunk, dt's part at its rank-0 sub-token); one head a program (the default) and
    several (ANGLE_GRADS_HEADS), with n_a under its power of two (a program's padded lanes between heads); the rates
    per head, or one row a token expanded over the heads as the layer gives them (the op then keeps that one row,
    _rates, and the heads' gradients are summed in the angles' backward, ANGLE_GRADS_SUM_HEADS, or after it)."""
    from megacpp_lab.kernels import mamba3 as m3

    monkeypatch.setattr(m3, "ANGLE_GRADS_HEADS", heads)
    monkeypatch.setattr(m3, "ANGLE_GRADS_SUM_HEADS", sum_heads)

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunk = 16
    T = (m3.SCAN_LOOKBACK + 3) * chunk // R + 20  # the long document's chunks: more than LOOKBACK + 1
    make = _inputs if R == 1 else functools.partial(_mimo_inputs, R=R)
    a = {k: v.float().to(device).requires_grad_() for k, v in make(B=1, T=T, H=H, G=1, P=16, N=16, n_a=n_a).items()}
    leaf = a["angles"]
    if shared:  # one row a token, a stride-0 head dim (nn/mamba3.py's expand)
        leaf = a["angles"][:, :, :1].detach().clone().requires_grad_()
        a["angles"] = leaf.expand(-1, -1, H, -1)
        assert m3._rates(a["angles"]).shape[2] == 1
    cu = torch.tensor([0, 3, T - 9, T], dtype=torch.int32, device=device)
    assert (T - 12) * R // chunk > m3.SCAN_LOOKBACK + 1
    dy = torch.randn(a["x"].shape[:2] + ((R,) if R > 1 else ()) + a["x"].shape[2:],
                     generator=torch.Generator().manual_seed(5)).to(device)  # fmt: skip
    leaves = [leaf, a["dt"]]
    got = torch.autograd.grad(mamba3_scan(**a, cu_seqlens=cu, chunk=chunk, kernel="triton"), leaves, dy)
    want = torch.autograd.grad(mamba3_scan(**a, cu_seqlens=cu, chunk=chunk, kernel="chunked"), leaves, dy)
    for name, g, w in zip(("angles", "dt"), got, want):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 1e-5, f"d{name}: relative error {rel:.2e}"


@pytest.mark.parametrize("kernel", ["reference", "chunked", "triton"])
def test_rates_shared_by_the_heads_equal_the_same_rates_per_head(kernel):
    """angles [B,T,1,n_a] (the layer's: one row a token for every head) against the same values copied per head
    [B,T,H,n_a]: the same y, and the shared rates' gradient the per-head gradients summed over the heads; SISO, on
    packed rows."""
    if kernel == "triton" and not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    a = {k: v.float().to(device) for k, v in _inputs(B=2, T=40, H=4, G=2, P=16, N=16, n_a=3).items()}
    shared = a["angles"][:, :, :1].clone().requires_grad_()
    per_head = shared.detach().expand(-1, -1, 4, -1).clone().requires_grad_()
    cu = torch.tensor([0, 9, 40, 51, 80], dtype=torch.int32, device=device)
    dy = torch.randn(a["x"].shape, generator=torch.Generator().manual_seed(2)).to(device)
    outs = []
    for rates in (shared, per_head):
        y = mamba3_scan(**{**a, "angles": rates}, cu_seqlens=cu, chunk=16, kernel=kernel)
        outs.append((y, *torch.autograd.grad(y, [rates], dy)))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[0][1], outs[1][1].sum(2, keepdim=True), rtol=1e-5, atol=1e-6)


def test_the_angles_backward_refuses_heads_a_program_off_a_power_of_two(monkeypatch):
    """ANGLE_GRADS_HEADS sizes a program's lanes (its heads times n_a's power of two): 3 with H = 6 would give a lane
    count off a power of two, which fails to compile; the backward names the constant instead."""
    from megacpp_lab.kernels import mamba3 as m3

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(m3, "ANGLE_GRADS_HEADS", 3)
    a = {k: v.float().to(device).requires_grad_() for k, v in _inputs(B=1, T=16, H=6, G=1, P=16, N=16, n_a=4).items()}
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton")
    with pytest.raises(ValueError, match="ANGLE_GRADS_HEADS=3 must be a power of two"):
        y.sum().backward()


@pytest.mark.parametrize("name, width", [("M3_BWD_BLOCK_N", 24), ("M3_BWD_REDUCE_BLOCK_N", 8),
                                         ("M3_BWD_REDUCE_BLOCK_N", 48)])
def test_the_chunk_pass_refuses_a_block_of_state_columns_off_a_power_of_two(name, width, monkeypatch):
    """The chunk pass's widths of a block of state columns (step 3's, and step 1's reductions over N) are a dot's
    operand: a width under 16 or off a power of two fails in Triton's compiler, or leaves columns of N out; the
    backward names the constant instead."""
    from megacpp_lab.kernels import mamba3 as m3

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(m3, name, width)
    a = {k: v.float().to(device).requires_grad_() for k, v in _inputs(B=1, T=16, H=2, G=1, P=16, N=16, n_a=4).items()}
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton")
    with pytest.raises(ValueError, match=f"{name}={width} must be a power of two >= 16"):
        y.sum().backward()


def test_mimos_rank_scale_gets_its_gradient_whichever_other_inputs_ask_for_one():
    """The op's backward reads which inputs want a gradient by their position: mimo_x alone asking (no skip D, every
    other input fixed) still gets its gradient, equal to the chunked torch path's (the op's inputs once shifted by
    one, and mimo_x's flag then read D's: with D None its gradient came back None)."""
    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = {k: v.float().to(device) for k, v in _mimo_inputs(R=2, B=1, T=32, H=2, G=1, P=16, N=16).items()}
    a["D"] = None
    a["mimo_x"].requires_grad_()
    cu = torch.tensor([0, 11, 32], dtype=torch.int32, device=device)
    dy = torch.randn(1, 32, 2, 2, 16, generator=torch.Generator().manual_seed(4)).to(device)
    (got,) = torch.autograd.grad(mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="triton"), [a["mimo_x"]], dy)
    (want,) = torch.autograd.grad(mamba3_scan(**a, cu_seqlens=cu, chunk=16, kernel="chunked"), [a["mimo_x"]], dy)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("R, H, G, n_a", [(1, 4, 2, 3), (2, 2, 2, 4), (1, 2, 1, 0), (1, 8, 1, 4)])
def test_the_forwards_angle_and_key_pass_equals_the_angle_sums_then_the_key_pass(R, H, G, n_a):
    """The forward's _angles_and_keys (the angle sums' block totals, then their second pass and the rotation of the
    keys and queries in one kernel) against doc_angle_sum_triton's angles and the key pass on them (_rotated_keys,
    the backward's when it recomputes the keys): bit for bit, with documents over several blocks of SCAN_BLOCK_T
    steps and ending mid-block, a last block cut short, groups of two heads, n_a under its power of two (a padded
    lane), MIMO's sub-tokens, no rotated pairs (n_a = 0: the keys only biased), and one group of eight heads."""
    from megacpp_lab.kernels import mamba3 as m3

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(21)
    B, T, N = 2, m3.SCAN_BLOCK_T + 37, 16
    cu = torch.tensor([0, 5, m3.SCAN_BLOCK_T + 20, T, T + 1, 2 * T], dtype=torch.int32).to(device)
    inc = ((torch.rand(B, T, H, n_a, generator=g) * 2 - 1) * 3).to(device)
    Bm, Cm = (torch.randn(B, T * R, G, N, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))
    b_bias, c_bias = (torch.randn(H, R, N, generator=g).to(device) for _ in range(2))
    theta, k, q = m3._angles_and_keys(inc, cu, Bm, Cm, b_bias, c_bias, H, R, torch.bfloat16)
    want = m3.doc_angle_sum_triton(inc, cu)
    assert torch.equal(theta, want)
    k_want, q_want = m3._rotated_keys(Bm, Cm, want, b_bias, c_bias, H, R, torch.bfloat16)
    assert torch.equal(k, k_want) and torch.equal(q, q_want)
    # against the torch rotation in fp32 (bf16 keys: within their rounding); with n_a = 0 the keys only biased
    for got, v, bias in ((k, Bm, b_bias), (q, Cm, c_bias)):
        torch_form = m3._keys(v.view(B, T, R, G, N), bias, want[:, :, None], H).reshape(B, T * R, H, N)
        torch.testing.assert_close(got.float(), torch_form, atol=0.05, rtol=0.02)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's dots are fp32: this isolates the gradients' storage")
@pytest.mark.parametrize("T, docs", [(128, 2), (256, 1)])
def test_bf16_inputs_hold_every_gradient_within_the_keys_rounding_under_the_interpreter(T, docs, chunk_pass):
    """bf16 x, B and C through the Triton op, whose rotated keys and queries are stored in bf16 (as mamba_ssm
    stores them) and whose dk and dq come back from the SSD kernels in fp32. Against the fp32 chunked scan every
    gradient holds within bf16's rounding (1e-2), the angles' included, and a document's first angle rate keeps a
    zero gradient (a whole document's rotation changes nothing). Both need the angles' gradient taken against the
    keys as stored: against the unrounded keys a document's angle gradients stopped summing to zero, and the
    angles' gradient was 4% off here at T = 128 and 12% at T = 256 (one document)."""
    from megacpp_lab.bench.mamba3 import GRADS, Mamba3Shape, make_inputs

    s = Mamba3Shape(B=1, T=T, H=2, N=32, P=16, G=2, docs=docs, chunk=32, rope_pairs=8)
    a, cu = make_inputs(s, torch.bfloat16, "cpu")
    dy = torch.randn(a["x"].shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=s.chunk, kernel="triton")
    grads = dict(zip(GRADS, torch.autograd.grad(y, [a[n] for n in GRADS], dy)))
    leaves = {k: v.detach().float().requires_grad_() for k, v in a.items()}
    ref = mamba3_scan(**leaves, cu_seqlens=cu, chunk=s.chunk, kernel="chunked")
    want = dict(zip(GRADS, torch.autograd.grad(ref, [leaves[n] for n in GRADS], dy.float())))
    for name in GRADS:
        rel = ((grads[name].float() - want[name]).norm() / want[name].norm()).item()
        assert rel < 1e-2, f"d{name}: relative error {rel:.2e}"
    d_angles = grads["angles"].float().view(T, -1, 8)  # [T, 1, pairs]: the rates shared by the heads
    assert d_angles[cu[:-1].long()].abs().max() < 1e-4 * d_angles.abs().max()


@pytest.mark.parametrize("kernel", ["reference", "chunked"])
def test_the_scan_as_a_mixer_passes_the_leak_harness_on_packed_rows(kernel):
    """Every input of the scan (x, dt, the trapezoid, the angles, B, C) is a fixed random projection of the mixer's
    input, so a token of one document reaching another through any of them (the trapezoid's previous term, the
    angles' sum, the state) is a leak, and so is a token reaching an earlier one."""
    H, G, P, N, n_a, C = 2, 1, 4, 8, 2, 16
    g = torch.Generator().manual_seed(3)
    widths = dict(x=H * P, dt=H, trap=H, angles=H * n_a, Bm=G * N, Cm=G * N)
    proj = {k: torch.randn(C, w, generator=g, dtype=torch.float64) / C**0.5 for k, w in widths.items()}
    fixed = dict(A=-torch.rand(H, generator=g, dtype=torch.float64) - 0.1, b_bias=torch.randn(H, N, generator=g, dtype=torch.float64) * 0.1,
                 c_bias=torch.randn(H, N, generator=g, dtype=torch.float64) * 0.1, D=torch.randn(H, generator=g, dtype=torch.float64))  # fmt: skip

    def mixer(x, doc_ids):
        B, T, _ = x.shape
        p = {k: x @ w for k, w in proj.items()}
        y = mamba3_scan(p["x"].view(B, T, H, P), torch.nn.functional.softplus(p["dt"]), fixed["A"], p["Bm"].view(B, T, G, N),
                        p["Cm"].view(B, T, G, N), p["trap"], p["angles"].view(B, T, H, n_a), fixed["b_bias"], fixed["c_bias"],
                        fixed["D"], ctx=build_context(doc_ids), chunk=8, kernel=kernel)  # fmt: skip
        return y.reshape(B, T, H * P)

    cu = _cu(2, 40, 4, seed=5)
    x = torch.randn(2, 40, C, generator=g, dtype=torch.float64)
    report = assert_no_leaks(mixer, x, doc_ids_from_cu_seqlens(cu, 2, 40))
    assert report.passed and not report.vacuous


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_chunked_scan_compiles_in_one_graph_and_other_document_counts_add_none():
    from megacpp_lab.model.parallelize import compile_stats

    a = _inputs(dtype=torch.float32)
    B, T = a["x"].shape[:2]
    compiled = torch.compile(lambda ctx: mamba3_scan(**a, ctx=ctx, chunk=16, kernel="chunked"), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    for docs in (3, 1, 2, 7):
        cu = _cu(B, T, docs, seed=docs)
        ctx = build_context(doc_ids_from_cu_seqlens(cu, B, T))
        torch.testing.assert_close(compiled(ctx), mamba3_scan_reference(**a, cu_seqlens=cu), atol=1e-4, rtol=1e-4)
    stats = compile_stats()
    assert stats.graphs == 1 and stats.graph_breaks == 0, stats


def test_with_the_batchs_context_the_scan_reads_its_document_starts_and_builds_no_mask():
    """Given the batch's PackedContext, the Triton path (the GPU's) takes the document starts from it (built once a
    batch) and traces no mask of its own: no zeros-and-index_put per M block (two launches each in every step). Bare
    cu_seqlens still build it, and both give the same output."""
    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = {k: v.float().to(device) for k, v in _inputs(B=2, T=48, H=2, G=1, P=16, N=16).items()}
    B, T = a["x"].shape[:2]
    cu = _cu(B, T, 3, seed=3)
    ctx = build_context(doc_ids_from_cu_seqlens(cu, B, T)).to(device)
    cu = cu.to(device)
    graphs = []

    def record(gm, _inputs):  # noqa: ANN001, ANN202
        graphs.append(gm.code)
        return gm.forward

    with_ctx = torch.compile(lambda c: mamba3_scan(**a, ctx=c, chunk=16, kernel="triton"), backend=record,
                             fullgraph=True)(ctx)  # fmt: skip
    bare = torch.compile(lambda c: mamba3_scan(**a, cu_seqlens=c, chunk=16, kernel="triton"), backend=record,
                         fullgraph=True)(cu)  # fmt: skip
    assert "setitem" not in graphs[0] and "setitem" in graphs[1]  # reset[cu_seqlens] = True: the mask's index_put
    torch.testing.assert_close(with_ctx, bare, atol=0, rtol=0)


@pytest.mark.skipif(not (PEER.is_dir() and importlib.util.find_spec("einops")),
                    reason="the mamba_ssm peer checkout (../shared/peers/mamba3) and einops are not here")  # fmt: skip
def test_matches_mamba_ssms_step_reference_per_document(monkeypatch):
    monkeypatch.syspath_prepend(str(PEER / "tests" / "ops" / "triton"))
    monkeypatch.syspath_prepend(str(PEER))
    peer = pytest.importorskip("test_mamba3_siso")
    a = _inputs(B=1, T=40, dtype=torch.float64)
    ours = mamba3_scan_reference(**a)
    # the peer's layout: Q, K [B,T,G,N], V [B,T,H,P], ADT / DT / Trap [B,H,T], angle rates [B,T,H,N_a]
    theirs, _ = peer.mamba3_siso_step_ref(a["Cm"], a["Bm"], a["x"], (a["dt"] * a["A"]).transpose(1, 2),
                                          a["dt"].transpose(1, 2), a["trap"].transpose(1, 2), a["c_bias"],
                                          a["b_bias"], a["angles"], D=a["D"])  # fmt: skip
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-10, rtol=1e-8)
    sys.modules.pop("test_mamba3_siso", None)


@pytest.mark.parametrize("kernel", ["reference", "chunked", "triton"])
def test_bad_dtypes_contexts_and_empty_batches_fail_naming_the_field(kernel):
    """An integer or bool x once came back as an integer y (the step loop truncating, the Triton path 6 off), a
    complex one as a bare KeyError; a ctx that is no PackedContext and an empty batch failed deep inside torch.
    Every path refuses them first, naming the field."""
    if kernel == "triton" and not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    a = {k: v.float() for k, v in _inputs(P=16).items()}
    call = lambda **k: mamba3_scan(**{**a, **k}, kernel=kernel, chunk=16)  # noqa: E731
    for field in ("x", "dt", "A", "Bm", "angles", "D"):
        for dtype in (torch.int64, torch.bool):
            with pytest.raises(ValueError, match=rf"mamba3 {field} must be float32, .*got {dtype}"):
                call(**{field: a[field].to(dtype)})
    with pytest.raises(ValueError, match=r"mamba3 x must be float32, .*got torch.complex64"):
        call(x=a["x"].to(torch.complex64))
    with pytest.raises(ValueError, match=r"mamba3 x must be a tensor \[B,T,H,P\], got list"):
        call(x=a["x"].tolist())
    with pytest.raises(TypeError, match=r"ctx must be a PackedContext .*got str"):
        call(ctx="rows")
    empty = {k: v[:, :0] for k, v in a.items() if k not in ("A", "b_bias", "c_bias", "D")}
    with pytest.raises(ValueError, match=r"mamba3 x must hold tokens, got \[B,T,H,P\] = \[2, 0, 4, 16\]"):
        call(**empty)


@pytest.mark.parametrize("field, change, message", [
    ("dt", lambda a: a["dt"][:, :-1], r"mamba3 dt must be a tensor of shape \[2, 48, 4\]"),
    ("b_bias", lambda a: a["b_bias"][:-1], r"mamba3 b_bias must be a tensor of shape \[4, 16\]"),
    ("angles", lambda a: torch.zeros(2, 48, 4, 9, dtype=torch.float64), r"at most N/2 = 8 rotated pairs"),
    ("Bm", lambda a: torch.zeros(2, 48, 3, 16, dtype=torch.float64), r"H=4 must be a multiple of the groups G=3"),
])  # fmt: skip
def test_bad_shapes_fail_naming_the_field(field, change, message):
    a = _inputs()
    extra = {"Cm": torch.zeros(2, 48, 3, 16, dtype=torch.float64)} if field == "Bm" else {}
    with pytest.raises(ValueError, match=message):
        mamba3_scan_reference(**{**a, field: change(a), **extra})


# ----------------------------------------------------------------------------- MIMO


def _mimo_inputs(R=2, B=2, T=48, H=4, G=2, P=8, N=16, n_a=4, dtype=torch.float64, seed=0):
    a = _inputs(B=B, T=T, H=H, G=G, P=P, N=N, n_a=n_a, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return {**a, "Bm": r(B, T, R, G, N) * 0.5, "Cm": r(B, T, R, G, N) * 0.5, "b_bias": r(H, R, N) * 0.1,
            "c_bias": r(H, R, N) * 0.1, "mimo_x": 1 + 0.3 * r(H, R, P)}  # fmt: skip


@pytest.mark.parametrize("kernel", ["reference", "chunked", "triton"])
def test_mimo_at_rank_one_is_siso(kernel):
    """Rank 1 is SISO on the scaled input x * mimo_x[:, 0], on every path (the Triton one once refused rank-1
    MIMO: its kernels take a rank scale for R > 1 only). The scale is random and positive, not ones: at ones any
    use of mimo_x with f(1) = 1 (mimo_x**3, or ignoring it) would give the same numbers."""
    triton_path = kernel == "triton"
    if triton_path and not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    P, chunk, dtype = (16, 16, torch.float32) if triton_path else (8, 8, torch.float64)  # tl.dot tiles: 16 and up
    device = "cuda" if triton_path and torch.cuda.is_available() else "cpu"
    a = {k: v.to(device, dtype) for k, v in _inputs(P=P).items()}
    cu = _cu(2, 48, 4).to(device)
    mimo_x = (0.5 + torch.rand(4, 1, P, generator=torch.Generator().manual_seed(7), dtype=dtype)).to(device)
    siso = mamba3_scan(**{**a, "x": a["x"] * mimo_x[:, 0]}, cu_seqlens=cu, kernel=kernel, chunk=chunk)
    mimo = mamba3_scan(**{**a, "Bm": a["Bm"][:, :, None], "Cm": a["Cm"][:, :, None], "b_bias": a["b_bias"][:, None],
                          "c_bias": a["c_bias"][:, None]}, mimo_x=mimo_x,
                       cu_seqlens=cu, kernel=kernel, chunk=chunk)  # fmt: skip
    assert mimo.shape == (2, 48, 1, 4, P)
    tol = dict(atol=1e-5, rtol=1e-5) if triton_path else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(mimo[:, :, 0], siso, **tol)


def test_mimo_shares_one_state_across_ranks_as_mamba2s_ssd_summed_over_input_ranks():
    """With the trapezoid at 1, no angles and no biases, MIMO's rank r' output is sum_r SSD(x_r, k_r, q_r') (the
    SSD is linear in its inputs): an oracle built from Mamba-2's step loop alone. A per-rank state would give only
    the r = r' term, which differs."""
    a = _mimo_inputs(R=3)
    cu = _cu(2, 48, 3)
    plain = {**a, "trap": torch.full_like(a["trap"], 40.0), "angles": torch.zeros_like(a["angles"]),
             "b_bias": torch.zeros_like(a["b_bias"]), "c_bias": torch.zeros_like(a["c_bias"]), "D": None}
    y = mamba3_scan_reference(**{k: v for k, v in plain.items() if k != "mimo_x"}, cu_seqlens=cu, mimo_x=a["mimo_x"])
    xr = a["x"][:, :, None] * a["mimo_x"].transpose(0, 1)
    want = torch.stack([sum(ssd_scan_reference(xr[:, :, r], a["dt"], a["A"], a["Bm"][:, :, r], a["Cm"][:, :, rq], cu)
                            for r in range(3)) for rq in range(3)], dim=2)  # fmt: skip
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-10)
    own_rank_only = torch.stack([ssd_scan_reference(xr[:, :, r], a["dt"], a["A"], a["Bm"][:, :, r], a["Cm"][:, :, r], cu)
                                 for r in range(3)], dim=2)  # fmt: skip
    assert (y - own_rank_only).abs().max() > 1e-3


@pytest.mark.parametrize("R, docs, chunk", [(2, 1, 16), (2, 6, 8), (4, 6, 16), (4, 3, 64)])
def test_mimo_chunked_equals_the_step_loop_in_value_and_every_gradient(R, docs, chunk):
    a = _mimo_inputs(R=R)
    cu = _cu(2, 48, docs, seed=docs)
    _chunked_equals_the_step_loop(a, cu, chunk, torch.randn(2, 48, R, 4, 8, dtype=torch.float64))


def test_mimo_packed_rows_equal_each_document_alone():
    a = _mimo_inputs(R=2)
    cu = _cu(2, 48, 5)
    doc_ids = doc_ids_from_cu_seqlens(cu, 2, 48)
    packed = mamba3_scan_reference(**a, cu_seqlens=cu)
    per_token = ("x", "dt", "Bm", "Cm", "trap", "angles")

    def alone(x, dt, Bm, Cm, trap, angles):
        y = mamba3_scan_reference(x, dt, a["A"], Bm, Cm, trap, angles, a["b_bias"], a["c_bias"], a["D"], mimo_x=a["mimo_x"])
        return y.flatten(2)

    ref = each_document_alone(alone, doc_ids, *(a[k] for k in per_token))
    torch.testing.assert_close(packed.flatten(2), ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("R", [2, 4])
def test_mimo_triton_path_equals_the_step_loop_under_the_interpreter(R, chunk_pass):
    """Forward and every gradient of the Triton op over rank sub-tokens (fp32, 16-wide chunks: 16 / R steps): a
    step's ranks see each other in the kernels, with the exact same-step weight."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = {k: v.to(device).requires_grad_() for k, v in _mimo_inputs(R=R, B=1, T=24, H=2, G=1, P=16, N=16, n_a=2,
                                                                     dtype=torch.float32).items()}  # fmt: skip
    cu = torch.tensor([0, 7, 24], dtype=torch.int32, device=device)
    dy = torch.randn(1, 24, R, 2, 16, generator=torch.Generator().manual_seed(9)).to(device)
    _triton_against_the_step_loop(a, cu, dy, tol=2e-5)


@pytest.mark.parametrize("change, message", [
    (lambda a: {"mimo_x": None}, r"MIMO \(Bm \[B,T,R,G,N\]\) needs the rank inputs' scale mimo_x \[H,R,P\]"),
    (lambda a: {"mimo_x": a["mimo_x"][:, :1]}, r"mamba3 mimo_x must be a tensor of shape \[4, 2, 8\]"),
    (lambda a: {"c_bias": a["c_bias"][:, 0]}, r"mamba3 c_bias must be a tensor of shape \[4, 2, 16\]"),
    (lambda a: {"Cm": a["Cm"][:, :, 0]}, r"mamba3 Cm must be a tensor of shape \[2, 48, 2, 2, 16\]"),
])  # fmt: skip
def test_mimo_bad_shapes_fail_naming_the_field(change, message):
    a = _mimo_inputs(R=2)
    with pytest.raises(ValueError, match=message):
        mamba3_scan(**{**a, **change(a)}, kernel="chunked")


def test_siso_refuses_mimo_x():
    with pytest.raises(ValueError, match=r"SISO's Bm \[B,T,G,N\] takes none"):
        mamba3_scan(**_inputs(), mimo_x=torch.ones(4, 1, 8, dtype=torch.float64), kernel="chunked")


@pytest.mark.cuda
@pytest.mark.parametrize("shape, rank", [("main", 1), ("main", 2), ("main", 4), ("H=32", 1)])
def test_the_triton_path_on_gpu_at_a_real_shape_bf16(shape, rank, chunk_pass):
    """The bench's layouts at real shapes (B=2, T=4096, P=64, N=128, 8 documents a row; H=16 in 16 groups, and
    H=32 in one group, whose dB and dC sum 32 heads' parts), bf16 inputs, the Triton op: y and every gradient
    against the chunked scan in fp32 on the same values, within bf16's rounding.
    The angles' gradient is looser (3e-2): it sums a document's later tokens, whose bf16 dots round alike (the
    H100 measured 0.010 at rank 1, 0.011 at 2 and 0.016 at 4 at 50324e9; 0.084 before the angles' gradient was
    taken against the keys as stored)."""
    from dataclasses import replace

    from megacpp_lab.bench.mamba3 import FULL_SHAPES, GRADS, make_inputs

    s = replace(FULL_SHAPES[shape], B=2)
    a, cu = make_inputs(s, torch.bfloat16, "cuda", rank=rank)
    names = (*GRADS, "mimo_x") if rank > 1 else GRADS
    dy = torch.randn(a["x"].shape if rank == 1 else (2, s.T, rank, s.H, s.P), generator=torch.Generator().manual_seed(2))
    dy = dy.to("cuda", torch.bfloat16)
    y = mamba3_scan(**a, cu_seqlens=cu, chunk=s.chunk, kernel="triton")
    grads = torch.autograd.grad(y, [a[n] for n in names], dy)
    leaves = {k: v.detach().float().requires_grad_() for k, v in a.items()}
    ref = mamba3_scan(**leaves, cu_seqlens=cu, chunk=s.chunk, kernel="chunked")
    want = torch.autograd.grad(ref, [leaves[n] for n in names], dy.float())
    rel = lambda u, v: ((u.float() - v).norm() / v.norm()).item()  # noqa: E731
    assert rel(y, ref) < 1e-2, rel(y, ref)
    for name, g, w in zip(names, grads, want):
        assert rel(g, w) < (3e-2 if name == "angles" else 2e-2), f"d{name}: relative error {rel(g, w):.2e}"


# ----------------------------------------------------------------------------- the layer (nn/mamba3.py)


def _layer(**overrides):
    from megacpp_lab.nn.mamba3 import Mamba3, Mamba3Config

    torch.manual_seed(0)
    cfg = Mamba3Config.build(**{**dict(d_model=32, n_heads=4, head_dim=8, state_dim=16, n_groups=2, rope_pairs=4,
                                       chunk=8), **overrides})  # fmt: skip
    return Mamba3(cfg).double()


@pytest.mark.parametrize("kernel, rank", [("chunked", 1), ("reference", 1), ("chunked", 2), ("reference", 4)])
def test_the_layers_decode_step_equals_its_forward_at_every_position(kernel, rank):
    layer = _layer(kernel=kernel, mimo_rank=rank)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        state = layer.init_state(2)
        state.h, state.theta, state.k_prev, state.x_prev = (t.double() for t in (state.h, state.theta, state.k_prev, state.x_prev))
        steps = torch.cat([layer.step(x[:, t : t + 1], state) for t in range(20)], dim=1)
    # dt, the trapezoid and the angles are fp32 by contract: the in_proj of one token and of the whole row
    # differ in fp64's last bits, which can round dt to neighbouring fp32 values
    torch.testing.assert_close(steps, full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rank", [1, 2])
def test_the_layer_on_packed_rows_equals_each_document_alone_and_passes_the_leak_harness(rank):
    from megacpp_lab.testing import with_doc_ids

    layer = _layer(mimo_rank=rank)
    if rank > 1:  # away from the initialisation's symmetric ranks, so that a rank mix-up would show
        with torch.no_grad():
            for p in (layer.mimo_x, layer.mimo_z, layer.mimo_o):
                p.add_(0.3 * torch.randn_like(p))
    cu = _cu(2, 40, 5, seed=2)
    doc_ids = doc_ids_from_cu_seqlens(cu, 2, 40)
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        packed = layer(x, ctx=build_context(doc_ids))
        alone = each_document_alone(lambda xd: layer(xd), doc_ids, x)
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=1e-5)  # fp32 dt, as in the decode test
    assert assert_no_leaks(with_doc_ids(layer), x, doc_ids).passed


@pytest.mark.parametrize("field, value, message", [
    ("rope_pairs", 9, r"Mamba3Config.rope_pairs must be an int in \[0, state_dim / 2 = 8\]"),
    ("n_groups", 3, r"Mamba3Config.n_groups must be a divisor of n_heads=4"),
    ("kernel", "fast", r"Mamba3Config.kernel must be one of"),
    ("mimo_rank", 3, r"Mamba3Config.mimo_rank must be one of \(1, 2, 4, 8\)"),
    # what the Triton scan's tiles need, refused when the config is built, not at its first forward (a power of
    # two >= 16 also holds whole steps of every MIMO rank, 1 to 8)
    ("kernel", "triton", r"Mamba3Config.head_dim must be a power of two >= 16 with kernel='triton'"),
    ("chunk", 24, r"Mamba3Config.chunk must be a power of two >= 16 with kernel='triton'"),
])  # fmt: skip
def test_the_layers_config_fails_closed_naming_the_field(field, value, message):
    triton = {"chunk": dict(kernel="triton", head_dim=16), "kernel": dict(chunk=16)}.get(field, {})
    with pytest.raises(ValueError, match=message):
        _layer(**{**triton, field: value})
    if field == "chunk":  # off the Triton path any chunk serves
        _layer(chunk=value)


def test_the_mimo_layer_has_rank_parameters_and_at_its_initialisation_mixes_ranks_evenly():
    siso, mimo = _layer(), _layer(mimo_rank=4)
    assert not hasattr(siso, "mimo_x") and siso.b_bias.shape == (4, 16)
    assert mimo.b_bias.shape == (4, 4, 16) and mimo.mimo_o.shape == (4, 4, 8)
    assert mimo.in_proj.out_features - siso.in_proj.out_features == 2 * 3 * 2 * 16  # B and C: 3 more ranks of G*N
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    y = mimo(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_the_triton_op_refuses_shapes_past_int32_indexing():
    """The kernels index in int32: a batch whose saved states or per-head keys would pass 2**31 elements fails
    closed, naming the shape, before any kernel runs (zero-stride views: nothing that size is allocated)."""
    from megacpp_lab.kernels import TRITON_INTERPRET
    from megacpp_lab.kernels.mamba3 import _mamba3_triton

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, R, H, P, G, N = 8, 16384, 4, 32, 64, 1, 128  # B*T*R*H*N = 2**31 keys per head and sub-token
    big = lambda *shape: torch.zeros(1, device=device).expand(*shape)  # noqa: E731
    with pytest.raises(ValueError, match=r"indexes in int32: x \(8, 16384\) x 4 ranks with H=32"):
        _mamba3_triton(big(B, T, H, P), big(H, R, P), big(B, T, H), big(H), big(B, T, R, G, N), big(B, T, R, G, N),
                       big(B, T, H, 8), big(H, R, N), big(H, R, N), big(B, T, H), big(B, T, H), big(H),
                       torch.arange(0, B * T + 1, T, device=device, dtype=torch.int32),
                       torch.arange(B + 1, device=device, dtype=torch.int32), 64)  # fmt: skip


def test_the_bench_times_every_row_in_a_second_round_in_reverse_and_keeps_the_lower_median():
    """bench/mamba3's second round: each row keeps both rounds' medians and takes the lower of each; the rows run
    again in reverse order (so no contender is always timed first); a --small run (rep=1) keeps its one round."""
    import time as time_mod

    from megacpp_lab.bench.mamba3 import _second_round

    calls = []

    def sleeper(name: str, ms: float):
        def call():
            calls.append(name)
            time_mod.sleep(ms / 1e3)

        return call

    timed = [({"contender": "first", "fwd_ms": 50.0, "ms": 60.0, "bwd_ms": 10.0}, sleeper("first fwd", 1.0),
              sleeper("first fwd_bwd", 2.0)),
             ({"contender": "second", "fwd_ms": 1.0, "ms": 2.0, "bwd_ms": 1.0}, sleeper("second fwd", 30.0),
              sleeper("second fwd_bwd", 40.0))]  # fmt: skip
    assert _second_round([(dict(r), f, b) for r, f, b in timed], device="cpu", rep=1) == [r for r, _, _ in timed]
    assert not calls  # one round: nothing called again
    first, second = _second_round(timed, device="cpu", rep=3)
    assert calls[0] == "second fwd" and calls[-1] == "first fwd_bwd"  # reverse order
    assert first["fwd_ms_rounds"][0] == 50.0 and 1.0 <= first["fwd_ms_rounds"][1] < 50.0
    assert first["fwd_ms"] == first["fwd_ms_rounds"][1] and first["ms"] == first["ms_rounds"][1]
    assert first["bwd_ms"] == pytest.approx(first["ms"] - first["fwd_ms"])
    assert second["fwd_ms_rounds"][1] >= 30.0 and (second["fwd_ms"], second["ms"]) == (1.0, 2.0)  # the first round's


def test_the_bench_summary_reads_the_m_block_scan_bar_on_the_compiled_siso_row():
    """The issue's M-block bar (fwd+bwd <= 2.0 ms at main) reads the compiled SISO row, not the eager one or a peer:
    synthetic rows on either side of the threshold flip it, and its text names the shape it was read at."""
    from megacpp_lab.bench.mamba3 import FULL_SHAPES, LAB, LAB_EAGER, MAMBA2, PEER, _summary

    def rows(lab_ms: float) -> list[dict]:
        out = []
        for label in FULL_SHAPES:
            out += [{"contender": LAB, "shape": label, "ms": lab_ms, "fwd_ms": 0.5, "first_call_s": 5.0},
                    {"contender": LAB_EAGER, "shape": label, "ms": 0.1, "fwd_ms": 0.05, "first_call_s": 0.0},
                    {"contender": PEER, "shape": label, "ms": 0.2, "fwd_ms": 0.1},
                    {"contender": MAMBA2, "shape": label, "ms": 0.3, "fwd_ms": 0.1}]  # fmt: skip
        out += [{"contender": f"lab mamba3 MIMO R={r}", "shape": "main", "rank": r, "ms": lab_ms * r, "fwd_ms": 1.0,
                 "first_call_s": 5.0} for r in (2, 4)]  # fmt: skip
        return out

    main = FULL_SHAPES["main"]
    key = (f"the M block's scan (mamba3 SISO, compiled) fwd+bwd <= 2 ms at B={main.B} T={main.T} H={main.H} "
           f"P={main.P} N={main.N}, {main.docs} docs/row")
    assert _summary(rows(1.9), FULL_SHAPES, None, {})["bar"][key] is True
    assert _summary(rows(2.1), FULL_SHAPES, None, {})["bar"][key] is False


def test_the_triton_path_without_gpu_or_interpreter_fails_closed(monkeypatch):
    """Off the GPU, outside the interpreter and outside kernels/resources' offline compile, kernel='triton' refuses
    CPU tensors by name (never a silent fallback to the chunked path)."""
    import megacpp_lab.kernels as kernels

    monkeypatch.setattr(kernels, "TRITON_INTERPRET", False)  # what kernels.launchable reads
    a = _inputs(B=1, T=16, H=2, G=1, P=16, N=16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="kernel='triton' needs CUDA tensors"):
        mamba3_scan(**a, kernel="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,G", [(4, 1), (4, 2), (6, 3)])
def test_the_group_sum_kernel_adds_each_groups_heads_in_fp32(H, G, dtype):
    """The backward's dB and dC at G < H: the per-head parts [rows, H, N] summed over each group's heads in fp32 and
    rounded once to B's dtype (_group_sum_kernel), against torch's fp32 sum of the same parts; rows past a program's
    block (ROWS not a multiple of GROUP_SUM_ROWS) are masked, not written."""
    from megacpp_lab.kernels import mamba3 as m3

    if not (TRITON_INTERPRET or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    rows, N = m3.GROUP_SUM_ROWS + 5, 16
    dbh, dch = (torch.randn(rows, H, N, generator=g).to(device, dtype) for _ in range(2))
    db = torch.full((rows + 3, G, N), 7.0, device=device, dtype=dtype)  # 3 rows past the end: must stay 7
    dc = torch.full_like(db, 7.0)
    grid = (-(-rows // m3.GROUP_SUM_ROWS), G)
    m3._group_sum_kernel[grid](dbh, dch, db, dc, rows, H, G, N=N, BR=m3.GROUP_SUM_ROWS, num_warps=4)
    for got, parts in ((db, dbh), (dc, dch)):
        want = parts.view(rows, G, H // G, N).float().sum(2).to(dtype)
        torch.testing.assert_close(got[:rows], want, rtol=0 if dtype == torch.float32 else 1e-2, atol=1e-6)
        assert (got[rows:] == 7).all()


def test_group_sums_refuses_bad_input_by_name():
    """group_sums (the backward's dB and dC at G < H; bench/resources calls it too) fails closed: a G that does not
    divide H would skip heads, a dC unlike dB or a strided part would be read wrong, and N must be a power of two
    (the kernel's tile); each raises a ValueError naming what is wrong. Checked before any launch."""
    from megacpp_lab.kernels.mamba3 import group_sums

    dbh = torch.zeros(1, 4, 6, 16)
    cases = [
        ((dbh, dbh.clone(), 4), "G=4 must be a positive divisor of the heads H=6"),
        ((dbh, dbh.clone(), 0), "G=0 must be a positive divisor"),
        ((dbh, dbh[..., :8].clone(), 2), "dCh .* must match dBh"),
        ((dbh, dbh.to(torch.bfloat16), 2), "dCh .* must match dBh"),
        ((dbh.transpose(1, 2), dbh.transpose(1, 2), 2), "must be contiguous"),
        ((torch.zeros(1, 4, 6, 12), torch.zeros(1, 4, 6, 12), 2), "N=12 must be a power of two"),
        ((dbh[0], dbh[0], 2), r"dBh must be \[B, T\*R, H, N\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            group_sums(*args)


@pytest.mark.parametrize("groups,rotated,message", [(0, False, "groups=0 must divide H=4"),
                                                    (3, False, "groups=3 must divide H=4"),
                                                    (2, True, r"Bm's dim 2 \(2\) be H \(rotated keys\)")])
def test_the_backward_op_refuses_groups_that_do_not_fit_b(groups, rotated, message):
    """mamba3_scan_bwd is told B's groups (the forward may have kept per-head keys in B's place): a count that does
    not divide the heads, or B's dim 2 unlike what `rotated` says, raises before any launch, naming both."""
    from megacpp_lab.kernels.mamba3 import mamba3_scan_bwd

    B, T, H, P, N = 1, 8, 4, 8, 16
    z = torch.zeros
    Bm = z(B, T, 2, N)  # two groups of B and C
    with pytest.raises(ValueError, match=message):
        mamba3_scan_bwd(z(B, T, H, P), z(B, T, H, P), z(B, T, H), z(H), Bm, Bm.clone(), z(B, T, H, 4), z(B, T, H, 4),
                        z(H, 1, N), z(H, 1, N), z(B, T, H), z(B, T, H), z(H), None, torch.tensor([0, T]),
                        torch.tensor([0, T]), torch.tensor([0, 1], dtype=torch.int32), z(2, H, P, N), 8, 1, rotated,
                        groups, True)  # fmt: skip


def test_the_bench_deadline_expects_a_later_shape_to_compile_and_the_peer_to_autotune_again():
    """bench_mamba3 begins no later shape that next_shape_estimate_s puts past its deadline: the estimate keeps the
    lab's first calls (they compile again at every shape) and a share of the peer's autotuning (it autotunes again),
    dropping the rest of the peer's first call. (An estimate without any first call let a run with a deadline of
    300 s begin a shape at 284 s, and the call's timeout killed it before a receipt was written.)"""
    from megacpp_lab.bench.mamba3 import LAB, MAMBA2, PEER, PEER_REAUTOTUNE_SHARE, next_shape_estimate_s

    rows = [{"contender": LAB, "shape": "main", "first_call_s": 4.0},
            {"contender": PEER, "shape": "main", "first_call_s": 200.0},
            {"contender": MAMBA2, "shape": "main", "first_call_s": 3.0},
            {"contender": PEER, "shape": "H=32", "first_call_s": 40.0}]  # fmt: skip
    want = 250.0 - (1.0 - PEER_REAUTOTUNE_SHARE) * 200.0  # the main shape's peer only
    assert next_shape_estimate_s(250.0, rows) == pytest.approx(want)
    assert next_shape_estimate_s(250.0, rows[:1]) == 250.0  # no peer: every second counts
    assert next_shape_estimate_s(10.0, rows) == 0.0  # never negative
