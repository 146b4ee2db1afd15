"""Plots shared by the benchmark commands and the notebooks: receipts in, matplotlib Axes out."""

from __future__ import annotations

from typing import Any


def plot_contenders(receipt: dict[str, Any], metric: str = "ms", *, ax: Any = None, title: str | None = None) -> Any:
    """Horizontal bars of one metric for every contender of a receipt (same run, so comparable)."""
    import matplotlib.pyplot as plt

    rows = [r for r in receipt["results"] if metric in r and "shape" not in r]
    if not rows:
        raise ValueError(f"receipt {receipt['name']!r} has no contender with metric {metric!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    names = [r["contender"] + (f" ({r['inputs']} in)" if "inputs" in r else "") for r in rows]
    values = [r[metric] for r in rows]
    bars = ax.barh(names, values, color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], padding=3, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(metric)
    shape = ", ".join(f"{k}={v}" for k, v in receipt["shape"].items())
    ax.set_title(title or f"{receipt['name']} ({receipt['dtype']})\n{shape}\n{receipt['device']}", fontsize=9)
    return ax


def plot_sweep(
    receipt: dict[str, Any], x: str, metric: str = "ms", *, ax: Any = None, logy: bool = True, title: str | None = None
) -> Any:
    """One line per contender over a swept shape key (results rows carry their own `shape`)."""
    import matplotlib.pyplot as plt

    rows = [r for r in receipt["results"] if "shape" in r and metric in r]
    if not rows:
        raise ValueError(f"receipt {receipt['name']!r} has no sweep rows with metric {metric!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for contender in dict.fromkeys(r["contender"] for r in rows):
        pts = sorted((r["shape"][x], r[metric]) for r in rows if r["contender"] == contender)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=contender)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"{receipt['name']} ({receipt['dtype']})\n{receipt['device']}", fontsize=9)
    return ax


def save_figure(ax: Any, path: Any, *, dpi: int = 110) -> Any:
    """Lay out, save and close the figure that holds ax; returns the path (for a receipt's PNG)."""
    import matplotlib.pyplot as plt

    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=dpi)
    plt.close(ax.figure)
    return path
