"""Tests of the packed-row leak harness (megacpp_lab.testing.leaks) on planted mixers."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from megacpp_lab.testing import (  # noqa: E402
    CausalSmoother,
    CenteredSmoother,
    DocCausalAttention,
    LeakReport,
    TokenMixer,
    VacuousCheckError,
    Violation,
    ZeroInitProjection,
    assert_no_leaks,
    check_leaks,
    influence_matrix,
    influence_violation,
    plot_influence,
    with_doc_ids,
)
from megacpp_lab.varlen import doc_causal_shift, positions_from_doc_ids  # noqa: E402
from megacpp_lab.nn.engram import EngramBranch, EngramConfig  # noqa: E402
from megacpp_lab.testing.leaks import perturb  # noqa: E402

B, T, C, V = 2, 48, 8, 37
WINDOW = 4
# documents per row, all longer than WINDOW so a leak from doc k lands in doc k+1
DOC_LENGTHS = [[10, 17, 6, 15], [20, 12, 16]]


def make_doc_ids(lengths: list[list[int]] = DOC_LENGTHS) -> torch.Tensor:
    rows = []
    for row in lengths:
        assert sum(row) == T
        rows.append(torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)))
    return torch.stack(rows).to(torch.int64)


def doc_starts(doc_ids_row: torch.Tensor) -> list[int]:
    return [0] + (torch.nonzero(doc_ids_row[1:] != doc_ids_row[:-1]).flatten() + 1).tolist()


@pytest.fixture
def doc_ids() -> torch.Tensor:
    return make_doc_ids()


@pytest.fixture
def x() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, C, generator=g, dtype=torch.float64)


@pytest.fixture
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, V, (B, T), generator=g)


# ------------------------------------------------------------------------ check_leaks


def test_masked_smoother_passes(x, doc_ids):
    rep = check_leaks(CausalSmoother(WINDOW, doc_masked=True), x, doc_ids)
    assert isinstance(rep, LeakReport)
    assert rep.passed
    assert rep.n_docs_perturbed == 7
    assert rep.n_positions_perturbed == T
    for v in (rep.cross_doc, rep.causal):
        assert v is None or v.magnitude <= rep.tol
    assert "PASS" in str(rep)
    assert assert_no_leaks(CausalSmoother(WINDOW, doc_masked=True), x, doc_ids).passed


def test_unmasked_smoother_fails_cross_doc_at_right_place(x, doc_ids):
    rep = check_leaks(CausalSmoother(WINDOW, doc_masked=False), x, doc_ids)
    assert not rep.passed
    v = rep.cross_doc
    assert isinstance(v, Violation) and v.kind == "cross_doc"
    assert v.magnitude > 0.01 > rep.tol
    # causal conv never looks ahead
    assert rep.causal is None or rep.causal.magnitude <= rep.tol
    assert v.row == v.src_row
    row_ids = doc_ids[v.row]
    assert v.src_doc == int(row_ids[v.src_pos])
    assert v.src_pos in doc_starts(row_ids)
    out_doc = int(row_ids[v.out_pos])
    assert out_doc == v.src_doc + 1 == v.out_doc
    next_start = doc_starts(row_ids)[out_doc]
    assert 0 <= v.out_pos - next_start < WINDOW - 1
    assert "FAIL" in str(rep) and "cross_doc" in str(rep)
    assert f"doc {v.src_doc}" in str(v) and f"offset {v.out_pos}" in str(v)
    with pytest.raises(AssertionError, match="FAIL"):
        assert_no_leaks(CausalSmoother(WINDOW, doc_masked=False), x, doc_ids)


def test_centered_smoother_fails_causal(x, doc_ids):
    rep = check_leaks(CenteredSmoother(5), x, doc_ids)
    assert not rep.passed
    assert rep.causal is not None and rep.causal.magnitude > rep.tol
    assert rep.causal.out_pos < rep.causal.src_pos
    assert rep.causal.src_pos - rep.causal.out_pos <= 2  # looks 2 ahead
    # doc-masked: no cross-document leak
    assert rep.cross_doc is None or rep.cross_doc.magnitude <= rep.tol
    assert rep.worst is rep.causal


def test_skipping_checks(x, doc_ids):
    rep = check_leaks(CenteredSmoother(5), x, doc_ids, causal=False)
    assert rep.passed and rep.causal is None and rep.n_positions_perturbed == 0
    rep = check_leaks(CausalSmoother(WINDOW, False), x, doc_ids, cross_doc=False, causal_positions=[0, 5, 47])
    assert rep.passed and rep.cross_doc is None and rep.n_positions_perturbed == 3
    rep = check_leaks(CausalSmoother(WINDOW, False), x, doc_ids, max_docs=3, causal=False)
    assert rep.n_docs_perturbed == 3


def test_attention_masked_passes_leaky_fails(x, doc_ids):
    torch.manual_seed(0)
    good = DocCausalAttention(C, 2).double().eval()
    rep = check_leaks(good, x, doc_ids)
    assert rep.passed, str(rep)
    bad = DocCausalAttention(C, 2, doc_masked=False).double().eval()
    bad.load_state_dict(good.state_dict())
    rep = check_leaks(bad, x, doc_ids)
    assert not rep.passed
    assert rep.cross_doc is not None and rep.cross_doc.magnitude > rep.tol
    v = rep.cross_doc
    assert v.row == v.src_row and v.out_pos >= v.src_pos  # attention leaks forward only
    assert rep.causal is None or rep.causal.magnitude <= rep.tol


def test_token_ids(ids, doc_ids):
    torch.manual_seed(0)
    good = TokenMixer(V, C, DocCausalAttention(C, 2)).eval()
    rep = check_leaks(good, ids, doc_ids, vocab_size=V)
    assert rep.passed, str(rep)
    assert rep.tol == pytest.approx(1e-6 * float(good(ids, doc_ids).detach().abs().max()))
    bad = TokenMixer(V, C, DocCausalAttention(C, 2, doc_masked=False)).eval()
    rep = check_leaks(bad, ids, doc_ids, vocab_size=V)
    assert not rep.passed and rep.cross_doc.magnitude > rep.tol
    smooth_bad = TokenMixer(V, C, CausalSmoother(WINDOW, doc_masked=False))
    assert not check_leaks(smooth_bad, ids, doc_ids, vocab_size=V).passed
    with pytest.raises(ValueError, match="vocab_size"):
        check_leaks(good, ids, doc_ids)
    with pytest.raises(ValueError, match="vocab_size"):
        check_leaks(good, ids, doc_ids, vocab_size=V - 10)  # ids out of range


def test_batch_mixing_fails_cross_row(x, doc_ids):
    rep = check_leaks(lambda xx, d: xx + xx.mean(0, keepdim=True), x, doc_ids)
    assert not rep.passed
    v = rep.cross_doc
    assert v is not None and v.row != v.src_row
    assert rep.causal is None or rep.causal.magnitude <= rep.tol


def test_perturbation_changes_every_element():
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 2, (500,))
    new = perturb(tok, scale=0.0, vocab_size=2, gen=g)
    assert bool((new != tok).all()) and int(new.min()) >= 0 and int(new.max()) < 2
    big = torch.full((200,), 1e4, dtype=torch.bfloat16)
    new = perturb(big, scale=1.0, vocab_size=None, gen=g)
    assert bool((new != big).all()) and bool(torch.isfinite(new).all())


def test_low_precision_default_tol(x, doc_ids):
    xb = x.to(torch.bfloat16)
    rep = check_leaks(CausalSmoother(WINDOW, True), xb, doc_ids, cross_doc=False)
    assert rep.tol == pytest.approx(1e-3 * float(CausalSmoother(WINDOW, True)(xb, doc_ids).abs().max()))
    assert rep.passed


def test_tolerance_scales_with_small_outputs(x, doc_ids):
    """A leak in a mixer whose outputs are all tiny is still a leak (no absolute floor)."""
    tiny_leaky = lambda v, d: 1e-4 * CausalSmoother(WINDOW, doc_masked=False)(v, d)
    rep = check_leaks(tiny_leaky, x.to(torch.bfloat16), doc_ids, causal=False)
    assert not rep.passed and rep.tol < 1e-6


# -------------------------------------------------------------- vacuous checks (can it fail?)


def test_masked_smoother_reports_its_dependence(x, doc_ids):
    rep = check_leaks(CausalSmoother(WINDOW, doc_masked=True), x, doc_ids)
    dep = rep.dependence
    assert not rep.vacuous and not rep.constant and dep.ignored == ()
    assert dep.docs_probed == 7 and dep.n_causal_probes == B * T
    assert dep.weakest is not None and dep.weakest > 0.01 > rep.tol
    assert dep.largest_change >= dep.weakest and dep.inert_probes == ()
    assert "every one of 7 probed docs moves its own outputs" in str(rep)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("zeros", lambda v, d: torch.zeros_like(v)),
        ("ones", lambda v, d: torch.ones_like(v)),  # nonzero constant: tol > 0, changes exactly 0
        ("zero-init projection", ZeroInitProjection(CausalSmoother(WINDOW), C).double()),
    ],
)
def test_constant_output_is_refused(x, doc_ids, name, fn):
    with pytest.raises(VacuousCheckError, match="output is constant in the input") as err:
        check_leaks(fn, x, doc_ids)
    assert "allow_vacuous=True" in str(err.value)
    rep = err.value.report
    assert rep.constant and rep.vacuous and not rep.leaked and not rep.passed
    assert "PASS" not in str(rep) and "VACUOUS" in str(rep)
    assert rep.dependence.weakest is None and rep.dependence.largest_change == 0.0
    assert len(rep.dependence.ignored) == 7
    assert len(rep.dependence.inert_probes) == rep.dependence.n_causal_probes == B * T
    with pytest.raises(VacuousCheckError, match="constant"):
        assert_no_leaks(fn, x, doc_ids)
    # causal check alone: refused too
    with pytest.raises(VacuousCheckError, match="constant"):
        check_leaks(fn, x, doc_ids, cross_doc=False)


def test_zero_init_engram_branch_is_refused_until_its_projection_is_set(doc_ids):
    """The case that passed before: Engram's zero out_proj made check_leaks report PASS."""
    torch.manual_seed(0)
    engram = EngramBranch(EngramConfig(d_model=C, bottleneck=4)).double().eval()
    branch = with_doc_ids(engram)  # the harness's fn(x, doc_ids): the branch on build_context(doc_ids)
    h = torch.randn(B, T, C, dtype=torch.float64)
    with pytest.raises(VacuousCheckError, match=r"zero-initialised output projection"):
        check_leaks(branch, h, doc_ids)
    ids = torch.randint(0, V, (B, T))
    with pytest.raises(VacuousCheckError, match="constant in the input"):
        check_leaks(TokenMixer(V, C, branch).double(), ids, doc_ids, vocab_size=V)
    nn.init.normal_(engram.out_proj.weight, std=0.05)  # on purpose: the check can now fail
    rep = check_leaks(branch, h, doc_ids)
    assert rep.passed and not rep.vacuous, str(rep)


def test_allow_vacuous_accepts_and_says_so(x, doc_ids, ids):
    fn = lambda v, d: torch.zeros(v.shape[0], v.shape[1], 3)
    rep = check_leaks(fn, ids, doc_ids, vocab_size=V, allow_vacuous=True)
    assert rep.passed and rep.vacuous and rep.constant and rep.allow_vacuous
    text = str(rep)
    assert text.splitlines()[0].startswith("LeakReport: PASS, VACUOUS (accepted with allow_vacuous=True)")
    assert "constant in the input" in text
    assert assert_no_leaks(fn, ids, doc_ids, vocab_size=V, allow_vacuous=True).vacuous
    # a real mixer under the opt-in is simply not vacuous
    rep = check_leaks(CausalSmoother(WINDOW), x, doc_ids, allow_vacuous=True)
    assert rep.passed and not rep.vacuous and "VACUOUS" not in str(rep)


def _ignore_doc(inner, row, doc):
    """inner, with every output of document ``doc`` in ``row`` replaced by zero."""

    def fn(v, d):
        y = inner(v, d)
        keep = torch.ones_like(d, dtype=torch.bool)
        keep[row] = d[row] != doc
        return y * keep[..., None]

    return fn


def test_module_ignoring_one_document_is_caught(x, doc_ids):
    fn = _ignore_doc(CausalSmoother(WINDOW), row=0, doc=2)  # row 0 doc 2 spans offsets 27:33
    ignored = r"does not depend on 1 of 7 probed documents: perturbing doc 2 \(row 0, offsets 27:33\)"
    with pytest.raises(VacuousCheckError, match=ignored):
        check_leaks(fn, x, doc_ids)
    # the causal probes alone see it too: all six probes in that document move nothing of it
    with pytest.raises(VacuousCheckError, match=r"doc 2 \(row 0, offsets 27:33\)") as err:
        check_leaks(fn, x, doc_ids, cross_doc=False)
    assert set(err.value.report.dependence.inert_probes) == {(0, t) for t in range(27, 33)}
    # ... and a sparse causal sample that misses the document does not claim anything about it
    rep = check_leaks(fn, x, doc_ids, cross_doc=False, causal_positions=[0, 20, 40])
    assert rep.passed and rep.dependence.docs_probed == 6  # 3 per row, none of them row 0 doc 2
    rep = check_leaks(fn, x, doc_ids, allow_vacuous=True)
    assert rep.passed and rep.vacuous and not rep.constant
    assert [(s.row, s.doc, s.start, s.end) for s in rep.dependence.ignored] == [(0, 2, 27, 33)]


def test_leak_is_reported_even_where_a_document_is_ignored(x, doc_ids):
    """A leak is a finding: FAIL (not a refusal), with the ignored document in the report."""
    leaky = _ignore_doc(CausalSmoother(WINDOW, doc_masked=False), row=1, doc=0)
    rep = check_leaks(leaky, x, doc_ids)
    assert rep.leaked and not rep.passed and rep.vacuous
    assert [(s.row, s.doc) for s in rep.dependence.ignored] == [(1, 0)]
    assert str(rep).startswith("LeakReport: FAIL") and "doc 0 (row 1, offsets 0:20)" in str(rep)


def test_dependence_below_tol_does_not_count(x, doc_ids):
    """A relative threshold, not exact zero: a response the leak check could not see is no dependence."""
    faint = lambda v, d: 1e3 + 1e-4 * CausalSmoother(WINDOW)(v, d)  # tol = 1e-6 * 1e3 > 1e-4
    with pytest.raises(VacuousCheckError, match="constant in the input") as err:
        check_leaks(faint, x, doc_ids)
    assert 0 < err.value.report.dependence.largest_change <= err.value.report.tol
    # with an explicit tol below the response it is a real (and passing) check
    assert check_leaks(faint, x, doc_ids, tol=1e-9).passed


def test_previous_token_mixer_passes_with_inert_probes(x, doc_ids):
    """y_t = x_{t-1} within the document: a document's last token moves nothing, which is legal."""
    rep = check_leaks(lambda v, d: doc_causal_shift(v, positions_from_doc_ids(d), 1), x, doc_ids)
    assert rep.passed and not rep.vacuous, str(rep)
    last = {(b, t) for b in range(B) for t in range(T) if t == T - 1 or doc_ids[b, t + 1] != doc_ids[b, t]}
    assert set(rep.dependence.inert_probes) == last
    assert "7 of 96 causal probes" in str(rep)


def test_nothing_to_check_is_refused(x, doc_ids):
    with pytest.raises(ValueError, match="nothing to check"):
        check_leaks(CausalSmoother(WINDOW), x, doc_ids, cross_doc=False, causal=False)
    with pytest.raises(ValueError, match="nothing to check"):
        check_leaks(CausalSmoother(WINDOW), x, doc_ids, cross_doc=False, causal_positions=[])


def test_nondeterministic_fn_rejected(x, doc_ids):
    drop = nn.Dropout(0.5).train()
    with pytest.raises(ValueError, match="deterministic"):
        check_leaks(lambda xx, d: drop(xx), x, doc_ids)


# ------------------------------------------------------------------------- validation


def test_non_finite_output_raises(x, doc_ids):
    def bad_y0(xx, d):
        y = xx.clone()
        y[1, 5, 3] = float("nan")
        return y

    with pytest.raises(ValueError, match=r"row 1, offset 5"):
        check_leaks(bad_y0, x, doc_ids)

    def bad_later(xx, d):  # finite on x, inf once x[0, 30] is perturbed
        y = xx.clone()
        if not torch.equal(xx[0, 30], x[0, 30]):
            y[0, 2] = float("inf")
        return y

    with pytest.raises(ValueError, match=r"non-finite at row 0, offset 2"):
        check_leaks(bad_later, x, doc_ids)


def test_bad_doc_ids_raise(x, doc_ids):
    with pytest.raises(ValueError, match="doc_ids"):
        check_leaks(CausalSmoother(WINDOW), x, doc_ids[:, :-1])
    with pytest.raises(ValueError, match="doc_ids"):
        check_leaks(CausalSmoother(WINDOW), x, doc_ids.double())
    with pytest.raises(ValueError, match="doc_ids"):
        check_leaks(CausalSmoother(WINDOW), x, doc_ids.flip(1))  # decreasing
    with pytest.raises(ValueError, match="doc_ids"):
        influence_matrix(CausalSmoother(WINDOW), x, doc_ids[0])


# -------------------------------------------------------------------------- influence


def reference_influence(fn, x, doc_ids, row):
    """Independent reference: full torch.autograd.functional.jacobian, then Frobenius norms."""
    jac = torch.autograd.functional.jacobian(lambda xx: fn(xx, doc_ids)[row], x)  # [T,C,B,T,C]
    return jac[:, :, row].pow(2).sum(dim=(1, 3)).sqrt()


@pytest.mark.parametrize("nonlinear", [False, True])
def test_jacobian_exact(x, doc_ids, nonlinear):
    fn = CausalSmoother(WINDOW, doc_masked=True, nonlinear=nonlinear)
    for row in range(B):
        m = influence_matrix(fn, x, doc_ids, row=row, method="jacobian")
        assert m.shape == (T, T) and m.dtype == torch.float64 and m.device.type == "cpu"
        ref = reference_influence(fn, x, doc_ids, row)
        torch.testing.assert_close(m, ref, rtol=0, atol=1e-10)
    if not nonlinear:
        # analytic: dy_t/dx_s = I_C / window inside the window and the document
        d = doc_ids[1]
        t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
        inside = (s <= t) & (t - s < WINDOW) & (d[:, None] == d[None, :])
        expected = inside.double() * (C**0.5 / WINDOW)
        torch.testing.assert_close(m, expected, rtol=0, atol=1e-12)


def test_influence_float32_default(x, doc_ids):
    m = influence_matrix(CausalSmoother(WINDOW), x.float(), doc_ids)
    assert m.dtype == torch.float32 and m.shape == (T, T)


@pytest.mark.parametrize("doc_masked", [True, False])
def test_jacobian_matches_perturbation_pattern(x, doc_ids, doc_masked):
    fn = CausalSmoother(WINDOW, doc_masked=doc_masked)
    jac = influence_matrix(fn, x, doc_ids, method="jacobian")
    pert = influence_matrix(fn, x, doc_ids, method="perturbation")
    assert torch.equal(jac > 0, pert > 0)
    viol = influence_violation(jac, doc_ids[0])
    assert viol["upper"] == 0.0 and viol["total"] > 0
    if doc_masked:
        assert viol["off_block"] == 0.0
    else:
        assert viol["off_block"] > 0.1
        assert influence_violation(pert, doc_ids[0])["off_block"] > 0.1


def test_influence_of_lookahead_and_attention(x, doc_ids):
    m = influence_matrix(CenteredSmoother(5), x, doc_ids, row=1)
    viol = influence_violation(m, doc_ids[1])
    assert viol["upper"] > 0 and viol["off_block"] == 0.0
    torch.manual_seed(0)
    att = DocCausalAttention(C, 2).double()
    viol = influence_violation(influence_matrix(att, x, doc_ids, row=1), doc_ids[1])
    assert viol["off_block"] == 0.0 and viol["upper"] == 0.0 and viol["total"] > 0
    leaky = DocCausalAttention(C, 2, doc_masked=False).double()
    viol = influence_violation(influence_matrix(leaky, x, doc_ids, row=1), doc_ids[1])
    assert viol["off_block"] > 0 and viol["upper"] == 0.0


def test_token_influence_via_embedding(ids, doc_ids):
    torch.manual_seed(0)
    good = TokenMixer(V, C, CausalSmoother(WINDOW, doc_masked=True))
    m = influence_matrix(good, ids, doc_ids, row=0)  # auto -> embedding probe
    assert m.shape == (T, T) and m.dtype == torch.float32
    viol = influence_violation(m, doc_ids[0])
    assert viol["off_block"] == 0.0 and viol["upper"] == 0.0 and viol["total"] > 0
    pert = influence_matrix(good, ids, doc_ids, row=0, method="perturbation", vocab_size=V)
    assert torch.equal(m > 0, pert > 0)
    # the embedding hook must be removed afterwards
    assert not good.embed._forward_hooks
    bad = TokenMixer(V, C, CausalSmoother(WINDOW, doc_masked=False))
    assert influence_violation(influence_matrix(bad, ids, doc_ids, method="jacobian"), doc_ids[0])["off_block"] > 0


def test_token_influence_without_embedding_raises(ids, doc_ids):
    class NoEmbed(nn.Module):
        def forward(self, xx, d=None):
            return xx.double().unsqueeze(-1)

    for fn in (NoEmbed(), lambda xx, d: xx.double().unsqueeze(-1)):
        with pytest.raises(ValueError, match="perturbation"):
            influence_matrix(fn, ids, doc_ids, method="auto")
        with pytest.raises(ValueError, match="perturbation"):
            influence_matrix(fn, ids, doc_ids, method="jacobian")
    # explicit perturbation works without an embedding
    m = influence_matrix(NoEmbed(), ids, doc_ids, method="perturbation", vocab_size=V)
    assert influence_violation(m, doc_ids[0])["off_block"] == 0.0
    with pytest.raises(ValueError, match="method"):
        influence_matrix(NoEmbed(), ids, doc_ids, method="finite")


def test_plot_influence(x, doc_ids):
    m = influence_matrix(CausalSmoother(WINDOW, doc_masked=False), x, doc_ids)
    ax = plot_influence(m, doc_ids[0], title="leaky smoother")
    try:
        assert ax.images and ax.get_title() == "leaky smoother"
        assert len(ax.figure.axes) == 2  # image + colorbar
        assert len(ax.lines) == 2 * (len(doc_starts(doc_ids[0])) - 1)
    finally:
        plt.close(ax.figure)


@pytest.mark.cuda
def test_harness_on_gpu_bf16_attention_and_real_rows():
    from megacpp_lab.data import load_sample

    rows, _ = load_sample()
    T = 512
    tokens = rows.batch.tokens[:4, :T].cuda()
    doc_ids = rows.batch.doc_ids[:4, :T].cuda()
    for masked in (True, False):
        torch.manual_seed(0)
        model = TokenMixer(259, 64, DocCausalAttention(64, 4, doc_masked=masked)).cuda().to(torch.bfloat16).eval()
        report = check_leaks(model, tokens, doc_ids, vocab_size=259, causal_positions=range(0, T, 37))
        assert report.passed == masked, str(report)
    M = influence_matrix(model, tokens, doc_ids, row=0)
    assert M.shape == (T, T) and influence_violation(M, doc_ids[0])["upper"] == 0
