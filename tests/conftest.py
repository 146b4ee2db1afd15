import os

import torch

# Triton kernels run under the interpreter on CPU; it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def sample_leak_reports():
    """The leak harness on 2 real packed rows of the byte sample (24 tokens, a document boundary at 9),
    a fixed 32-wide embedding in front of `layer(x, doc_ids)`: (the report with doc_ids, the control with
    doc_ids withheld). The mixer tests assert on both."""
    from megacpp_lab.data import boundary_windows, load_sample
    from megacpp_lab.testing import check_leaks

    def run(layer, device):
        w = boundary_windows(load_sample()[0].batch, 2, 24, lead=9)
        torch.manual_seed(0)
        emb = torch.nn.Embedding(259, 32).to(device)
        tokens, doc_ids = w.tokens.to(device), w.doc_ids.to(device)
        report = check_leaks(lambda t, d: layer(emb(t), d), tokens, doc_ids, vocab_size=259,
                             causal_positions=range(0, 24, 2))  # fmt: skip
        leaky = check_leaks(lambda t, d: layer(emb(t), None), tokens, doc_ids, vocab_size=259, causal=False)
        return report, leaky

    return run
