"""HybridLM: the config fails closed naming the field, presets are sized as named, the forward gives a loss
and logits, it learns, it keeps documents apart and is causal for every block kind and branch (a planted
leak fails), mHC at init equals the plain model, and mixed precision keeps the fp32 contract."""

from __future__ import annotations

import copy

import pytest
import torch

from megacpp_lab.data import boundary_windows, load_sample
from megacpp_lab.model.config import HybridConfig, hybrid_preset
from megacpp_lab.model.hybrid import HybridLM
from megacpp_lab.model.parallelize import ParallelConfig, parallelize
from megacpp_lab.model.precision import check_precision, fp32_contract
from megacpp_lab.testing import model_leak_report, wake_zero_initialised
from megacpp_lab.varlen import build_context

# CPU: the M2RNN reference loop asked for by name (kernel="auto" would fall back with a loud warning)
CPU = dict(m2rnn=dict(kernel="reference"))
V = 512  # the tiny preset's vocab


def tiny(**overrides) -> HybridConfig:
    return hybrid_preset("tiny", **{**CPU, **overrides})


def _model(seed: int = 0, **overrides) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(tiny(**overrides)).eval()


@pytest.fixture(scope="module")
def window():
    """Real packed BPE rows: 2 windows of 24 tokens with a document boundary 9 tokens in, ids folded into
    the tiny vocab."""
    w = boundary_windows(load_sample(tokenizer="bpe")[0].batch, 2, 24, lead=9)
    return w.tokens.long() % V, w.doc_ids


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("pattern", "AMX", r"a non-empty string of block letters from \('A', 'M', 'R', 'E'\)"),
        ("pattern", "", "a non-empty string of block letters"),
        ("pattern", ["A"], "a non-empty string of block letters"),
        ("engram_layers", (4,), r"layer indices in \[0, n_layers=4\)"),
        ("ngram_layers", (0, 0), "unique layer indices"),
        ("cblock_layers", "-1", r"layer indices in \[0, n_layers=4\)"),
        ("n_layers", 0, "an int >= 1"),
        ("vocab_size", True, "an int >= 1"),
        ("mhc", "yes", "a bool"),
        ("mlp_ratio", 0, r"a number in \(0, 64\]"),
        ("norm_eps", 0.0, r"a float in \(0, 1\)"),
        ("pad_id", 512, r"a token id in \[0, vocab_size=512\)"),
        ("mla", 3, "a MLAConfig, a dict of its fields, or None"),
    ],
)
def test_config_fails_closed_naming_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf"HybridConfig\.{field} must be {allowed}"):
        tiny(**{field: value})


def test_config_sub_configs_are_built_by_their_own_builders_and_fail_closed():
    cfg = tiny(ssd=dict(state_dim=8))
    assert cfg.ssd.state_dim == 8 and cfg.ssd.n_heads == 4 and cfg.ssd.d_model == 64  # merged into the preset's
    assert cfg.lm_head.vocab_size == V and cfg.ngram.vocab_size == V and cfg.ngram.pad_id == 2
    with pytest.raises(ValueError, match=r"HybridConfig\.ssd: SSDConfig\.n_groups must be"):
        tiny(ssd=dict(n_groups=3))
    with pytest.raises(ValueError, match=r"HybridConfig\.mla: MLAConfig has no field\(s\) \['bogus'\]"):
        tiny(mla=dict(bogus=1))
    other = HybridConfig.build(vocab_size=V, d_model=32, n_layers=2).mla
    with pytest.raises(ValueError, match=r"HybridConfig\.mla must be a MLAConfig with d_model=64"):
        tiny(mla=other)
    with pytest.raises(ValueError, match=r"HybridConfig has no field\(s\) \['bogus'\]"):
        HybridConfig.build(vocab_size=V, d_model=64, n_layers=2, bogus=1)
    with pytest.raises(ValueError, match="hybrid preset must be one of"):
        hybrid_preset("huge")
    assert tiny(n_layers=6, pattern="amr").blocks == "AMRAMR"


def test_config_keeps_the_mhc_without_engram_layers_tripwire():
    with pytest.warns(UserWarning, match="default to all 4 layers"):
        assert tiny(engram_layers=None, mhc=True).engram_layers == (0, 1, 2, 3)
    with pytest.raises(ValueError, match=r"HybridConfig\.engram_layers must be non-empty when mhc=True"):
        tiny(engram_layers=(), mhc=True)


def test_presets_are_sized_as_named():
    assert HybridLM(tiny()).num_parameters()["total"] < 2_000_000
    sizes = {}
    for name in ("small", "base"):
        with torch.device("meta"):
            sizes[name] = HybridLM(hybrid_preset(name)).num_parameters()
    assert 35e6 < sizes["small"]["total"] < 65e6, sizes["small"]
    base = hybrid_preset("base")
    assert (base.n_layers, base.d_model, base.pattern) == (12, 1024, "AMRM")
    assert 150e6 < sizes["base"]["total"] < 400e6, sizes["base"]
    counts = sizes["base"]
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total")
    assert {"A", "M", "R", "embedding", "lm_head", "engram"} <= set(counts)


def test_the_stack_preset_holds_every_block_kind_and_counts_active_parameters():
    config = hybrid_preset("stack")
    assert set(config.blocks) == {"A", "M", "R", "E"} and config.mhc and config.engram_layers
    # the seeds' attention layout: A ranks both dense MLA and DSA, and an MTP module (dense MLA)
    assert config.dsa_layers and set(config.dsa_layers) < {i for i, k in enumerate(config.blocks) if k == "A"}
    assert config.mtp_depth == 1
    with torch.device("meta"):
        model = HybridLM(config)
    counts, active = model.num_parameters(), model.active_parameters()
    moe = config.moe
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts_" in n)
    assert experts == config.blocks.count("E") * moe.n_experts * 3 * config.d_model * moe.expert_hidden
    assert active == counts["total"] - experts + experts * moe.top_k // moe.n_experts
    assert 450e6 < counts["total"] < 650e6 and 250e6 < active < 350e6, (counts["total"], active)
    assert counts["mtp"] > 0 and model.blocks[8].mixer.indexer is not None and model.blocks[0].mixer.indexer is None
    flops = model.flops_per_token(4096)
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")


def test_the_m_block_is_mamba3_by_default_and_mamba2_one_flag_away():
    from megacpp_lab.nn.mamba3 import Mamba3
    from megacpp_lab.nn.ssm import SSD

    for preset in ("tiny", "small", "base"):
        assert hybrid_preset(preset).m_block == "mamba3"
    assert type(HybridLM(tiny()).blocks[1].mixer) is Mamba3
    assert type(HybridLM(tiny(m_block="mamba2")).blocks[1].mixer) is SSD
    mimo = HybridLM(tiny(mamba3=dict(mimo_rank=4)))
    assert mimo.blocks[1].mixer.mimo_x.shape == (4, 4, 16)
    # the state update and readout: R times the FLOPs of one rank, per M layer
    extra = lambda m: m.flops_per_token(64)["M"] - 6 * m.num_parameters()["M"]  # noqa: E731
    assert extra(mimo) == 4 * extra(HybridLM(tiny()))
    with pytest.raises(ValueError, match=r"HybridConfig.m_block must be one of \('mamba3', 'mamba2'\)"):
        tiny(m_block="mamba4")


def test_flops_per_token_by_block_kind():
    model = HybridLM(tiny(cblock_layers=(3,)))
    f1, f2 = model.flops_per_token(256), model.flops_per_token(512)
    assert f1["total"] == sum(v for k, v in f1.items() if k != "total")
    assert f2["A"] > f1["A"] and f2["M"] == f1["M"] and f2["R"] == f1["R"]  # only attention grows with T
    params = model.num_parameters()
    assert f1["lm_head"] == 6 * params["lm_head"] and "embedding" not in f1  # a lookup, not a matmul
    assert f1["M"] > 6 * params["M"] and f1["cblock"] > 0


def _keys_by_mask(doc_ids: torch.Tensor, top_k: int | None = None) -> float:
    """The keys a token attends on average, counted from the dense document-causal mask itself."""
    T = doc_ids.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])
    per_query = allowed.sum(-1)
    if top_k is not None:
        per_query = per_query.clamp(max=top_k)
    return per_query.double().mean().item()


@pytest.mark.parametrize("top_k", [None, 1, 5, 64])
def test_attended_keys_equal_a_count_over_the_document_causal_mask(top_k):
    from megacpp_lab.model.hybrid import attended_keys
    from megacpp_lab.varlen import doc_ids_from_cu_seqlens, packed_cu_seqlens

    g = torch.Generator().manual_seed(3)
    for B, T, docs in ((1, 64, 1), (2, 64, 5), (3, 40, 17), (1, 128, 64)):
        cu = packed_cu_seqlens(B, T, docs, g)
        doc_ids = doc_ids_from_cu_seqlens(cu, B, T)
        lens = build_context(doc_ids).doc_lengths
        assert sum(lens) == B * T and len(lens) == B * docs
        assert attended_keys(lens, top_k=top_k) == pytest.approx(_keys_by_mask(doc_ids, top_k), rel=1e-12)
    assert attended_keys([4]) == 2.5 and attended_keys([4], top_k=2) == 1.75


def test_flops_per_token_counts_attention_per_document_and_the_upper_bound_without_them():
    model = HybridLM(tiny())
    a = model.config.mla
    per_key = 3 * 2 * a.n_heads * (a.d_nope + a.d_rope + a.d_v)
    T = 1024
    bound, one_doc = model.flops_per_token(T), model.flops_per_token(T, doc_lens=[T])
    eight = model.flops_per_token(T, doc_lens=[128] * 8)
    n_a = model.config.blocks.count("A")
    # the row's triangle counts T / 2 keys a token, one document of T tokens (T + 1) / 2: the diagonal too
    assert one_doc["A"] - bound["A"] == round(n_a * per_key / 2)
    # eight equal documents: (128 + 1) / 2 keys a token against (1024 + 1) / 2; nothing else changes
    assert one_doc["A"] - eight["A"] == n_a * per_key * (1025 - 129) // 2
    assert all(eight[k] == bound[k] for k in bound if k not in ("A", "total"))
    assert eight["total"] == sum(v for k, v in eight.items() if k != "total")
    for bad in ([], [0, T], [T + 1]):
        with pytest.raises(ValueError, match="flops_per_token doc_lens"):
            model.flops_per_token(T, doc_lens=bad)


# ----------------------------------------------------------------------------- forward and training


def test_forward_gives_a_finite_loss_and_logits_when_asked(window):
    tokens, doc_ids = window
    model, ctx = _model(ngram_layers=(2,), cblock_layers=(3,)), build_context(doc_ids)
    out = model(tokens, ctx, tokens.roll(-1, 1))
    assert out.loss is not None and torch.isfinite(out.loss) and out.logits is None
    out = model(tokens, ctx, tokens.roll(-1, 1), return_logits=True)
    assert out.logits.shape == (2, 24, V) and torch.isfinite(out.logits).all()
    with pytest.raises(ValueError, match="ctx is for"):
        model(tokens[:, :12], ctx)


def test_loss_decreases_over_a_few_steps(window):
    tokens, doc_ids = window
    model, ctx = _model().train(), build_context(doc_ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(tokens, ctx, tokens.roll(-1, 1)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


# ----------------------------------------------------------------------------- leaks


LEAK_CASES = {
    "A": dict(pattern="A", n_layers=2, engram_layers=()),
    "M": dict(pattern="M", n_layers=2, engram_layers=()),
    "M-mimo": dict(pattern="M", n_layers=2, engram_layers=(), mamba3=dict(mimo_rank=2)),
    "M-mamba2": dict(pattern="M", n_layers=2, engram_layers=(), m_block="mamba2"),
    "R": dict(pattern="R", n_layers=2, engram_layers=()),
    "engram": dict(pattern="AMR", n_layers=3, engram_layers=(0, 2)),
    "ngram": dict(pattern="MR", n_layers=2, engram_layers=(), ngram_layers=(1,)),
    "mhc": dict(pattern="AMR", n_layers=3, engram_layers=(1,), mhc=True),
    "cblock": dict(pattern="RA", n_layers=2, engram_layers=(), cblock_layers=(0,)),
}


@pytest.mark.parametrize("case", list(LEAK_CASES))
def test_whole_model_keeps_documents_apart_and_is_causal(window, case):
    tokens, doc_ids = window
    model = wake_zero_initialised(_model(**LEAK_CASES[case]))
    report = model_leak_report(model, tokens, doc_ids, vocab_size=V, causal_positions=range(0, 24, 3))
    assert report.passed, str(report)


@pytest.mark.parametrize("kind, m_block", [("A", "mamba3"), ("M", "mamba3"), ("M", "mamba2"), ("R", "mamba3")])
def test_a_planted_leak_fails_the_whole_model_check(window, kind, m_block):
    """One mixer that drops ctx (so sees the packed row as one document) makes the model leak."""
    tokens, doc_ids = window
    model = _model(pattern=kind, n_layers=2, engram_layers=(), m_block=m_block)
    mixer = model.blocks[1].mixer
    forward = mixer.forward
    mixer.forward = lambda x, ctx=None, **kw: forward(x)  # the planted bug: ctx dropped
    report = model_leak_report(model, tokens, doc_ids, vocab_size=V, causal=False)
    assert report.leaked and report.cross_doc.magnitude > report.tol, str(report)


def test_capacity_routing_fails_the_whole_model_check(window):
    """An E block with capacity-limited routing: whether a token reaches its experts depends on the other tokens
    of the batch (other documents, later positions), so the model leaks; dropless routing (the default, the
    "E" case above) does not."""
    tokens, doc_ids = window
    moe = dict(n_experts=4, top_k=2, expert_hidden=32, capacity_factor=0.5)
    model = wake_zero_initialised(_model(pattern="EA", n_layers=2, engram_layers=(), moe=moe))
    report = model_leak_report(model, tokens, doc_ids, vocab_size=V, causal_positions=range(0, 24, 3))
    assert report.leaked and report.cross_doc.magnitude > report.tol, str(report)
    assert report.causal is not None and report.causal.magnitude > report.tol, str(report)


# ----------------------------------------------------------------------------- mHC at init, precision


def test_mhc_at_init_equals_the_model_without_mhc(window):
    tokens, doc_ids = window
    ctx = build_context(doc_ids)
    layers = dict(pattern="AMR", n_layers=3, engram_layers=(0, 2))
    plain = _model(**layers)
    streams = _model(**layers, mhc=True)
    missing, unexpected = streams.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".hc." in k for k in missing)
    assert streams.num_parameters()["mhc"] > 0
    a = plain(tokens, ctx, return_logits=True).logits
    b = streams(tokens, ctx, return_logits=True).logits
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_mixed_precision_keeps_every_declared_fp32_param_fp32(window):
    model = _model(ngram_layers=(2,), cblock_layers=(3,), mhc=True)
    declared = fp32_contract(model)
    assert any("A_log" in n for n in declared) and any(".hc." in n for n in declared)
    assert any("bank.weight" in n for n in declared)
    assert "blocks.0.mixer.rope_cos" in declared and "blocks.0.mixer.rope_sin" in declared  # MLA's RoPE tables
    parallelize(model, ParallelConfig(dtype="bf16"))
    check_precision(model, model.precision_plan)
    params = dict(model.named_parameters())
    assert all(params[n].dtype == torch.float32 for n in declared if n in params)
    assert params["blocks.0.mlp.w_down.weight"].dtype == torch.bfloat16


# ----------------------------------------------------------------------------- the GPU: small preset, Triton paths


@pytest.mark.cuda
@pytest.mark.parametrize("features", [False, True], ids=["preset", "mhc-ngram-cblock"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_small_model_on_gpu_keeps_documents_apart_with_triton_scans(compiled, features):
    """The whole-model leak check at the small preset on real packed BPE rows (2 x 512 tokens), bf16, the SSD
    and M2RNN scans on Triton by name, eager and with every block compiled on its own (fullgraph)."""
    from torch._dynamo.utils import counters

    from megacpp_lab.bench.model import whole_model_leak_check
    from megacpp_lab.model.parallelize import block_structures, compile_stats

    torch._dynamo.reset()
    counters.clear()
    report, config = whole_model_leak_check("small", "cuda", compiled=compiled, features=features)
    if compiled:  # one graph per block structure, none added by the ~70 perturbed calls of the check
        structures = block_structures(HybridLM(config))
        stats = compile_stats()
        assert stats.graphs == len(structures) and stats.graph_breaks == 0, (stats, structures)
    assert (config.mamba3.kernel, config.m2rnn.kernel, config.d_model, config.n_layers) == ("triton", "triton", 384, 12)
    assert config.m_block == "mamba3"
    # attn_impl 'auto': the A blocks attend through flex over the documents' block mask here
    assert HybridLM(config).blocks[0].mixer.attends_through_flex(torch.device("cuda"))
    assert config.mhc == features and bool(config.cblock_layers) == features
    assert report.passed, str(report)
    assert report.n_docs_perturbed >= 4 and report.dependence.weakest > 10 * report.tol


@pytest.mark.cuda
def test_a_planted_leak_fails_the_small_model_check_on_gpu():
    """On the GPU too the check can fail: an M2RNN mixer that drops ctx leaks across documents."""
    from megacpp_lab.bench.harness import build_model
    from megacpp_lab.model.config import model_config
    from megacpp_lab.bench.model import leak_windows

    config = model_config("small", "cuda")
    model = build_model(config, "cuda").eval()
    mixer = model.blocks[2].mixer
    assert model.blocks[2].kind == "R"
    forward = mixer.forward
    mixer.forward = lambda x, ctx=None, **kw: forward(x)  # the planted bug: ctx dropped
    tokens, doc_ids = leak_windows("cuda")
    report = model_leak_report(model, tokens, doc_ids, vocab_size=config.vocab_size, causal=False)
    assert report.leaked and report.cross_doc.magnitude > report.tol, str(report)


def test_wake_moves_every_zero_initialised_parameter_and_a_leak_inside_a_branch_then_shows(window):
    """A leak inside a zero-initialised branch is invisible at init (the branch adds exactly zero); once the
    zero-initialised parameters are woken the same check catches it."""
    tokens, doc_ids = window
    layers = dict(pattern="AMR", n_layers=3, engram_layers=(1,), ngram_layers=(2,), cblock_layers=(0,), mhc=True)
    model = _model(**layers)
    zero = {n for n, p in model.named_parameters() if not p.any()}
    assert {"blocks.1.engram.out_proj.weight", "blocks.2.ngram.value_proj.weight", "blocks.0.cblock.out_proj.weight",
            "blocks.1.hc.mixer.weight"} <= zero
    wake_zero_initialised(model)
    assert all(p.any() for p in model.parameters())
    results = {}
    for woken in (False, True):
        leaky = _model(**layers)
        engram = leaky.blocks[1].engram
        forward = engram.forward
        engram.forward = lambda x, ctx=None, **kw: forward(x)  # the planted bug: Engram drops ctx
        if woken:
            wake_zero_initialised(leaky)
        results[woken] = model_leak_report(leaky, tokens, doc_ids, vocab_size=V, causal=False, allow_vacuous=True)
    assert not results[False].leaked, str(results[False])
    assert results[True].leaked and results[True].cross_doc.magnitude > results[True].tol, str(results[True])


def test_device_kernels_is_the_one_rule_for_the_scans_kernels():
    """Triton on a GPU; on a CPU the chunked SSD and the M2RNN reference loop, but the Triton scans when the
    model is compiled (a graph holds the scans' custom ops, never the loops); the fused Triton loss only on a
    GPU. train, profile and the bench harness all read it through model_config(..., compiled=)."""
    from megacpp_lab.model.config import device_kernels, model_config

    gpu, cpu, compiled = device_kernels("cuda"), device_kernels("cpu"), device_kernels("cpu", compiled=True)
    assert (gpu["ssd"]["kernel"], gpu["m2rnn"]["kernel"], gpu["lm_head"]["loss_impl"]) == ("triton", "triton", "triton")
    assert (cpu["ssd"]["kernel"], cpu["m2rnn"]["kernel"], cpu["lm_head"]["loss_impl"]) == ("chunked", "reference", "eager")
    assert (compiled["ssd"]["kernel"], compiled["m2rnn"]["kernel"], compiled["lm_head"]["loss_impl"]) == ("triton", "triton", "eager")
    config = model_config("tiny", "cpu", compiled=True)
    assert (config.ssd.kernel, config.m2rnn.kernel) == ("triton", "triton")
    assert model_config("tiny", "cpu", compiled=True, ssd=dict(kernel="chunked")).ssd.kernel == "chunked"  # an override wins
    # a layer override without a kernel keeps the device's kernel for that layer (it once fell back to "auto")
    for device, compiled, kernel in (("cuda", False, "triton"), ("cpu", True, "triton"), ("cpu", False, "chunked")):
        config = model_config("tiny", device, compiled=compiled, mamba3=dict(mimo_rank=2))
        assert (config.mamba3.kernel, config.mamba3.mimo_rank) == (kernel, 2), (device, compiled)
    # a GPU named with its index, or as a torch.device, is a GPU: it once got the CPU's reference loops
    for device in ("cuda:0", "cuda:1", torch.device("cuda", 0)):
        assert device_kernels(device) == gpu, device
    assert device_kernels(torch.device("cpu")) == cpu
    for device in ("gpu", "CUDA", "meta"):  # not a device the kernels run on: refused, never read as a CPU
        with pytest.raises(ValueError, match=f"device_kernels device: .*{device!r}"):
            model_config("tiny", device)
