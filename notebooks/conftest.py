"""nbval's run over the notebooks (`make test`: `pytest --nbval-lax notebooks -n 2 --dist loadfile
--no-loadscope-reorder`): the notebooks start heaviest first, so that the two workers end together instead of one
running a long notebook alone at the end.

How loadfile deals them, and the stable sort of whole files: megacpp_lab/testing/ordering.py (tests/conftest.py
orders the unit tests by the same helper). A notebook not named here runs after these, in path order.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from megacpp_lab.testing.ordering import heaviest_first

    heaviest_first(items, HEAVIEST_FIRST, ".ipynb")  # only the notebooks' cells move (a run over tests/ keeps its own)
