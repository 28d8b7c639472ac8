"""Packed documents (and sliding windows) under context parallelism, in one process: the ring
and the all-gather, their ranks emulated by threads (test_context_parallel.ThreadRing), against
float64 attention with the block-diagonal causal mask, forward and backward; the block plan
(pairs sharing no document skipped, pieces of one document unmasked) and the per-rank work.

Documents cross every chunk boundary of the zigzag split (each of the 2·cp chunks is a rank's
edge), one spans several chunks, and one starts exactly on a chunk's first token.

The position ids are gathered once per microbatch's forward, not per layer nor again by a
recomputation: counted in one process, in the ledgers of the cp 4 and the hub cp 2 runs, and
in the planner's traffic.

Planted bugs this module catches (each seen failing with an assertion): a document start on a
rank's chunk edge dropped (its document merged into the one before), a ring block skipped
though its chunks shared a document (a long document's far key chunks), every layer gathering
the position ids again (one process: "assert (2 == 1)"; the cp 4 run's all_gather 8192 bytes
against 2048; the hub run's 1024 against 512), a tensor written in place taken for the one
gathered ("assert (2 == 3)"), the planner counting the gather per layer (4096 against 1024),
every layer planning its blocks again (the GPT: "assert [None, None] == [None]"; the Gemma
3: "assert [6, 6, None, None] == [6, None]"), the plans kept without their window ("assert [6]
== [6, None]"), the planner's search leaving the gather out ("Right contains 1 more item:
{'all_gather': 1024}").
"""
from __future__ import annotations

import math
import weakref

import pytest
import torch
from test_context_parallel import emulate_ranks
from tolerances import assert_fp32_close, fp64_atol, scale_of

from trainmesh.comm import Comm
from trainmesh.context_parallel import (
    ContextParallelAttention,
    apply_context_parallel,
    fused_available,
    ring_attention,
    shard_sequence,
)
from trainmesh.context_parallel.documents import (
    document_ids,
    gather_documents,
    plan_pair,
    rank_work,
)
from trainmesh.core.mesh import ParallelMesh

pytestmark = pytest.mark.timeout(60)


def positions_of(lengths: list[int]) -> torch.Tensor:
    """Position ids (s,) of documents of the given lengths packed in a row."""
    return torch.cat([torch.arange(n) for n in lengths])


def crossing_lengths(cp: int, c: int, seed: int) -> list[int]:
    """Document lengths filling 2·cp·c tokens: a start strictly inside every chunk (so a
    document crosses every chunk boundary), one document spanning three chunks, and one
    starting exactly on a chunk's first token (a rank's edge)."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * cp * c
    starts = {0, 3 * c}                                      # chunk 3 starts a document
    for chunk in range(2 * cp):
        if chunk in (0, 1, 2):                               # one document over chunks 0-2
            continue
        starts.add(chunk * c + 1 + int(torch.randint(c - 1, (1,), generator=g)))
    edges = sorted(starts) + [s]
    return [b - a for a, b in zip(edges, edges[1:])]


def reference(q, k, v, docs, window=None):
    """float64 attention with the mask j <= i, same document, i - j < window."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    allowed = (j <= i) & (docs.unsqueeze(-1) == docs.unsqueeze(-2))      # (b, s, s)
    if window is not None:
        allowed &= (i - j) < window
    return torch.softmax(s.masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1) @ v


def run_ring(q, k, v, dout, position_ids, cp, mode, fused=False, window=None):
    """(out, dq, dk, dv) of the whole sequence from ``cp`` emulated ranks, each holding its
    zigzag share of ``position_ids`` and gathering the documents as the model's attention does."""
    def body(r, ring):
        mine = [shard_sequence(t, r, cp, dim=2).detach().requires_grad_() for t in (q, k, v)]
        docs = gather_documents(shard_sequence(position_ids, r, cp, dim=1), ring)
        out = ring_attention(*mine, ring, mode=mode, fused=fused, documents=docs, window=window)
        out.backward(shard_sequence(dout, r, cp, dim=2))
        return (out.detach(), *(t.grad for t in mine))
    return emulate_ranks(cp, body)


def _check(cp, mode, position_ids, *, fused=False, window=None, heads=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s = position_ids.shape
    dtype = torch.float32 if fused else torch.float64
    q, k, v, dout = (torch.randn(b, heads, s, hd, generator=g, dtype=dtype) for _ in range(4))
    want = [t.clone().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*want, document_ids(position_ids), window)
    ref.backward(dout.double())
    got = run_ring(q, k, v, dout, position_ids, cp, mode, fused=fused, window=window)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, [ref.detach()] + [t.grad for t in want]):
        if fused:
            assert_fp32_close(a.double(), w, scale=scale_of([w]), terms=s * hd,
                              what=f"cp {cp} {mode} {name}")
        else:
            err, atol = float((a - w).abs().max()), fp64_atol(scale_of([w]), s)
            assert err <= atol, f"cp {cp} {mode}: {name} max error {err:.3e} > {atol:.3e}"


@pytest.mark.parametrize("cp,mode", [(2, "ring"), (4, "ring"), (2, "allgather"), (4, "allgather")])
def test_documents_crossing_every_boundary_equal_the_block_diagonal_mask(cp, mode):
    """Two rows packed differently (each row gets its own pieces), float64."""
    c = 6
    rows = [positions_of(crossing_lengths(cp, c, seed)) for seed in (0, 1)]
    _check(cp, mode, torch.stack(rows))


@pytest.mark.parametrize("cp", [2, 4])
def test_rows_packed_alike_and_grouped_query_heads(cp):
    """One packing shared by the batch's rows (pieces over all rows at once)."""
    c = 5
    row = positions_of(crossing_lengths(cp, c, 2))
    _check(cp, "ring", torch.stack([row, row, row]), seed=3)


@pytest.mark.skipif(not fused_available(torch.device("cpu")), reason="no fused CPU kernel with lse")
@pytest.mark.parametrize("window", [None, 7])
def test_fused_pieces_with_documents_and_a_window(window):
    c = 8
    row = positions_of(crossing_lengths(2, c, 4))
    _check(2, "ring", torch.stack([row, positions_of([5, 27])]), fused=True, window=window)


@pytest.mark.parametrize("cp,mode,window", [(2, "ring", 5), (4, "ring", 3), (4, "allgather", 9),
                                            (2, "ring", 40)])
def test_sliding_window_with_and_without_documents(cp, mode, window):
    """A window shorter than a chunk, longer than one, and longer than the sequence."""
    c = 6
    stream = torch.arange(2 * cp * c).unsqueeze(0)
    packed = positions_of(crossing_lengths(cp, c, 5)).unsqueeze(0)
    _check(cp, mode, torch.cat([stream, packed]), window=window)


def test_pairs_sharing_no_document_are_skipped_and_one_document_pieces_are_unmasked():
    c = 4
    docs = document_ids(positions_of([3, 6, 7]).unsqueeze(0))   # docs: 1x3, 2x6, 3x7 over 16
    # chunk 3 (positions 12-15: doc 3) against chunk 0 (0-3: docs 1, 2): no shared document.
    assert plan_pair(docs, 3, 0, c) == []
    # chunk 2 (8: doc 2; 9-11: doc 3) against chunk 1 (4-7: doc 2): doc 2's query 8 x keys 4-7.
    (p,) = plan_pair(docs, 2, 1, c)
    assert (p.q, p.k, p.kind, p.mask) == (slice(0, 1), slice(0, 4), "full", None)
    # the diagonal of chunk 2: doc 2's token alone, doc 3's three, each causal.
    kinds = [(p.q, p.k, p.kind) for p in plan_pair(docs, 2, 2, c)]
    assert kinds == [(slice(0, 1), slice(0, 1), "causal"), (slice(1, 4), slice(1, 4), "causal")]
    assert plan_pair(docs, 1, 2, c) == []                       # the causal future


def test_rank_work_counts_the_pairs_actually_attended():
    """Without documents each rank computes 2cp-1 full blocks and 2 diagonal ones; with eight
    equal documents per sequence aligned to nothing, the attended pairs are those of the
    documents: 8 · L(L+1)/2 in all."""
    cp, c = 4, 16
    s = 2 * cp * c
    plain = rank_work(None, cp, s)
    assert [w["computed_pairs"] for w in plain] == [(2 * cp - 1) * c * c + c * (c + 1)] * cp
    lengths = [5] + [s // 8] * 7 + [s // 8 - 5]
    docs = document_ids(positions_of(lengths).unsqueeze(0))
    work = rank_work(docs, cp, s)
    assert sum(w["attended_pairs"] for w in work) == sum(n * (n + 1) // 2 for n in lengths)
    assert all(w["computed_pairs"] == w["attended_pairs"] for w in work)   # no mask without window


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_a_packed_forward_gathers_its_documents_once(monkeypatch, recompute):
    """The built-in GPT's attention layers (2) share one GatheredDocuments: a packed
    microbatch's forward and backward gather its position ids once, a recomputed forward
    reusing them; another microbatch (an equal tensor, another object) and the same tensor
    written in place gather again, and the entry of a freed one goes at that gather. One
    process: cp 1 under the all-gather mode (the ring's hops need process groups)."""
    from trainmesh.context_parallel import documents as module
    from trainmesh.engine.recompute import apply_recompute
    from trainmesh.models.gpt import GPT, GPTConfig
    gathered, real = [], module.gather_documents
    monkeypatch.setattr(module, "gather_documents",
                        lambda ids, ring: gathered.append(weakref.ref(ids)) or real(ids, ring))
    planned = _count_plans(monkeypatch)
    mesh = ParallelMesh(local=True)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=2, n_heads=2))
    apply_context_parallel(model, mesh, Comm(mesh), mode="allgather")
    apply_recompute(model, recompute)
    cores = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    assert len(cores) == 2 and cores[0].documents is cores[1].documents
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = positions_of([5, 11]).repeat(2, 1)

    def forward_backward(position_ids):
        model(tokens, tokens, position_ids=position_ids)[0].backward()
    forward_backward(pos)
    assert len(gathered) == 1 and gathered[0]() is pos, len(gathered)
    assert planned == [None], planned               # the plan too: once, for both layers
    forward_backward(pos.clone())
    assert len(gathered) == 2 and len(planned) == 2, (len(gathered), planned)
    pos[:, 7] = 0
    forward_backward(pos)
    assert len(gathered) == 3 and len(cores[0].documents) == 1, (len(gathered), len(cores[0].documents))
    assert len(planned) == 3, planned


def _count_plans(monkeypatch) -> list:
    """The window of every block plan (documents.plan) made from now on."""
    from trainmesh.context_parallel import documents as module
    planned, real = [], module.plan
    monkeypatch.setattr(module, "plan", lambda docs, rank, cp, c, window=None:
                        planned.append(window) or real(docs, rank, cp, c, window))
    return planned


def test_a_hub_model_plans_its_blocks_once_per_window(monkeypatch):
    """A Gemma 3 of 4 layers alternating a sliding window (6, shorter than the sequence) and
    full attention, under ring attention (cp 1, the all-gather mode; one process): a packed
    forward and backward plans its blocks once per window, the layers of one window sharing
    the plan, and unpacked ones (no documents) likewise, once for every forward."""
    model, mesh = _gemma3(4), ParallelMesh(local=True)
    apply_context_parallel(model, mesh, Comm(mesh), mode="allgather")
    planned = _count_plans(monkeypatch)
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, position_ids=positions_of([5, 20, 7]).repeat(2, 1)).logits.sum().backward()
    assert sorted(planned, key=str) == [6, None], planned
    model(input_ids=tokens).logits.sum().backward()
    model(input_ids=tokens).logits.sum().backward()
    assert sorted(planned, key=str) == [6, 6, None, None], planned


def test_the_planner_counts_the_position_ids_once_per_microbatch():
    """`trainmesh plan`'s cp traffic of a packed run: the ring's K/V per layer as without
    documents, plus one gather of the position ids (b·s int64) per microbatch on every rank,
    whatever its stage's layers and the recomputation."""
    from trainmesh.config.parallel import ParallelConfig
    from trainmesh.models.gpt import GPTConfig
    from trainmesh.planner.predict import predict_layout
    gpt = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4)
    for pp in (1, 2):
        for recompute in ("none", "full"):
            layout = ParallelConfig(cp=2, pp=pp, microbatches=2, recompute=recompute)
            packed, plain = (predict_layout(gpt, layout, global_batch=8, base_bytes=0,
                                            documents=documents).ranks for documents in (True, False))
            for a, b in zip(packed, plain):
                assert a.comm_bytes_per_step["cp"] == \
                    {**b.comm_bytes_per_step["cp"], "all_gather": 2 * 4 * 16 * 8}, (pp, recompute)


def test_the_planner_search_counts_the_position_ids_as_the_prediction_does():
    """The advisor's search scores a packed run (--document-len given) with the same cp
    traffic as the prediction of a packed run (rank_traffic): the K/V per layer plus one gather
    of the position ids per microbatch; without documents, without it. Ring and all-gather,
    pp 1 and 2, recompute none and full."""
    from dataclasses import replace

    from trainmesh.config.parallel import ParallelConfig
    from trainmesh.core.layout import Group
    from trainmesh.models.gpt import GPTConfig
    from trainmesh.planner.builtin import gpt_shape, rank_model
    from trainmesh.planner.candidate import evaluate
    from trainmesh.planner.cluster import Cluster
    from trainmesh.planner.rank_bytes import rank_traffic
    gpt = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4)
    for pp, mode, recompute in [(1, "ring", "none"), (2, "allgather", "full"), (2, "ring", "full")]:
        layout = ParallelConfig(cp=2, pp=pp, microbatches=2, recompute=recompute, cp_comm=mode)
        for packed in (True, False):
            shape = replace(gpt_shape(gpt, micro_batch=4), document_len=5.0 if packed else None)
            got = evaluate(layout, shape, Cluster(gpus=layout.world_size, efficiency=0.4)).traffic
            want = rank_traffic(rank_model(gpt, pp=pp, tp=1, rank=0), layout, gpt, 4, 0, packed)
            assert got["cp"] == want[Group.cp], (pp, mode, recompute, packed)


def _short_paragraphs(tmp) -> str:
    """A text file of 300 paragraphs (documents) of 1-8 short words: a few per sequence."""
    g = torch.Generator().manual_seed(0)
    words = ["ab", "cde", "f", "ghij", "kl", "mnopq", "rs"]
    paragraphs = [" ".join(words[int(i)] for i in torch.randint(7, (int(n),), generator=g))
                  for n in torch.randint(1, 9, (300,), generator=g)]
    (tmp / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n")
    return str(tmp / "corpus.txt")


def _one_process(flags: list[str], data_of, batch: int) -> list[dict]:
    """The step records of the engine `trainmesh train FLAGS` builds, run in this process for
    20 steps on ``data_of(config)``'s batches (the launcher's start-up spared)."""
    from helpers import train_config

    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.run.trainer import build_engine
    cfg = train_config(flags)
    engine = build_engine(cfg, torch.device("cpu"), ParallelMesh(local=True))
    data, out = data_of(cfg), []
    for step in range(1, 21):
        loss = engine.train_step(data.batch(cfg.seed, step, batch))
        out.append({"event": "step", "step": step, "loss": loss,
                    "grad_norm": engine.last["grad_norm"]})
    return out


def _gemma3(layers: int):
    """A tiny Gemma 3 (text) of ``layers`` alternating a sliding window (6, shorter than the
    sequence and crossing the chunks of --cp 2) and full attention, after seed 0."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False))


def _gemma3_window_dir(tmp) -> str:
    """:func:`_gemma3` of 2 layers, matrices at std 0.2, saved."""
    from helpers import widened
    widened(_gemma3(2)).save_pretrained(str(tmp / "gemma3"))
    return str(tmp / "gemma3")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sliding_window_hub_model_under_cp2_equals_one_process(tmp_path):
    """Gemma 3 with a window (6) shorter than the sequence (32), on packed documents: --cp 2
    trains like one process for 20 steps (the run was refused before), the ring taking the
    window and the documents from the position ids the model hands its attention, gathered
    once per forward for both layers (the ledger's cp all_gather: b·s·8 bytes a step). One
    process: the engine `trainmesh train` builds, in this process."""
    from helpers import assert_equivalent, run_train, steps, summary

    from trainmesh.data.corpus import make_datasets
    directory = _gemma3_window_dir(tmp_path)
    data = _short_paragraphs(tmp_path)
    base = ["--model-dir", directory, "--data", data, "--tokenizer", "bytes", "--documents",
            "packed", "--seq-len", "32", "--global-batch", "2", "--steps", "20", "--lr", "0.01",
            "--warmup-steps", "1", "--seed", "3"]
    ref = _one_process(base, lambda cfg: make_datasets(
        data, vocab_size=256, seq_len=32, held_out=False, documents="packed")[0], 2)
    proc, records = run_train([*base, "--cp", "2"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(ref, steps(records))
    for rank in summary(records)["ranks"]:
        assert rank["comm_bytes_per_step"]["cp"]["all_gather"] == 2 * 32 * 8, rank


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_cp4_packed_equals_one_process_with_documents_crossing_every_boundary(tmp_path):
    """`trainmesh train --cp 4 --documents packed` (the built-in GPT, the ring; full recompute)
    trains 20 steps like one process on the same packed batches; the data's
    short paragraphs put a document across each of the 7 chunk edges of the cp 4 split in the
    first batch (checked); each rank's cp bytes per step are the formula of
    docs/CONTEXT_PARALLEL.md: the K/V per layer, forward twice, and the position ids gathered
    once (not again by the second layer nor by the recomputation); each step's
    MFU counts the attention of that step's documents."""
    from helpers import assert_equivalent, run_train, steps, summary, train_config

    from trainmesh.context_parallel import cp_bytes_per_layer, cp_document_bytes
    from trainmesh.data.corpus import make_datasets
    from trainmesh.models.gpt import GPT
    from trainmesh.observe.flops import document_len
    data = _short_paragraphs(tmp_path)
    base = ["--data", data, "--documents", "packed", "--seq-len", "64", "--layers", "2",
            "--d-model", "32", "--heads", "4", "--global-batch", "4", "--steps", "20", "--seed", "1"]
    train, _ = make_datasets(data, vocab_size=256, seq_len=64, held_out=False,
                             documents="packed")
    pos = train.batch(1, 1, 4)["position_ids"]
    assert all(bool((pos[:, edge] != 0).any()) for edge in range(8, 64, 8)), pos
    assert int((pos == 0).sum()) >= 4 * 4                      # several documents per row
    ref = _one_process(base, lambda cfg: train, 4)
    proc, records = run_train([*base, "--cp", "4", "--peak-tflops", "1", "--recompute", "full"],
                              tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(ref, steps(records))
    # MFU counts the attention of each step's documents: s -> the step's sum L^2 / sum L
    gpt = train_config(base).gpt_config()
    whole = GPT(gpt).flops_per_token()
    for row in steps(records):
        attended = document_len(train.batch(1, row["step"], 4)["position_ids"])
        assert row["document_len"] == attended < 64
        flops = whole - 12 * gpt.n_layers * gpt.d_model * (64 - attended)
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * flops / (4 * 1e12), rel=1e-12)
    # the ledger: the ring's K/V of each layer (2 forwards) and the microbatch's gather of the
    # position ids (b·s int64), the ring's only all_gather: once, not per layer and forward
    per_layer = cp_bytes_per_layer(cp=4, micro_batch=4, seq_len=64, d_model=32, forwards=2)
    ids = cp_document_bytes(cp=4, micro_batch=4, seq_len=64)
    assert ids == {"all_gather": 4 * 64 * 8} and "all_gather" not in per_layer
    for rank in summary(records)["ranks"]:
        assert rank["comm_bytes_per_step"]["cp"] == {
            **{op: 2 * b for op, b in per_layer.items()}, **ids}


def test_flops_count_attention_within_documents():
    """MFU's count and the planner's: a token's attention spans its document (Σ L²/Σ L keys),
    not the sequence; `trainmesh plan --document-len` lowers the step's compute by the
    attention FLOPs of the documents left out, and refuses a length beyond --seq-len."""
    from trainmesh.observe.flops import document_len, packed_flops_per_token, \
        transformer_flops_per_token
    from trainmesh.planner.shapes import ModelShape
    from trainmesh.planner.steptime import flops_per_token
    pos = torch.stack([positions_of([3, 5]), torch.arange(8)])
    assert document_len(pos) == (9 + 25 + 64) / 16
    whole = transformer_flops_per_token(1000, 2, 8, 16)
    assert packed_flops_per_token(whole, n_layers=2, seq_len=8, d_model=16, attended=8) == whole
    assert packed_flops_per_token(whole, n_layers=2, seq_len=8, d_model=16, attended=4.25) == \
        transformer_flops_per_token(1000, 2, 4.25, 16)
    shape = dict(params=10**9, layers=8, hidden=1024, heads=8, seq_len=8192)
    plain, packed = ModelShape(**shape), ModelShape(**shape, document_len=1024)
    assert (plain.attention_len, packed.attention_len) == (8192, 1024)
    f = [flops_per_token(m.params, layers=8, hidden=1024, seq_len=m.attention_len, model=m)
         for m in (plain, packed)]
    assert f[0] - f[1] == 3 * 4 * 8 * 1024 * (8192 - 1024)     # fwd + bwd attention, per token
    with pytest.raises(Exception, match="--document-len"):
        ModelShape(**shape, document_len=9000)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fused_blocks_with_a_mask_equal_the_math_path(device):
    """A window's mask (one query row with no key at all among them) through the device's fused
    kernel (CPU flash with a bias; CUDA memory-efficient with a 16-aligned bias) and the math
    path: the same output, log-sum-exp (-inf on the empty row) and gradients."""
    from trainmesh.context_parallel import attend_block, attend_block_backward
    dev = torch.device(device)
    if not fused_available(dev):
        pytest.skip(f"no fused kernel returning the log-sum-exp on {device}")
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 4, 12, 16, generator=g).to(dev) for _ in range(2))
    k, v = (torch.randn(2, 4, 9, 16, generator=g).to(dev) for _ in range(2))
    i, j = torch.arange(12).unsqueeze(1) + 9, torch.arange(9).unsqueeze(0)
    mask = (j <= i) & (i - j < 12)                                  # row 11: no key within 12
    assert not bool(mask[-1].any()) and bool(mask.any(-1)[:-1].all())
    o_m, l_m = attend_block(q, k, v, causal=False, mask=mask)
    o_f, l_f = attend_block(q, k, v, causal=False, fused=True, mask=mask)
    assert torch.isinf(l_m[..., -1]).all() and torch.isinf(l_f[..., -1]).all()
    assert_fp32_close(o_f.cpu(), o_m.cpu(), scale=scale_of([v]), terms=9 * 16, what="out")
    assert_fp32_close(l_f[..., :-1].cpu(), l_m[..., :-1].cpu(), scale=scale_of([l_m[..., :-1]]),
                      terms=9 * 16, what="lse")
    lse = l_m.clone()
    lse[..., -1] = 0.0                    # as if other blocks gave the empty row its keys
    grads_m = attend_block_backward(dout, q, k, v, o_m, lse, causal=False, mask=mask)
    grads_f = attend_block_backward(dout, q, k, v, o_m, lse, causal=False, fused=True, mask=mask)
    for name, f, m in zip(("dq", "dk", "dv"), grads_f, grads_m):
        assert_fp32_close(f.float().cpu(), m.cpu(), scale=scale_of([m]), terms=9 * 16, what=name)
