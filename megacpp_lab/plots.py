"""Plots shared by the benchmark commands and the notebooks: receipts in, matplotlib Axes out."""

from __future__ import annotations

from collections.abc import Sequence
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


LABEL_X = 1.03  # axes fraction of the label column's left edge (right of the axes)


def plot_grid(receipt: dict[str, Any], metric: str = "ms", *, ax: Any = None, title: str | None = None) -> Any:
    """Grouped horizontal bars: one group per grid point (rows carry a `point` label), one bar per contender, with
    the p20-p80 spread as error bars where the rows hold `<metric>_p20` / `<metric>_p80`."""
    import matplotlib.pyplot as plt

    rows = [r for r in receipt["results"] if "point" in r and metric in r]
    if not rows:
        raise ValueError(f"receipt {receipt['name']!r} has no grid rows with metric {metric!r}")
    points = list(dict.fromkeys(r["point"] for r in rows))
    names = list(dict.fromkeys(r["contender"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.3 * len(points) * len(names) + 1.5))
    height = 0.8 / len(names)
    for j, name in enumerate(names):
        ys, vals, lo, hi = [], [], [], []
        for i, point in enumerate(points):
            row = next((r for r in rows if r["point"] == point and r["contender"] == name), None)
            if row is None:
                continue
            ys.append(i + j * height)
            vals.append(row[metric])
            lo.append(row[metric] - row.get(f"{metric}_p20", row[metric]))
            hi.append(row.get(f"{metric}_p80", row[metric]) - row[metric])
        ax.barh(ys, vals, height=height, xerr=[lo, hi], capsize=2, label=name)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(points))], points, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"{metric} (log)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title or f"{receipt['name']} ({receipt['dtype']})\n{receipt['device']}", fontsize=9)
    return ax


def segments_cross(p1: tuple[float, float], p2: tuple[float, float], q1: tuple[float, float], q2: tuple[float, float]) -> bool:
    """Whether segments p1-p2 and q1-q2 cross at a point inside both (touching ends do not count)."""

    def side(a: tuple[float, float], b: tuple[float, float], c: tuple[float, float]) -> float:
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    return side(p1, p2, q1) * side(p1, p2, q2) < 0 and side(q1, q2, p1) * side(q1, q2, p2) < 0


def label_points(
    ax: Any, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str], *, min_gap: float = 0.06, fontsize: int = 7
) -> list[Any]:
    """Label scatter points from a column right of the axes, one leader line per point.

    Points that sit close together (a common case: contenders of one receipt at almost the same
    memory) would get overlapping labels if each label sat beside its point. Here the labels keep the
    points' vertical order, are spaced at least `min_gap` apart (in axes fractions), and each is joined
    to its point by a line, whatever the data. Call it after the axes limits are final.
    """
    if not len(xs) == len(ys) == len(labels):
        raise ValueError(f"xs, ys and labels must have one entry per point, got {len(xs)}, {len(ys)}, {len(labels)}")
    if not min_gap > 0:
        raise ValueError(f"min_gap must be > 0 (an axes fraction), got {min_gap}")
    if min_gap * (len(labels) - 1) > 1:
        raise ValueError(f"min_gap={min_gap} cannot fit {len(labels)} labels into the axes height")
    ax.get_xlim(), ax.get_ylim()  # settle pending autoscaling before reading the data-to-axes transform
    to_axes = ax.transAxes.inverted()
    pts = [tuple(float(c) for c in to_axes.transform(ax.transData.transform((x, y)))) for x, y in zip(xs, ys)]
    order = sorted(range(len(pts)), key=lambda i: pts[i][1])
    placed = [min(max(pts[i][1], 0.0), 1.0) for i in order]
    for k in range(1, len(placed)):  # bottom to top: a label that would crowd the one below moves up
        placed[k] = max(placed[k], placed[k - 1] + min_gap)
    if placed:  # top to bottom: labels pushed past the top move down (the guard above makes them fit)
        placed[-1] = min(placed[-1], 1.0)
        for k in range(len(placed) - 2, -1, -1):
            placed[k] = min(placed[k], placed[k + 1] - min_gap)
    # a point far right of the others can still cross a neighbour's leader line: swap the two labels'
    # slots (uncrossing shortens the lines' total length, so this ends)
    swapped = True
    while swapped:
        swapped = False
        for a in range(len(order)):
            for b in range(a + 1, len(order)):
                if segments_cross(pts[order[a]], (LABEL_X, placed[a]), pts[order[b]], (LABEL_X, placed[b])):
                    order[a], order[b], swapped = order[b], order[a], True
    texts = []
    for i, y_text in zip(order, placed):
        texts.append(ax.annotate(
            labels[i], xy=(xs[i], ys[i]), xycoords="data", xytext=(LABEL_X, y_text), textcoords="axes fraction",
            fontsize=fontsize, va="center", ha="left", annotation_clip=False,
            arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6, shrinkA=0, shrinkB=3),
        ))  # fmt: skip
    return texts


def plot_rope_receipt(receipt: dict[str, Any], *, ax: Any = None) -> Any:
    """Achieved GB/s of every contender per kernel, with the bar (a share of copy bandwidth) of each kernel."""
    import matplotlib.pyplot as plt

    share = receipt["bar"]["pct_of_copy"] / 100.0
    kernels = list(dict.fromkeys(r["kernel"] for r in receipt["results"]))
    names = list(dict.fromkeys(r["contender"] for r in receipt["results"]))
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        by_kernel = {r["kernel"]: r["gb_per_s"] for r in receipt["results"] if r["contender"] == name}
        vals = [by_kernel.get(k, 0.0) for k in kernels]  # a contender measured for some kernels only
        ax.bar([j + i * width for j in range(len(kernels))], vals, width, label=name)
    for j, k in enumerate(kernels):
        copy = next(r["gb_per_s"] for r in receipt["results"] if r["kernel"] == k and r["contender"].startswith("copy"))
        ax.hlines(share * copy, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="dashed",
                  label=f"{share:.0%} of copy (the bar)" if j == 0 else None)  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kernels))], kernels, rotation=15)
    ax.set(ylabel="GB/s (bytes the kernel must move / time)", title=f"RoPE kernels, {receipt['device']}")
    # outside the axes: inside, any corner covers bars that reach the bar line
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.figure.tight_layout()
    return ax


def save_figure(ax: Any, path: Any, *, dpi: int = 110) -> Any:
    """Lay out, save and close the figure that holds ax; returns the path (for a receipt's PNG)."""
    import matplotlib.pyplot as plt

    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=dpi)
    plt.close(ax.figure)
    return path
