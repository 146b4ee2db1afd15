"""The lab's source in every compile cache key (megacpp_lab/source_key.py: source_digest, compile_cache_tag):
torch's FX-graph and AOTAutograd caches key a graph by its operators, not by the Python autograd formulas behind the
lab's custom ops, so without the tag an edited backward was served from a cache written by the old code."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megacpp_lab
from megacpp_lab import source_key
from megacpp_lab.model.parallelize import model_fingerprint


def test_source_digest_changes_with_any_file_of_the_package_and_its_name(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    package = Path(megacpp_lab.__file__).resolve().parent
    copy = tmp_path / "megacpp_lab"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    monkeypatch.setattr(source_key, "__file__", str(copy / "source_key.py"))
    seen = {source_key.source_digest()}
    assert seen == {source_key.source_digest()}  # the same files, the same digest
    kernel = copy / "kernels" / "mamba3.py"  # where the custom ops' backward formulas are
    kernel.write_text(kernel.read_text() + "\n# an edit\n")
    seen.add(source_key.source_digest())
    kernel.rename(copy / "kernels" / "mamba3_renamed.py")  # the same bytes under another name
    seen.add(source_key.source_digest())
    (copy / "kernels" / "ab.py").write_text("b")  # "ab.py" + "b" against "a.py" + "bb": the parts are delimited
    seen.add(source_key.source_digest())
    (copy / "kernels" / "ab.py").unlink()
    (copy / "kernels" / "a.py").write_text("bb")
    seen.add(source_key.source_digest())
    assert len(seen) == 5
    monkeypatch.undo()
    assert source_key.compile_cache_tag() == f"megacpp_lab-{source_key.source_digest()[:16]}"


def test_a_changed_tag_misses_the_autograd_cache_an_unchanged_one_hits(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """End to end, as the stale backward was served: AOTAutogradCache saves a compiled forward and backward, a new
    compile with the same tag loads them, one with another tag (older source) does not."""
    from torch._dynamo.utils import counters

    assert source_key.compile_cache_tag() in torch.compiler.config.cache_key_tag.split("+")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, requires_grad=True)

    def step() -> None:
        torch._dynamo.reset()
        torch.compile(lambda v: (v.sin() * 2).sum(), backend="inductor", fullgraph=True)(x).backward()

    with torch._functorch.config.patch(enable_autograd_cache=True), torch._inductor.config.patch(fx_graph_cache=True):
        counters.clear()
        step()
        assert counters["aot_autograd"]["autograd_cache_saved"] == 1, dict(counters["aot_autograd"])
        step()
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
        with torch.compiler.config.patch(cache_key_tag="megacpp_lab-0000000000000000"):
            step()
        assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
        assert counters["aot_autograd"]["autograd_cache_miss"] == 2, dict(counters["aot_autograd"])
    torch._dynamo.reset()


@pytest.mark.parametrize("torch_first", [False, True], ids=["lab, then torch", "torch, then lab"])
def test_a_users_tag_stays_and_an_inherited_lab_tag_is_replaced(torch_first: bool) -> None:
    imports = "import torch, megacpp_lab" if torch_first else "import megacpp_lab, torch"
    code = f"{imports}; megacpp_lab.source_key.tag_compile_caches(); print(torch.compiler.config.cache_key_tag)"  # twice: idempotent
    env = {**os.environ, source_key.COMPILE_CACHE_TAG_ENV: "mine+megacpp_lab-0123456789abcdef"}  # a parent's, older
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"mine+{source_key.compile_cache_tag()}"]


def test_model_fingerprint_includes_the_source_digest(monkeypatch) -> None:  # noqa: ANN001
    lm = torch.nn.Linear(2, 2)
    lm.config = {"d_model": 2}  # what model_fingerprint reads of a HybridLM beside its parameters' device
    before = model_fingerprint(lm)
    monkeypatch.setattr("megacpp_lab.model.parallelize.source_digest", lambda: "0" * 64)
    assert model_fingerprint(lm) != before
