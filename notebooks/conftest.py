"""nbval's run over the notebooks (`make test`: `pytest --nbval-lax notebooks -n 2 --dist loadfile
--no-loadscope-reorder`): the notebooks start heaviest first, so that the two workers end together instead of one
running a long notebook alone at the end.

pytest-xdist's loadfile (with --no-loadscope-reorder: without it xdist deals the files by their count of cells, most
first, and this order breaks only ties) deals each worker one file, and the next whenever at most two of its cells are
pending. Each notebook's cells keep their order (a stable sort of whole notebooks); a notebook not named here runs
after these, in path order.
"""

from __future__ import annotations

import pytest

# Seconds of each notebook's cells under nbval at 9dc2768 on the 2-core CI-like machine (two workers, one OpenMP
# thread each, another job on the same cores): 06 482, 01 160, 03 133, 04 77, 07 68, 02 48, 13 44, 09 40, 12 36,
# 10 28, 08 23 (00, 05, 11: under 20 s each); 1173 s in all. In path order 06 started seventh and its worker ended
# ~100 s after the other (simulated from those seconds: 635 s against 538); in this order, 586 s each. 04 comes
# before 03 so that the worker dealt 06 is dealt the lighter of the two.
HEAVIEST_FIRST = (
    "06_training_and_profiling",
    "01_ssd_scan",
    "04_mla",
    "03_m2rnn",
    "07_activation_memory",
    "02_engram",
    "13_sparse_attention_and_mtp",
    "09_scale_out",
    "12_mixture_of_experts",
    "10_upstream_tripwires",
    "08_loss_and_memory",
)


def _rank(item: pytest.Item) -> int:
    stem = item.path.stem
    return HEAVIEST_FIRST.index(stem) if stem in HEAVIEST_FIRST else len(HEAVIEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # only the notebooks' cells move, among the places they hold (a run over tests/ as well keeps its tests in place)
    slots = [i for i, item in enumerate(items) if item.path.suffix == ".ipynb"]
    for slot, item in zip(slots, sorted((items[i] for i in slots), key=_rank)):
        items[slot] = item
