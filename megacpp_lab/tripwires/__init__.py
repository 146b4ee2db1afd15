"""Upstream regression packs as tripwires: one runnable reproducer per fixed bug, with a sentinel.

Each pack is a bug that once crashed or silently corrupted a training run upstream (../shared/seeds/
upstream-packs-tilelang-megatron.txt). Its reproducer runs here, prints `BUG FIRED` or `FIXED` with the
versions it ran on, and compares what it saw with what was measured on the pinned versions, so that a change
in either direction (a lab fix reverted, a new tilelang release) fails a test that names the pack.

- Packs 08 and 13 (TileLang lowering) need the optional `tripwires` extra and no GPU: the kernels are lowered
  for an sm_90 CUDA target to source, in a subprocess (`tilelang_packs.py`);
- packs 10, 11, 12 and 16 check the lab's own fixes of the Megatron-side bugs (`lab_packs.py`).

`run_packs()` runs them; `megacpp-lab tripwires` prints them; notebooks/10_upstream_tripwires.ipynb shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FIXED", "BUG_FIRED", "NOT_RUN", "PACKS", "Case", "Pack", "PackResult", "run_pack", "run_packs", "status_table"]

FIXED, BUG_FIRED, NOT_RUN = "FIXED", "BUG FIRED", "NOT RUN"


@dataclass(frozen=True)
class Case:
    """One configuration a reproducer ran: what happened, and what the pinned versions gave."""

    name: str
    outcome: str  # e.g. "lowered" or "error: <message>" (TileLang), "ok" or what went wrong (lab packs)
    expected: str
    detail: str = ""  # the measured facts, one line
    tma_copies: bool | None = None  # TileLang packs: whether the lowered CUDA source holds TMA copies

    @property
    def as_expected(self) -> bool:
        return self.outcome == self.expected


@dataclass(frozen=True)
class PackResult:
    """A pack's run: its sentinel, its cases, the versions and target it ran on, and any deviation from the pin."""

    pack: str  # "08", "10", ...
    title: str
    sentinel: str  # FIXED, BUG_FIRED or NOT_RUN
    cases: tuple[Case, ...]
    versions: Mapping[str, str]
    target: str = "-"
    problems: tuple[str, ...] = ()  # why this run differs from the pinned behaviour, each naming the pack
    measured: Mapping[str, Any] = field(default_factory=dict)  # numbers the notebook plots

    @property
    def as_expected(self) -> bool:
        return self.sentinel != NOT_RUN and not self.problems and all(c.as_expected for c in self.cases)

    def deviations(self) -> list[str]:
        """Every way this run differs from the pinned behaviour, each line naming the pack."""
        out = list(self.problems)
        if self.sentinel == NOT_RUN:
            out.append(f"pack {self.pack} ({self.title}) did not run")
        out += [f"pack {self.pack} ({self.title}), case '{c.name}': expected {c.expected!r}, got {c.outcome!r}"
                for c in self.cases if not c.as_expected]  # fmt: skip
        return out

    def lines(self) -> list[str]:
        """The reproducer's printout: sentinel, versions and target first, then one line per case."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        out = [f"pack {self.pack} ({self.title}): {self.sentinel}", f"  versions: {versions}", f"  target: {self.target}"]
        for c in self.cases:
            mark = "" if c.as_expected else f"   <-- pinned: {c.expected}"
            out.append(f"  {c.name}: {c.outcome}{'; ' + c.detail if c.detail else ''}{mark}")
        out += [f"  ! {p}" for p in self.problems]
        return out


@dataclass(frozen=True)
class Pack:
    """A pack: its number, title, and the runner that returns its PackResult (what broke is in the runner's
    docstring and in notebook 10)."""

    number: str
    title: str
    run: Callable[[], list[PackResult]]  # one runner may serve several packs (the TileLang subprocess)


def _tilelang() -> list[PackResult]:
    from megacpp_lab.tripwires.tilelang_packs import run_tilelang_packs

    return run_tilelang_packs()


def _lab(name: str) -> Callable[[], list[PackResult]]:
    def run() -> list[PackResult]:
        from megacpp_lab.tripwires import lab_packs

        return [getattr(lab_packs, name)()]

    return run


PACKS: dict[str, Pack] = {
    "08": Pack("08", "TileLang TMA bulk copy, rank-3 shared memory", _tilelang),
    "13": Pack("13", "TileLang FloorMod divide-by-zero in LayoutInference", _tilelang),
    "10": Pack("10", "fused LM-head loss on an unsupported device", _lab("pack10_loss_fallback")),
    "11": Pack("11", "fused loss dropped from the hybrid model (rebase-miss)", _lab("pack11_fused_loss_wired")),
    "12": Pack("12", "DSA indexer score slab", _lab("pack12_indexer_slab")),
    "16": Pack("16", "blanket bf16 cast of fp32-contract parameters", _lab("pack16_fp32_contract")),
}


def run_packs(numbers: Iterable[str] | None = None) -> list[PackResult]:
    """Run the named packs (all by default), each runner once, in PACKS order."""
    wanted = list(PACKS) if numbers is None else [str(n).zfill(2) for n in numbers]
    unknown = [n for n in wanted if n not in PACKS]
    if unknown:
        raise ValueError(f"unknown pack(s) {unknown}; the packs are {list(PACKS)}")
    results: dict[str, PackResult] = {}
    done: set[Callable[[], list[PackResult]]] = set()
    for n in wanted:
        runner = PACKS[n].run
        if runner in done:
            continue
        done.add(runner)
        for r in runner():
            results[r.pack] = r
    return [results[n] for n in wanted]


def run_pack(number: str) -> PackResult:
    """Run one pack."""
    return run_packs([number])[0]


def status_table(results: Iterable[PackResult]) -> list[dict[str, str]]:
    """One row per pack: its sentinel, whether the run matches the pinned behaviour, and the versions."""
    return [{"pack": r.pack, "title": r.title, "sentinel": r.sentinel, "as pinned": "yes" if r.as_expected else "NO",
             "versions": ", ".join(f"{k} {v}" for k, v in r.versions.items())} for r in results]  # fmt: skip
