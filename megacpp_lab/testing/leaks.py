"""Leak harness for token mixers on packed rows.

A packed row of length T holds several documents back to back; ``doc_ids [B,T]`` is
non-decreasing along each row and changes at every document boundary. Every token
mixer ``fn(x, doc_ids) -> y`` must keep two promises:

(a) cross-document isolation: perturbing the inputs of one document (in one row)
    changes no output of any other document, in that row or in any other row;
(b) causality: perturbing position t changes no output before t.

A mixer that breaks either promise trains fine and evaluates fine on one document
per row, then silently degrades on packed data (or cheats by looking ahead). These
helpers find such leaks by black-box perturbation (:func:`check_leaks`) and show them
as a T x T influence matrix (:func:`influence_matrix`, :func:`plot_influence`).

A leak check is only evidence if it could have failed: a module whose output ignores
its input (an Engram branch with its zero-initialised output projection, say) leaks
nothing at those weights and hides every masking bug the trained weights would expose.
:func:`check_leaks` therefore also measures how much each document moves its own
outputs, and refuses (:class:`VacuousCheckError`) a check in which some document does not.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = [
    "Violation",
    "DocSpan",
    "Dependence",
    "LeakReport",
    "VacuousCheckError",
    "check_leaks",
    "assert_no_leaks",
    "influence_matrix",
    "influence_violation",
    "perturb",
    "plot_influence",
    "each_document_alone",
    "with_doc_ids",
]

Mixer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _WithDocIds(nn.Module):
    def __init__(self, layer: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        from megacpp_lab.varlen import build_context

        return self.layer(x, ctx=None if doc_ids is None else build_context(doc_ids), **self.kwargs)


def with_doc_ids(layer: nn.Module, **kwargs: Any) -> nn.Module:
    """The one bare-doc_ids entry to the library's layers, which take the batch's PackedContext only: a module
    whose forward(x, doc_ids) is layer(x, ctx=build_context(doc_ids), **kwargs) (doc_ids None: ctx=None, one
    document per row). The harness's mixer signature: tests and notebooks call a layer on doc_ids through it,
    and it holds the layer as a submodule (.double(), .to() reach it). build_context validates doc_ids on the
    host: a bad id fails by name before the layer runs."""
    return _WithDocIds(layer, kwargs)


def each_document_alone(fn: Callable[..., torch.Tensor], doc_ids: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """fn on each document of the packed rows alone (a row of its own, no context: one document per row),
    stitched back into [B,T,...]: the independent reference of a layer's context path. The segments are read
    from doc_ids directly, not from a PackedContext; `inputs` are [B,T,...] tensors cut the same way."""
    rows = []
    for b, ids in enumerate(doc_ids):
        lengths = torch.unique_consecutive(ids, return_counts=True)[1].tolist()
        docs = zip(*(t[b].split(lengths) for t in inputs))  # each input's segments, document by document
        rows.append(torch.cat([fn(*(p[None] for p in parts))[0] for parts in docs]))
    return torch.stack(rows)


# Bound on the number of gradient elements materialised per batched backward pass
# in influence_matrix (chunk of cotangents x numel of the differentiated input).
_GRAD_ELEMS_PER_CHUNK = 1 << 24
_DEFAULT_CAUSAL_ALL_UP_TO = 256
_DEFAULT_CAUSAL_SAMPLES = 64


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Violation:
    """The largest output change seen in one category of check.

    ``magnitude`` is max |y - y0| over the trailing (feature) dims at ``(row, out_pos)``.
    For ``kind == "cross_doc"`` the perturbed span is document ``src_doc`` of row
    ``src_row`` starting at offset ``src_pos``. For ``kind == "causal"`` offset
    ``src_pos`` was perturbed in every row at once; ``src_row`` is then the row whose
    output changed (equal to ``row``) and ``src_doc`` is None. ``out_doc`` is the
    document id of the changed output (extra context for messages).
    """

    kind: str
    magnitude: float
    row: int
    out_pos: int
    src_row: int
    src_pos: int
    src_doc: int | None = None
    out_doc: int | None = None

    def __str__(self) -> str:
        where = f"row {self.row}, offset {self.out_pos}"
        if self.out_doc is not None:
            where += f" (doc {self.out_doc})"
        if self.kind == "cross_doc":
            src = f"doc {self.src_doc} (row {self.src_row}, starts at offset {self.src_pos})"
            return f"cross_doc leak {self.magnitude:.1e}: perturbing {src} changed output at {where}"
        if self.kind == "causal":
            return (
                f"causal leak {self.magnitude:.1e}: perturbing offset {self.src_pos} (in every row) "
                f"changed earlier output at {where}"
            )
        return f"{self.kind} leak {self.magnitude:.1e}: src row {self.src_row} offset {self.src_pos} -> {where}"


@dataclass(frozen=True)
class DocSpan:
    """One document segment of a packed row: offsets ``start:end`` of ``row`` hold document ``doc``."""

    row: int
    doc: int
    start: int
    end: int

    def __str__(self) -> str:
        return f"doc {self.doc} (row {self.row}, offsets {self.start}:{self.end})"


@dataclass(frozen=True)
class Dependence:
    """How far the perturbations moved fn's outputs: whether the leak check could have failed.

    ``docs_probed``: (row, document) segments perturbed whole by the cross-doc check or
    holding a causal probe. ``ignored``: those among them whose perturbations moved no
    output of their own document by more than tol. ``weakest``: the smallest own-document
    response among the documents that did respond (None if none did). ``largest_change``:
    the largest change any perturbation caused at any output. ``inert_probes``: the
    (row, offset) causal probes that moved nothing at or after themselves in their
    document (information only: a previous-token mixer legitimately ignores a document's
    last token). ``n_causal_probes``: (row, offset) pairs probed by the causal check.
    """

    docs_probed: int
    ignored: tuple[DocSpan, ...]
    weakest: float | None
    largest_change: float
    inert_probes: tuple[tuple[int, int], ...]
    n_causal_probes: int


@dataclass(frozen=True)
class LeakReport:
    """Worst observed change per category (even below tolerance), the dependence, and the verdict.

    ``cross_doc`` / ``causal`` are None only if that check was skipped or no output
    outside the allowed region changed at all. ``dependence`` says whether the check
    could have failed; a vacuous check (see :attr:`vacuous`) passes only with
    ``allow_vacuous=True``.
    """

    cross_doc: Violation | None
    causal: Violation | None
    tol: float
    n_docs_perturbed: int
    n_positions_perturbed: int
    dependence: Dependence
    allow_vacuous: bool = False

    @property
    def leaked(self) -> bool:
        """A change above tol where the promises allow none."""
        return any(v is not None and v.magnitude > self.tol for v in (self.cross_doc, self.causal))

    @property
    def constant(self) -> bool:
        """No perturbation moved any output by more than tol: the output is constant in the input."""
        return self.dependence.largest_change <= self.tol

    @property
    def vacuous(self) -> bool:
        """The output is constant, or some probed document moves none of its own outputs."""
        return self.constant or bool(self.dependence.ignored)

    @property
    def passed(self) -> bool:
        return not self.leaked and (self.allow_vacuous or not self.vacuous)

    @property
    def worst(self) -> Violation | None:
        found = [v for v in (self.cross_doc, self.causal) if v is not None]
        if not found:
            return None
        return max(found, key=lambda v: v.magnitude)

    def vacuity(self) -> str:
        """Why the check is vacuous (empty string when it is not)."""
        dep = self.dependence
        if self.constant:
            counts = ((self.n_docs_perturbed, "documents"), (self.n_positions_perturbed, "positions"))
            probes = [f"{n} {unit}" for n, unit in counts if n]
            return (
                f"the output is constant in the input: perturbing {' and '.join(probes)} changed no output by more "
                f"than tol={self.tol:.1e} (largest change {dep.largest_change:.1e}), so no leak could have shown"
            )
        if dep.ignored:
            shown = "; ".join(str(s) for s in dep.ignored[:5])
            more = f"; and {len(dep.ignored) - 5} more" if len(dep.ignored) > 5 else ""
            return (
                f"the output does not depend on {len(dep.ignored)} of {dep.docs_probed} probed documents: "
                f"perturbing {shown}{more} changed no output of that same document by more than "
                f"tol={self.tol:.1e}, so the check says nothing about how those documents are masked"
            )
        return ""

    def __str__(self) -> str:
        if self.leaked:
            verdict = "FAIL"
        elif self.vacuous:
            verdict = "PASS, VACUOUS (accepted with allow_vacuous=True)" if self.allow_vacuous else "VACUOUS (refused)"
        else:
            verdict = "PASS"
        lines = [f"LeakReport: {verdict} (tol {self.tol:.1e})"]
        for name, v, n, unit in (
            ("cross_doc", self.cross_doc, self.n_docs_perturbed, "docs"),
            ("causal", self.causal, self.n_positions_perturbed, "positions"),
        ):
            if v is None:
                mag = "no change" if n else "skipped"
            else:
                flag = "FAIL" if v.magnitude > self.tol else "ok"
                mag = f"worst {v.magnitude:.1e} [{flag}]"
            lines.append(f"  {name:9s}: {mag} over {n} perturbed {unit}")
        dep = self.dependence
        if self.vacuous:
            lines.append(f"  depends  : VACUOUS: {self.vacuity()}")
        else:
            lines.append(
                f"  depends  : every one of {dep.docs_probed} probed docs moves its own outputs "
                f"(weakest {dep.weakest:.1e})"
            )
        if dep.inert_probes:
            lines.append(
                f"             {len(dep.inert_probes)} of {dep.n_causal_probes} causal probes (row, offset) moved "
                f"nothing at or after themselves, e.g. {list(dep.inert_probes[:3])}"
            )
        w = self.worst
        if w is not None and self.leaked:
            lines.append(f"  worst: {w}")
        return "\n".join(lines)


class VacuousCheckError(ValueError):
    """check_leaks found no leak, but the check could not have found one; ``report`` holds the details."""

    def __init__(self, report: LeakReport) -> None:
        self.report = report
        if report.constant:
            cause = (
                "A zero-initialised output projection does this: re-initialise it before the check "
                "(e.g. nn.init.normal_(branch.out_proj.weight, std=0.05))"
            )
        else:
            cause = (
                "A mask that zeroes a whole document does this, and so does a mixer that reads no token "
                "of a one-token document (a previous-token shift)"
            )
        super().__init__(
            f"check_leaks refuses a vacuous check: {report.vacuity()}. {cause}; "
            "pass allow_vacuous=True to accept a report marked VACUOUS."
        )


# ------------------------------------------------------------------------- validation


def _validate(x: Any, doc_ids: Any, vocab_size: int | None, *, need_vocab: bool) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(doc_ids, torch.Tensor):
        raise ValueError(f"doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must be [B,T] token ids or [B,T,...] hidden states, got shape {tuple(x.shape)}")
    if doc_ids.dim() != 2 or tuple(doc_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"doc_ids must have shape [B,T] = {tuple(x.shape[:2])} matching x's first two dims, "
            f"got doc_ids shape {tuple(doc_ids.shape)} (x shape {tuple(x.shape)})"
        )
    if doc_ids.dtype == torch.bool or doc_ids.is_floating_point() or doc_ids.is_complex():
        raise ValueError(f"doc_ids must be an integer tensor, got dtype {doc_ids.dtype} (shape {tuple(doc_ids.shape)})")
    if doc_ids.device != x.device:
        raise ValueError(f"doc_ids is on {doc_ids.device} but x is on {x.device}")
    B, T = doc_ids.shape
    if B == 0 or T == 0:
        raise ValueError(f"x must have non-empty [B,T], got shape {tuple(x.shape)}")
    if T > 1 and bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        b, t = (doc_ids[:, 1:] < doc_ids[:, :-1]).nonzero()[0].tolist()
        raise ValueError(f"doc_ids must be non-decreasing along each row; decreases at row {b}, offset {t + 1}")
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"x must be a float or integer tensor, got dtype {x.dtype}")
    if x.is_floating_point():
        if not bool(torch.isfinite(x).all()):
            b, t = _first_bad(~torch.isfinite(x))
            raise ValueError(f"x has non-finite values at row {b}, offset {t}")
    elif need_vocab:
        if vocab_size is None:
            raise ValueError("x holds integer token ids: pass vocab_size so they can be perturbed")
        if int(vocab_size) < 2:
            raise ValueError(f"vocab_size must be >= 2 to perturb token ids, got {vocab_size}")
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}), got range [{lo}, {hi}]")
    return B, T


def _first_bad(bad: torch.Tensor) -> tuple[int, int]:
    """(row, offset) of the first True of a [B,T,...] bool tensor."""
    if bad.dim() > 2:
        bad = bad.flatten(2).any(-1)
    b, t = bad.nonzero()[0].tolist()
    return int(b), int(t)


def _check_output(y: Any, B: int, T: int, what: str) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"fn must return a torch.Tensor, got {type(y).__name__} ({what})")
    if y.dim() < 2 or tuple(y.shape[:2]) != (B, T):
        raise ValueError(f"fn output must be [B,T,...] with [B,T] = {(B, T)}, got shape {tuple(y.shape)} ({what})")
    if y.is_floating_point() or y.is_complex():
        bad = ~torch.isfinite(y)
        if bool(bad.any()):
            b, t = _first_bad(bad)
            raise ValueError(f"fn output is non-finite at row {b}, offset {t} ({what})")
    return y


def _default_tol(y0: torch.Tensor) -> float:
    """Relative to the output's own scale, with no floor: small outputs must not hide leaks.

    A leak-free mixer usually changes other documents' outputs by exactly zero (deterministic
    kernels, where-masking), so the tolerance only absorbs rounding noise.
    """
    scale = float(y0.detach().abs().max()) if y0.numel() else 0.0
    if y0.dtype in (torch.bfloat16, torch.float16):
        return 1e-3 * scale
    return 1e-6 * scale


def _change(y: torch.Tensor, y0: torch.Tensor) -> torch.Tensor:
    """|y - y0| reduced (amax) over trailing dims -> float64 [B,T]."""
    d = (y.detach().to(torch.float64) - y0.detach().to(torch.float64)).abs()
    if d.dim() > 2:
        d = d.flatten(2).amax(-1)
    return d


# ----------------------------------------------------------------------- perturbation


def perturb(
    values: torch.Tensor, *, scale: float, vocab_size: int | None, gen: torch.Generator
) -> torch.Tensor:
    """A copy of ``values`` in which every element is different (and the change is large)."""
    if values.is_floating_point():
        noise = torch.randn(values.shape, generator=gen, dtype=torch.float64)
        # at least half a unit of scale away, so low-precision rounding cannot eat it
        noise = torch.where(noise >= 0, noise + 0.5, noise - 0.5) * scale
        noise = noise.to(device=values.device)
        new = (values.to(torch.float64) + noise).to(values.dtype)
        same = new == values
        if bool(same.any()):
            # huge |x| relative to the scale in a low-precision dtype: move proportionally
            bump = (values.to(torch.float64).abs() * 0.5 + scale) * noise.sign()
            new = torch.where(same, (values.to(torch.float64) + bump).to(values.dtype), new)
        if bool((new == values).any()) or not bool(torch.isfinite(new).all()):
            raise RuntimeError("could not perturb every element of x to a different finite value")
        return new
    assert vocab_size is not None
    offset = torch.randint(1, vocab_size, values.shape, generator=gen, dtype=torch.int64).to(values.device)
    new = ((values.to(torch.int64) + offset) % vocab_size).to(values.dtype)
    assert bool((new != values).all())
    return new


def _noise_scale(x: torch.Tensor) -> float:
    if not x.is_floating_point():
        return 0.0
    std = float(x.detach().to(torch.float64).std()) if x.numel() > 1 else 0.0
    if not math.isfinite(std):
        std = 0.0
    return std + 1.0


def _segments(doc_ids: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(row, start, end, doc_id) of every contiguous document segment, row-major."""
    ids = doc_ids.detach().cpu()
    B, T = ids.shape
    segs: list[tuple[int, int, int, int]] = []
    for b in range(B):
        row = ids[b]
        starts = [0] + (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        ends = starts[1:] + [T]
        for s, e in zip(starts, ends):
            segs.append((b, int(s), int(e), int(row[s])))
    return segs


def _spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), deterministic, including both ends."""
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


# ---------------------------------------------------------------------------- checks


def check_leaks(
    fn: Mixer,
    x: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    vocab_size: int | None = None,
    tol: float | None = None,
    causal_positions: Sequence[int] | None = None,
    max_docs: int | None = None,
    seed: int = 0,
    cross_doc: bool = True,
    causal: bool = True,
    allow_vacuous: bool = False,
) -> LeakReport:
    """Perturb whole documents and single positions of ``x``; report the worst leak.

    Cross-doc: each (row, document) segment (at most ``max_docs``, spread evenly) is
    perturbed as a whole; any output change outside that segment, in any row, is a
    leak. Causal: each position in ``causal_positions`` (default: all positions for
    T <= 256, else 64 spread positions including 0 and T-1) is perturbed in every row
    at once; any change at an earlier position is a leak. ``fn`` must be
    deterministic (put modules in ``eval()``); this is checked.

    A perturbation changes every element it touches: token ids move by a random
    nonzero offset mod ``vocab_size``; hidden states get Gaussian noise pushed at least
    half of (std(x) + 1) away from zero, so rounding cannot absorb it. A change at an
    output is max |y - y0| over its feature dims, and it counts, as a leak or as
    dependence, only when it exceeds ``tol`` (default: 1e-6 of max |y0|, 1e-3 in
    bf16/fp16; 0 when y0 is all zero). One threshold for both means a check that
    counts a document as depended on could also have seen a leak of that size.

    Dependence (can the check fail?): a probed document is *depended on* when some
    perturbation of it moves an output of that same document: its whole-document
    perturbation (cross-doc), or a causal probe at t moving an output at or after t
    in t's document, in that row. A document none of whose probes does so is
    *ignored*; if no perturbation moves any output at all, the output is *constant*.
    Either makes the check vacuous: with no leak found, it raises
    :class:`VacuousCheckError` naming the documents (or saying the output is constant),
    unless ``allow_vacuous=True``, which returns a report that says VACUOUS. A check
    that finds a leak reports FAIL either way. Single causal probes that move nothing
    at or after themselves are listed in ``report.dependence.inert_probes`` but are
    not an error: a previous-token mixer legitimately ignores a document's last token,
    and the leak promise holds trivially for an input nothing reads. (A causal probe
    perturbs every row at once, so a batch-mixing fn can look dependent there; the
    cross-doc check catches it as a leak.)
    """
    B, T = _validate(x, doc_ids, vocab_size, need_vocab=True)
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be >= 1 or None, got {max_docs}")
    if tol is not None and not (tol >= 0):
        raise ValueError(f"tol must be >= 0, got {tol}")
    if causal_positions is None:
        if T <= _DEFAULT_CAUSAL_ALL_UP_TO:
            positions = list(range(T))
        else:
            positions = _spread(T, _DEFAULT_CAUSAL_SAMPLES)
    else:
        positions = sorted({int(p) for p in causal_positions})
        bad = [p for p in positions if not 0 <= p < T]
        if bad:
            raise ValueError(f"causal_positions must lie in [0, T={T}), got {bad}")
    if not cross_doc and not (causal and positions):
        raise ValueError(
            "nothing to check: cross_doc=False and the causal check is off or has no positions "
            f"(causal={causal}, causal_positions={positions})"
        )

    gen = torch.Generator().manual_seed(seed)
    scale = _noise_scale(x)
    doc_cpu = doc_ids.detach().cpu()
    segs = _segments(doc_ids)
    # seg_of[b, t]: index into segs of the document segment holding (b, t)
    seg_of = torch.empty(B, T, dtype=torch.int64)
    for i, (row, start, end, _) in enumerate(segs):
        seg_of[row, start:end] = i
    probed: set[int] = set()
    own_response: dict[int, float] = {}  # segment index -> largest own-document change seen
    largest = 0.0
    inert: list[tuple[int, int]] = []

    def saw(i: int, own: float) -> None:
        probed.add(i)
        own_response[i] = max(own_response.get(i, 0.0), own)

    with torch.no_grad():
        y0 = _check_output(fn(x, doc_ids), B, T, "unperturbed run")
        y0 = y0.detach().clone()  # fn may return a view of a buffer it later mutates
        if tol is None:
            tol = _default_tol(y0)
        again = _change(_check_output(fn(x, doc_ids), B, T, "repeated unperturbed run"), y0)
        if float(again.max()) > tol:
            b, t = _first_bad(again == again.max())
            raise ValueError(
                f"fn is not deterministic: two identical calls differ by {float(again.max()):.1e} "
                f"at row {b}, offset {t} (dropout? call .eval())"
            )

        worst_cd: Violation | None = None
        n_docs = 0
        if cross_doc:
            chosen = range(len(segs)) if max_docs is None else _spread(len(segs), max_docs)
            for i in chosen:
                row, start, end, doc = segs[i]
                xp = x.clone()
                xp[row, start:end] = perturb(x[row, start:end], scale=scale, vocab_size=vocab_size, gen=gen)
                what = f"after perturbing doc {doc} (row {row}, offsets {start}:{end})"
                d = _change(_check_output(fn(xp, doc_ids), B, T, what), y0).cpu()
                n_docs += 1
                largest = max(largest, float(d.max()))
                saw(i, float(d[row, start:end].max()))
                d[row, start:end] = 0.0
                mag = float(d.max())
                if mag > 0 and (worst_cd is None or mag > worst_cd.magnitude):
                    b, t = _first_bad(d == mag)
                    worst_cd = Violation(
                        kind="cross_doc", magnitude=mag, row=b, out_pos=t,
                        src_row=row, src_pos=start, src_doc=doc, out_doc=int(doc_cpu[b, t]),
                    )

        worst_ca: Violation | None = None
        n_pos = 0
        if causal:
            offsets = torch.arange(T)
            for t_src in positions:
                xp = x.clone()
                xp[:, t_src] = perturb(x[:, t_src], scale=scale, vocab_size=vocab_size, gen=gen)
                what = f"after perturbing offset {t_src} in every row"
                d = _change(_check_output(fn(xp, doc_ids), B, T, what), y0).cpu()
                n_pos += 1
                largest = max(largest, float(d.max()))
                # own response of each row's probe: outputs at or after t_src in t_src's document
                own_mask = (seg_of == seg_of[:, t_src : t_src + 1]) & (offsets >= t_src)
                own = torch.where(own_mask, d, torch.zeros_like(d)).amax(1)
                for b in range(B):
                    saw(int(seg_of[b, t_src]), float(own[b]))
                    if float(own[b]) <= tol:
                        inert.append((b, t_src))
                d = d[:, :t_src]
                if d.numel() == 0:
                    continue
                mag = float(d.max())
                if mag > 0 and (worst_ca is None or mag > worst_ca.magnitude):
                    b, t = _first_bad(d == mag)
                    worst_ca = Violation(
                        kind="causal", magnitude=mag, row=b, out_pos=t,
                        src_row=b, src_pos=t_src, src_doc=None, out_doc=int(doc_cpu[b, t]),
                    )

    responding = [own_response[i] for i in probed if own_response[i] > tol]
    ignored = tuple(
        DocSpan(row=segs[i][0], doc=segs[i][3], start=segs[i][1], end=segs[i][2])
        for i in sorted(probed)
        if own_response[i] <= tol
    )
    report = LeakReport(
        cross_doc=worst_cd, causal=worst_ca, tol=float(tol),
        n_docs_perturbed=n_docs, n_positions_perturbed=n_pos,
        dependence=Dependence(
            docs_probed=len(probed), ignored=ignored, weakest=min(responding) if responding else None,
            largest_change=largest, inert_probes=tuple(inert), n_causal_probes=n_pos * B,
        ),
        allow_vacuous=bool(allow_vacuous),
    )
    if report.vacuous and not report.leaked and not allow_vacuous:
        raise VacuousCheckError(report)
    return report


def assert_no_leaks(fn: Mixer, x: torch.Tensor, doc_ids: torch.Tensor, **kw: Any) -> LeakReport:
    """:func:`check_leaks`, raising AssertionError with the report if a leak exceeds tol.

    A vacuous check raises :class:`VacuousCheckError` (from check_leaks) unless
    ``allow_vacuous=True`` is passed through ``kw``.
    """
    report = check_leaks(fn, x, doc_ids, **kw)
    if not report.passed:
        raise AssertionError(str(report))
    return report


# ------------------------------------------------------------------------- influence


def _first_embedding(fn: Any) -> nn.Embedding | None:
    if not isinstance(fn, nn.Module):
        return None
    for m in fn.modules():
        if isinstance(m, nn.Embedding):
            return m
    return None


def _jacobian_influence(
    fn: Mixer, x: torch.Tensor, doc_ids: torch.Tensor, row: int, embedding: nn.Embedding | None
) -> torch.Tensor:
    """[T,T] Frobenius norms of d y[row,t] / d in[row,s]; ``in`` is x or the embedding output."""
    B, T = doc_ids.shape
    handle = None
    if embedding is None:
        wrt = x.detach().clone().requires_grad_(True)
        inputs = (wrt, doc_ids)
    else:
        # Discover the embedding output's shape/dtype, then add a zero probe to it.
        seen: list[torch.Tensor] = []
        h = embedding.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
        try:
            with torch.no_grad():
                fn(x, doc_ids)
        finally:
            h.remove()
        if len(seen) != 1:
            raise ValueError(
                f"the first nn.Embedding of fn ran {len(seen)} times per forward; the embedding-probe "
                "Jacobian needs exactly one call. Pass method=\"perturbation\""
            )
        e = seen[0]
        if e.dim() < 2 or tuple(e.shape[:2]) != (B, T) or not e.is_floating_point():
            raise ValueError(
                f"the first nn.Embedding of fn returned shape {tuple(e.shape)} dtype {e.dtype}, "
                f"expected float [B,T,...] with [B,T] = {(B, T)}. Pass method=\"perturbation\""
            )
        wrt = torch.zeros_like(e).requires_grad_(True)
        handle = embedding.register_forward_hook(lambda m, i, o: o + wrt)
        inputs = (x, doc_ids)

    try:
        with torch.enable_grad():
            y = _check_output(fn(*inputs), B, T, "jacobian run")
    finally:
        if handle is not None:
            handle.remove()
    if not y.is_floating_point():
        raise ValueError(f"method=\"jacobian\" needs a floating-point output, got {y.dtype}")

    acc_dtype = torch.float64 if torch.float64 in (y.dtype, wrt.dtype) else torch.float32
    sq = torch.zeros(T, T, dtype=acc_dtype)
    yr = y[row].reshape(-1)  # [T*F], output-position major
    n_out = yr.numel()
    F_out = n_out // T
    if not yr.requires_grad:
        return sq.sqrt()

    def grads_of(basis: torch.Tensor) -> torch.Tensor:
        """[N, T_in, D_in] gradients of the rows of ``basis`` (cotangents of yr) w.r.t. wrt[row]."""
        try:
            (g,) = torch.autograd.grad(
                yr, wrt, grad_outputs=basis, is_grads_batched=True, retain_graph=True, allow_unused=True
            )
        except RuntimeError as err:
            # some op has no batching rule for its backward: one cotangent at a time, said out loud
            warnings.warn(
                f"influence_matrix: batched backward failed ({str(err).splitlines()[0][:120]}); "
                f"taking {basis.shape[0]} backward passes one at a time",
                RuntimeWarning,
                stacklevel=3,
            )
            parts = []
            for v in basis:
                (gi,) = torch.autograd.grad(yr, wrt, grad_outputs=v, retain_graph=True, allow_unused=True)
                parts.append(torch.zeros_like(wrt) if gi is None else gi)
            g = torch.stack(parts)
        if g is None:
            return torch.zeros(basis.shape[0], T, 1, dtype=acc_dtype)
        return g[:, row].reshape(basis.shape[0], T, -1)

    chunk = max(1, min(n_out, _GRAD_ELEMS_PER_CHUNK // max(1, wrt.numel())))
    for lo in range(0, n_out, chunk):
        hi = min(n_out, lo + chunk)
        basis = torch.zeros(hi - lo, n_out, dtype=yr.dtype, device=yr.device)
        basis[torch.arange(hi - lo), torch.arange(lo, hi)] = 1
        g = grads_of(basis).detach().to(device="cpu", dtype=acc_dtype)
        contrib = g.pow(2).sum(-1)  # [N, T_in]
        t_idx = torch.arange(lo, hi) // F_out  # output position of each cotangent
        sq.index_add_(0, t_idx, contrib)
    return sq.sqrt()


def _perturbation_influence(
    fn: Mixer, x: torch.Tensor, doc_ids: torch.Tensor, row: int, vocab_size: int | None, seed: int
) -> torch.Tensor:
    B, T = doc_ids.shape
    gen = torch.Generator().manual_seed(seed)
    scale = _noise_scale(x)
    out = torch.zeros(T, T, dtype=torch.float64)
    with torch.no_grad():
        y0 = _check_output(fn(x, doc_ids), B, T, "unperturbed run").detach().clone()
        for s in range(T):
            xp = x.clone()
            xp[row, s] = perturb(x[row, s], scale=scale, vocab_size=vocab_size, gen=gen)
            y = _check_output(fn(xp, doc_ids), B, T, f"after perturbing row {row}, offset {s}")
            out[:, s] = _change(y, y0)[row].cpu()
    return out


def influence_matrix(
    fn: Mixer,
    x: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    row: int = 0,
    method: str = "auto",
    vocab_size: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """[T,T] influence of input position s (columns) on output position t (rows) in ``row``.

    A correct doc-masked causal mixer gives a block-diagonal, lower-triangular matrix
    (see :func:`influence_violation`); the picture shows *where* a leak comes from.

    ``method="jacobian"``: entry [t, s] = ||d y[row,t] / d in[row,s]||_F, exact, by
    batched autograd w.r.t. the full x (float inputs) or w.r.t. a zero probe added
    to the output of the first ``nn.Embedding`` of ``fn`` (token-id inputs).
    ``method="perturbation"``: entry [t, s] = max |y - y0| at t after perturbing x[row, s]
    (any input; token ids need ``vocab_size``). ``method="auto"``: the Jacobian where
    it is available, else ValueError (never a silent switch to perturbation).

    Returns a CPU tensor, float32 (float64 when x / the output / the embedding is float64).
    """
    B, T = _validate(x, doc_ids, vocab_size, need_vocab=(method == "perturbation"))
    if not -B <= row < B:
        raise ValueError(f"row must be in [0, B={B}), got {row}")
    row = row % B
    if method not in ("auto", "jacobian", "perturbation"):
        raise ValueError(f"method must be 'auto', 'jacobian' or 'perturbation', got {method!r}")
    if method == "perturbation":
        res = _perturbation_influence(fn, x, doc_ids, row, vocab_size, seed)
        keep64 = x.dtype == torch.float64
    else:
        embedding = None
        if not x.is_floating_point():
            embedding = _first_embedding(fn)
            if embedding is None:
                raise ValueError(
                    f"method={method!r} on integer token ids needs fn to be an nn.Module containing an "
                    "nn.Embedding (the Jacobian is taken w.r.t. its output); pass method=\"perturbation\" "
                    "(with vocab_size) instead"
                )
        res = _jacobian_influence(fn, x, doc_ids, row, embedding)
        keep64 = res.dtype == torch.float64
    return res.to(torch.float64 if keep64 else torch.float32).cpu()


def influence_violation(matrix: torch.Tensor, doc_ids_row: torch.Tensor) -> dict[str, float]:
    """Largest influence that crosses documents (``off_block``), looks ahead (``upper``), overall (``total``).

    A leak-free mixer has off_block == upper == 0 and total > 0.
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix must be [T,T], got shape {tuple(matrix.shape)}")
    ids = doc_ids_row.detach().cpu()
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    T = matrix.shape[0]
    if ids.dim() != 1 or ids.shape[0] != T:
        raise ValueError(f"doc_ids_row must be [T] with T={T}, got shape {tuple(doc_ids_row.shape)}")
    m = matrix.detach().cpu().to(torch.float64).abs()
    cross = ids[:, None] != ids[None, :]
    ahead = torch.ones(T, T, dtype=torch.bool).triu(1)

    def mx(mask: torch.Tensor) -> float:
        return float(m[mask].max()) if bool(mask.any()) else 0.0

    return {"off_block": mx(cross), "upper": mx(ahead), "total": float(m.max()) if m.numel() else 0.0}


def plot_influence(
    matrix: torch.Tensor, doc_ids_row: torch.Tensor, *, ax: Any = None, title: str | None = None
) -> Any:
    """Heat map of log10 influence (output t down, input s across) with document boundaries.

    Leaks show up as colour above the diagonal (look-ahead) or outside the diagonal
    blocks (cross-document). Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt  # lazy: the harness itself must not need matplotlib

    m = matrix.detach().cpu().to(torch.float64).abs()
    ids = doc_ids_row.detach().cpu().reshape(-1)
    if m.dim() != 2 or m.shape[0] != m.shape[1] or ids.numel() != m.shape[0]:
        raise ValueError(f"need a [T,T] matrix and [T] doc_ids_row, got {tuple(m.shape)} and {tuple(doc_ids_row.shape)}")
    peak = float(m.max()) if m.numel() else 0.0
    tiny = max(peak * 1e-12, 1e-300) if peak > 0 else 1e-12
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.imshow(torch.log10(m + tiny).numpy(), origin="upper", interpolation="nearest", cmap="viridis")
    ax.figure.colorbar(im, ax=ax, label="log10 influence")
    T = ids.numel()
    if T > 1:
        for b in (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist():
            ax.axhline(b - 0.5, color="white", linewidth=0.6)
            ax.axvline(b - 0.5, color="white", linewidth=0.6)
    ax.set_xlabel("input position s")
    ax.set_ylabel("output position t")
    ax.set_title(title if title is not None else "influence of input s on output t (log10)")
    return ax
