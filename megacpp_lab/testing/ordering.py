"""The order `make test` deals its files in: heaviest first (tests/conftest.py's unit-test files, notebooks/conftest.py's
notebooks, each with its own measured list).

pytest-xdist's loadfile (with --no-loadscope-reorder: without it xdist deals the files by their count of tests, most
first, and this order breaks only ties) deals each worker one file, and the next whenever at most two of its tests
are pending: the heaviest files first let the two workers end together instead of one running a long file alone at
the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

__all__ = ["heaviest_first"]


def heaviest_first(items: list[pytest.Item], heaviest: Sequence[str], suffix: str) -> None:
    """Reorder `items` in place: the items of files with `suffix` ('.py', '.ipynb') move among the places such items
    hold, files named (by stem) in `heaviest` first in its order, then the rest in their order; each file's items
    keep their order (a stable sort of whole files), and items of other files stay where they are."""
    rank = {stem: i for i, stem in enumerate(heaviest)}
    slots = [i for i, item in enumerate(items) if item.path.suffix == suffix]
    moved = sorted((items[i] for i in slots), key=lambda item: rank.get(item.path.stem, len(rank)))
    for slot, item in zip(slots, moved):
        items[slot] = item
