"""`make test`'s two runs (unit tests, then the notebooks under nbval; pytest-xdist's loadfile over two workers) deal
their files heaviest first, so that the workers end together instead of one running a long file alone at the end.

loadfile deals each worker one file, and the next whenever at most two of its tests (or cells) are pending. Without
--no-loadscope-reorder, xdist (>= 3.5) deals the files by their count of tests, most first, and the order below would
only break ties. Within each kind (test files, notebooks) the files named here come first in this order, each file's
tests or cells in their own order (a stable sort of whole files); the rest follow in path order.
"""

from __future__ import annotations

import pytest

# Unit tests: seconds of each file's tests at a391a83 on the 2-core CI-like machine (two workers, one OpenMP thread
# each; 2405 s in all, the run 1263 s): cli 389, mamba3 242, memory_estimate 220, parallelize 184, memory_sweep 177,
# train 148, precompile 135, saved_graphs 124, fsdp 113, checkpointing 92, dsa_sparse 65, profile 63, recompiles 62.
# loadfile's rule simulated for two workers on the per-test seconds of a later three-worker run (slower: 3893 s in
# all): dealt by count of tests the workers end at 2029 and 1864 s, in this order at 1932 and 1960. A fresh-clone CI
# at 1210f8a ran the unit tests in 1129 s (1355 s at a391a83, in path-count order, on a machine of varying speed).
# Notebooks: seconds of each notebook's cells under nbval at 9dc2768 on that machine (two workers, one OpenMP thread
# each, another job on the same cores): 06 482, 01 160, 03 133, 04 77, 07 68, 02 48, 13 44, 09 40, 12 36, 10 28,
# 08 23 (00, 05, 11: under 20 s each); 1173 s in all.
HEAVIEST_FIRST = {
    ".py": ("test_cli", "test_mamba3", "test_memory_estimate", "test_parallelize", "test_memory_sweep", "test_train",
            "test_precompile", "test_saved_graphs", "test_fsdp", "test_checkpointing", "test_dsa_sparse",
            "test_profile", "test_recompiles"),
    ".ipynb": ("06_training_and_profiling", "01_ssd_scan", "04_mla", "03_m2rnn", "07_activation_memory", "02_engram",
               "13_sparse_attention_and_mtp", "09_scale_out", "12_mixture_of_experts", "10_upstream_tripwires",
               "08_loss_and_memory"),
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for suffix, names in HEAVIEST_FIRST.items():  # each kind moves only among the places it holds
        slots = [i for i, item in enumerate(items) if item.path.suffix == suffix]
        ranked = sorted((items[i] for i in slots), key=lambda item: names.index(s) if (s := item.path.stem) in names
                        else len(names))  # fmt: skip
        for slot, item in zip(slots, ranked):
            items[slot] = item
