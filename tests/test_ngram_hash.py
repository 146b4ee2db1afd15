"""Hashed n-gram memory: hashing, doc isolation, store path, statistics, compile."""

import pytest
import torch
from torch import nn

from megacpp_lab.data import ByteTokenizer, PackedBatch, boundary_windows, load_sample
from megacpp_lab.nn.ngram_hash import (
    NgramHashConfig,
    NgramHashMemory,
    distinct_primes,
    hash_statistics,
    is_prime,
    layer_multipliers,
    ngram_row_ids,
)
from megacpp_lab.nn.table_store import InProcessBackend
from megacpp_lab.testing import check_leaks
from megacpp_lab.varlen import build_context, positions_from_doc_ids

TOK = ByteTokenizer()
CFG = NgramHashConfig(vocab_size=259, d_model=32, pad_id=TOK.pad_id, max_ngram=4,
                      heads_per_order=2, table_size=1009, head_dim=8)


def _real_rows(T: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    w = boundary_windows(load_sample()[0].batch, 2, T, lead=T // 2)
    return w.tokens, w.doc_ids


def test_tables_are_distinct_primes_per_head():
    sizes = CFG.table_sizes
    assert len(sizes) == CFG.num_heads == 6
    assert all(is_prime(p) and p >= 1009 for p in sizes) and len(set(sizes)) == 6
    assert sizes == tuple(sorted(sizes)) and distinct_primes(10, 3) == (11, 13, 17)


def test_multipliers_are_odd_and_per_layer():
    m0, m1 = layer_multipliers(CFG, 0), layer_multipliers(CFG, 1)
    assert (m0 % 2 == 1).all() and (m1 % 2 == 1).all() and not torch.equal(m0, m1)
    assert torch.equal(m0, layer_multipliers(CFG, 0))


def test_row_ids_match_a_pure_python_reference():
    tokens = torch.randint(0, 256, (2, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20])
    ids = ngram_row_ids(tokens, positions_from_doc_ids(doc_ids), CFG, layer_id=2)
    m = layer_multipliers(CFG, 2).tolist()
    assert ids.shape == (2, 20, 6)
    for b in range(2):
        for t in range(20):
            start = max(i for i in range(t + 1) if i == 0 or doc_ids[b, i] != doc_ids[b, i - 1])
            ctx = lambda i: int(tokens[b, t - i]) if t - i >= start else TOK.pad_id
            for h, p in enumerate(CFG.table_sizes):
                n = CFG.orders[h // CFG.heads_per_order]
                mix = 0
                for i in range(n):
                    mix ^= ctx(i) * m[i]
                assert int(ids[b, t, h]) == mix % p


def test_no_ngram_spans_a_document_boundary():
    tokens, doc_ids = _real_rows()
    ids = lambda tok, pos: ngram_row_ids(tok, pos, CFG, 0).double()
    assert check_leaks(lambda tok, d: ids(tok, build_context(d).positions), tokens, doc_ids, vocab_size=259).passed
    leaky = check_leaks(lambda tok, d: ids(tok, None), tokens, doc_ids, vocab_size=259, causal=False)
    assert not leaky.passed and leaky.cross_doc.out_doc == leaky.cross_doc.src_doc + 1
    # a document's first n-gram is (pad, ..., pad, token), the same as for that document alone
    r, start = 0, PackedBatch.from_doc_ids(tokens, doc_ids).segments(0)[1][1]
    alone = ngram_row_ids(tokens[r : r + 1, start:], None, CFG, 0)
    assert torch.equal(ngram_row_ids(tokens, positions_from_doc_ids(doc_ids), CFG, 0)[r : r + 1, start:], alone)


def _memory(seed: int = 0) -> NgramHashMemory:
    torch.manual_seed(seed)
    mem = NgramHashMemory(CFG, layer_id=1)
    nn.init.normal_(mem.value_proj.weight, std=0.2)  # on purpose: the zero init makes check_leaks refuse (vacuous)
    return mem


def test_memory_is_identity_at_init_and_learns_tables():
    mem = NgramHashMemory(CFG, layer_id=0)
    tokens, doc_ids = _real_rows()
    h = torch.randn(2, 128, 32)
    y = mem(h, tokens, ctx=build_context(doc_ids))
    assert y.abs().max() == 0
    (y * torch.randn_like(y)).sum().backward()
    assert mem.value_proj.weight.grad.abs().max() > 0


def test_memory_passes_leak_harness_on_real_rows_and_fails_without_a_context():
    tokens, doc_ids = _real_rows()
    mem = _memory().double()
    emb = nn.Embedding(259, 32).double()
    fn = lambda tok, d: mem(emb(tok), tok, ctx=build_context(d))
    report = check_leaks(fn, tokens, doc_ids, vocab_size=259, causal_positions=range(0, 128, 3))
    assert report.passed, str(report)
    leaky = check_leaks(lambda tok, d: mem(emb(tok), tok, ctx=None), tokens, doc_ids, vocab_size=259, causal=False)
    assert not leaky.passed


def test_store_lookup_path_equals_parameter_path():
    mem = _memory()
    tokens, doc_ids = _real_rows()
    ctx = build_context(doc_ids)
    h = torch.randn(2, 128, 32)
    store = mem.make_store(InProcessBackend())
    assert store.get_store_keys()[0] == "engram:l1:h0" and store.get_num_heads() == 6
    ids = mem.row_ids(tokens, ctx.positions)
    rows = store.lookup(ids)
    assert rows.shape == (2, 128, 6, 8)
    assert torch.equal(rows[:, :, 3], mem.head_tables()[3][ids[:, :, 3]])
    assert torch.allclose(mem(h, tokens, ctx=ctx, store=store), mem(h, tokens, ctx=ctx), atol=1e-6)
    with pytest.raises(ValueError, match="already exist"):
        mem.make_store(store.backend)  # create-only: the same layer cannot be populated twice


def test_memory_rejects_out_of_vocab_tokens_and_bad_shapes():
    mem = _memory()
    tokens = torch.randint(0, 256, (1, 16))
    tokens[0, 9] = 300
    with pytest.raises(ValueError, match=r"token id 300 at row 0, offset 9"):
        mem(torch.randn(1, 16, 32), tokens)
    with pytest.raises(ValueError, match="NgramHashMemory needs h"):
        mem(torch.randn(1, 16, 31), tokens.clamp(max=255))


def test_hash_statistics_on_real_cpp():
    rows, _ = load_sample()
    tokens, positions = rows.batch.tokens[:4], build_context(rows.batch.doc_ids[:4]).positions
    stats = hash_statistics(tokens, positions, CFG, layer_id=0)
    assert len(stats) == CFG.num_heads
    for s in stats:
        assert s["rows_hit"] <= min(s["distinct_ngrams"], s["table_size"])
        assert 0 <= s["collision_rate"] < 1 and 0 < s["occupancy"] <= 1
        assert s["tokens"] == 4 * rows.batch.seq_len
    # higher orders see more distinct n-grams in real code
    by_order = {s["order"]: s["distinct_ngrams"] for s in stats}
    assert by_order[2] < by_order[3] < by_order[4]
    # a table far larger than the data has (almost) no collisions, a tiny one many
    big = NgramHashConfig(**{**CFG.__dict__, "table_size": 1_000_003})
    small = NgramHashConfig(**{**CFG.__dict__, "table_size": 101})
    assert max(s["collision_rate"] for s in hash_statistics(tokens, positions, big, 0)) < 0.01
    assert min(s["collision_rate"] for s in hash_statistics(tokens, positions, small, 0)) > 0.5


def test_memory_compiles_without_graph_breaks():
    mem = _memory()
    tokens, doc_ids = _real_rows()
    explained = torch._dynamo.explain(mem)(torch.randn(2, 128, 32), tokens, ctx=build_context(doc_ids))
    assert explained.graph_break_count == 0


@pytest.mark.cuda
def test_memory_on_gpu_bf16_matches_fp32_and_store_on_gpu():
    mem = _memory().cuda()
    tokens, doc_ids = _real_rows(T=512)
    tokens, ctx = tokens.cuda(), build_context(doc_ids).to("cuda")  # built and checked on the host, then moved
    h = torch.randn(2, 512, 32, device="cuda")
    ref = mem(h, tokens, ctx=ctx)
    store = mem.make_store(InProcessBackend(device="cuda"))
    assert torch.allclose(mem(h, tokens, ctx=ctx, store=store), ref, atol=1e-5)
    out = mem.to(torch.bfloat16)(h.bfloat16(), tokens, ctx=ctx)
    assert ((out.float() - ref).norm() / ref.norm()) < 3e-2


def test_memory_refuses_another_layers_store():
    other = NgramHashMemory(CFG, layer_id=0)
    store = other.make_store()
    mem = _memory()  # layer 1, same table sizes
    tokens, doc_ids = _real_rows()
    with pytest.raises(ValueError, match="store holds layer 0's tables, this is layer 1"):
        mem(torch.randn(2, 128, 32), tokens, ctx=build_context(doc_ids), store=store)


def test_out_of_vocab_tokens_fail_under_compile_too():
    mem = _memory()
    tokens = torch.randint(0, 256, (1, 16))
    tokens[0, 3] = -7
    with pytest.raises(ValueError, match="token id -7 at row 0, offset 3"):
        ngram_row_ids(tokens, None, CFG, 0)
    compiled = torch.compile(mem, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="token id outside"):
        compiled(torch.randn(1, 16, 32), tokens)


def test_doc_ids_going_backwards_fail_in_build_context_and_the_memory_takes_only_a_context():
    mem = _memory()
    tokens, h = torch.randint(0, 256, (1, 8)), torch.randn(1, 8, 32)
    backwards = torch.tensor([[0, 0, 1, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"doc_ids go backwards at row 0, offset 3: 1 -> 0"):
        mem(h, tokens, ctx=build_context(backwards))  # fails by name on the host, before the layer runs
    with pytest.raises(ValueError, match=r"doc_ids dtype must be int32 or int64, got torch.float32"):
        mem(h, tokens, ctx=build_context(backwards.float()))
    with pytest.raises(TypeError, match=r"ctx must be a PackedContext .* got Tensor"):
        mem(h, tokens, ctx=backwards)  # bare doc_ids are not a context: never read unchecked
    with pytest.raises(TypeError, match="positional argument"):
        mem(h, tokens, backwards)  # nor taken positionally, as the old forward(h, tokens, doc_ids) did
    with pytest.raises(ValueError, match=r"ctx is for \[B,T\] = \(1, 7\), the input is \(1, 8\)"):
        mem(h, tokens, ctx=build_context(torch.zeros(1, 7, dtype=torch.int64)))


@pytest.mark.parametrize("bad", [dict(seed=2**60), dict(seed=0.5), dict(head_dim=True)])
def test_ngram_config_rejects_values_that_would_fail_later(bad):
    with pytest.raises(ValueError, match="NgramHashConfig"):
        NgramHashConfig(**{**CFG.__dict__, **bad})


@pytest.mark.parametrize("layer_id", [-1, 1.0, True])
def test_memory_layer_id_is_an_int_at_least_0(layer_id):
    with pytest.raises(ValueError, match=r"layer_id must be an int >= 0"):
        NgramHashMemory(CFG, layer_id=layer_id)
