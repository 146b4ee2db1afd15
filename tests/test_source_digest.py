"""The lab's source in every compile cache key (megacpp_lab.source_digest, compile_cache_tag): torch's FX-graph and
AOTAutograd caches key a graph by its operators, not by the Python autograd formulas behind the lab's custom ops, so
without the tag an edited backward was served from a cache written by the old code."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

import megacpp_lab
from megacpp_lab.model.parallelize import model_fingerprint


def test_source_digest_hashes_every_python_file_of_the_package_by_path_and_bytes(tmp_path: Path) -> None:
    package = Path(megacpp_lab.__file__).resolve().parent
    files = sorted(package.rglob("*.py"))
    assert package / "kernels" / "mamba3.py" in files  # where the custom ops' backward formulas are
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    assert megacpp_lab.source_digest() == h.hexdigest()
    assert megacpp_lab.compile_cache_tag() == f"megacpp_lab-{h.hexdigest()[:16]}"


def test_the_tag_is_in_torchs_cache_key_and_changes_it() -> None:
    from torch._inductor.codecache import compiled_fx_graph_hash

    assert megacpp_lab.compile_cache_tag() in torch.compiler.config.cache_key_tag.split("+")
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Tanh()))
    x = [torch.randn(4)]
    key, _ = compiled_fx_graph_hash(gm, x, {}, [])
    assert compiled_fx_graph_hash(gm, x, {}, [])[0] == key  # the key is stable for the same graph and tag
    with torch.compiler.config.patch(cache_key_tag="megacpp_lab-0000000000000000"):  # older source
        assert compiled_fx_graph_hash(gm, x, {}, [])[0] != key


def test_a_users_tag_is_kept_when_the_lab_is_imported_before_torch() -> None:
    code = "import megacpp_lab, torch; print(torch.compiler.config.cache_key_tag)"
    env = {**os.environ, megacpp_lab.COMPILE_CACHE_TAG_ENV: "mine"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"mine+{megacpp_lab.compile_cache_tag()}"]


def test_model_fingerprint_includes_the_source_digest(monkeypatch) -> None:  # noqa: ANN001
    lm = torch.nn.Linear(2, 2)
    lm.config = {"d_model": 2}  # what model_fingerprint reads of a HybridLM beside its parameters' device
    before = model_fingerprint(lm)
    monkeypatch.setattr("megacpp_lab.model.parallelize.source_digest", lambda: "0" * 64)
    assert model_fingerprint(lm) != before
