"""Packed documents (``--documents packed``): the batches, and packing equal to no packing.

A packed sequence is a window of the token stream cut at its document starts: positions restart
at each document (or piece of one), and the label of a document's last token is -100. The
loss and gradients of a packed batch equal, within float32 rounding, those of each document
(or piece) run alone through the same model: the built-in GPT and two hub families (Llama,
Qwen2), whose attention keeps to the documents transformers finds in the position ids.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import assert_fp32_close, scale_of

from trainmesh.core.errors import ConfigError
from trainmesh.data.corpus import make_datasets
from trainmesh.data.packing import document_ids, documents_in, pack_windows
from trainmesh.models.gpt import GPT, GPTConfig

SEQ = 32
LETTERS = "abcdefgh"


def _docs(n: int, seed: int = 0) -> list[str]:
    """Documents of random lengths (1..3 x SEQ characters: many longer than a sequence), no
    blank line inside; each starts with an upper-case letter no other place holds."""
    rng = random.Random(seed)
    return ["XYZ"[i % 3] + "".join(rng.choice(LETTERS + " \n") for _ in range(rng.randint(0, 3 * SEQ)))
            .replace("\n\n", "\n").strip("\n") for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    d = tmp_path_factory.mktemp("packing")
    docs = _docs(120)
    path = d / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path, docs


def test_a_window_cut_at_its_documents_restarts_positions_and_ignores_their_last_labels():
    windows = torch.arange(10, 19).view(1, 9)                     # seq 8
    b = pack_windows(windows, [[3, 4, 8]])                        # documents start at 3, 4 (and 8)
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert b["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15, 16, 17]]
    assert b["labels"].tolist() == [[11, 12, -100, -100, 15, 16, 17, -100]]
    assert document_ids(b["position_ids"]).tolist() == [[1, 1, 1, 2, 3, 3, 3, 3]]
    assert documents_in(b) == 3
    assert documents_in({"input_ids": windows}) is None


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_packed_batches_are_the_documents_cut_where_they_start(corpus, tokenizer):
    """Every packed row is a run of whole documents and pieces of documents, each followed by its
    blank line; a piece starts at position 0; the batch of step k is a function of (seed, k)."""
    path, docs = corpus
    train, _ = make_datasets(str(path), vocab_size=300, seq_len=SEQ, held_out=False,
                             tokenizer=tokenizer, documents="packed")
    b = train.batch(3, 5, 8)
    again, _ = make_datasets(str(path), vocab_size=300, seq_len=SEQ, held_out=False,
                             tokenizer=tokenizer, documents="packed")
    assert all(torch.equal(b[k], v) for k, v in again.batch(3, 5, 8).items())
    assert not torch.equal(b["input_ids"], train.batch(3, 6, 8)["input_ids"])
    texts = [d + "\n\n" for d in docs]
    decode = _decoder(path, tokenizer)
    pieces = 0
    for row in range(8):
        pos, ids, labels = (b[k][row] for k in ("position_ids", "input_ids", "labels"))
        starts = (pos == 0).nonzero().flatten().tolist() + [SEQ]
        for a, z in zip(starts, starts[1:]):
            text = decode(ids[a:z].tolist())
            assert pos[a:z].tolist() == list(range(z - a))
            assert any(text in t for t in texts), (row, a, z, text)
            if 0 < a:                       # a document begun inside the window: from its start
                assert text[0] in "XYZ" and any(t.startswith(text) for t in texts), text
                assert labels[a - 1] == -100
            assert (labels[a : z - 1] != -100).all()
            pieces += 1
    assert pieces > 8                        # documents shorter than the window were cut out


def _decoder(path: Path, tokenizer: str):
    if tokenizer == "bytes":
        return lambda ids: bytes(ids).decode("utf-8")
    from tokenizers import Tokenizer

    from trainmesh.data.tokenizer import cache_paths
    tok = Tokenizer.from_file(str(cache_paths(str(path), 300, fmt="jsonl")[0]))
    return lambda ids: tok.decode(ids)


def test_a_text_file_packs_its_paragraphs_and_the_held_out_split_its_own(corpus, tmp_path):
    """A text file's documents are its paragraphs (blank lines between); the held-out split's
    windows are cut at the same index's starts."""
    _, docs = corpus
    text = tmp_path / "docs.txt"
    text.write_text("\n\n\n".join(docs) + "\n")
    train, held = make_datasets(str(text), vocab_size=256, seq_len=SEQ, held_out=True,
                                documents="packed")
    texts = [d + "\n\n" for d in docs]
    for b in (train.batch(0, 1, 8), held.batch(0, 1, 8)):
        for row, pos in enumerate(b["position_ids"]):
            starts = (pos == 0).nonzero().flatten().tolist() + [SEQ]
            for a, z in zip(starts, starts[1:]):
                piece = bytes(b["input_ids"][row, a:z].tolist()).decode()
                assert any(piece in t for t in texts) and (a == 0 or piece[0] in "XYZ"), piece
    assert held.tokens.start > 0


def test_the_model_tokenizer_s_documents_end_with_its_eos(tmp_path):
    """--tokenizer model: the stream's cache split after each EOS; every document after the
    first piece begins with the BOS its tokenizer prepends."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    docs = _docs(60, seed=2)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=60, special_tokens=[
        "<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(tmp_path / "model")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    train, _ = make_datasets(str(data), vocab_size=60, seq_len=SEQ, held_out=False,
                             tokenizer="model", model_dir=str(tmp_path / "model"), documents="packed")
    b = train.batch(0, 1, 8)
    ids, pos = b["input_ids"], b["position_ids"]
    assert ((pos[:, 1:] == 0) == (ids[:, :-1] == 2)).all()          # a start follows each EOS
    assert (ids[:, 1:][pos[:, 1:] == 0] == 1).all()                  # and is a BOS
    assert ((b["labels"] == -100) == (ids == 2)).all()


def test_a_token_file_is_split_after_each_eos_of_the_model_dir(tmp_path):
    """A token file's documents end with the --model-dir's EOS id (here its config.json's)."""
    ids = np.array([5, 6, 7, 2, 8, 9, 2, 2, 10, 11, 12, 13, 14, 2, 15, 16, 17, 18, 19, 20, 2, 21] * 4,
                   dtype=np.int32)
    np.save(tmp_path / "t.npy", ids)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    train, _ = make_datasets(str(tmp_path / "t.npy"), vocab_size=32, seq_len=8, held_out=False,
                             documents="packed", model_dir=str(model))
    b = train.batch(0, 1, 16)
    for row in range(16):
        ids_row, pos = b["input_ids"][row], b["position_ids"][row]
        for t in range(1, 8):
            assert (pos[t] == 0) == (ids_row[t - 1] == 2), (ids_row, pos)
        assert ((b["labels"][row] == -100) == (ids_row == 2)).all()
    with pytest.raises(ConfigError, match="--documents"):
        make_datasets(str(tmp_path / "t.npy"), vocab_size=32, seq_len=8, held_out=False,
                      documents="packed")


def test_packed_without_documents_is_refused_naming_documents(tmp_path):
    from trainmesh.config.train import TrainConfig
    with pytest.raises(ConfigError) as exc:
        TrainConfig(documents="packed")
    assert exc.value.field == "--documents" and "synthetic" in str(exc.value)
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    with pytest.raises(ConfigError) as exc:
        TrainConfig(documents="packed", data=str(tmp_path / "t.npy"))
    assert exc.value.field == "--documents" and "--model-dir" in str(exc.value)
    with pytest.raises(ConfigError, match="--documents"):
        make_datasets("synthetic", vocab_size=64, seq_len=8, held_out=False, documents="packed")


# ---------------------------------------------------------------- packing equals no packing
def _pieces(batch: dict[str, torch.Tensor]):
    """Each document (or piece) of a packed batch as a batch of its own, its labels its own next
    tokens: the last one's is nothing (-100) where another document follows in the row, the
    token after the window where the piece ends the row (its document goes on there)."""
    for row, pos in enumerate(batch["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        for a, z in zip(starts, starts[1:]):
            ids = batch["input_ids"][row : row + 1, a:z]
            last = batch["labels"][row, z - 1] if z == pos.numel() else -100
            labels = torch.cat([ids[:, 1:], torch.tensor([[last]])], dim=1)
            yield {"input_ids": ids, "labels": labels}


def _step(model, loss_fn, batches) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(loss sum, counted tokens, gradients) of ``batches`` summed, from zero gradients."""
    model.zero_grad(set_to_none=True)
    loss_total, count_total = 0.0, 0
    for b in batches:
        loss, count = loss_fn(model, b)
        loss.backward()
        loss_total, count_total = loss_total + loss.detach().double(), count_total + int(count)
    return loss_total, count_total, [p.grad.detach().clone() for p in model.parameters()]


def _assert_packing_equals_alone(model, loss_fn, batch, terms: int) -> None:
    packed = _step(model, loss_fn, [batch])
    alone = _step(model, loss_fn, list(_pieces(batch)))
    assert packed[1] == alone[1] == int((batch["labels"] != -100).sum())
    # an untrained model's per-token losses lie within 2x their mean (ln 256 = 5.5, +- about 1)
    assert_fp32_close(packed[0].reshape(1), alone[0].reshape(1), scale=2 * float(alone[0]) / alone[1],
                      terms=alone[1], what="loss sum")
    scale = scale_of(alone[2])
    for (name, _), got, want in zip(model.named_parameters(), packed[2], alone[2]):
        assert_fp32_close(got, want.double(), scale=scale, terms=terms, what=name)


@pytest.fixture(scope="module")
def packed_batch(corpus) -> dict[str, torch.Tensor]:
    train, _ = make_datasets(str(corpus[0]), vocab_size=256, seq_len=SEQ, held_out=False,
                             documents="packed")
    return train.batch(0, 1, 4)


def test_a_packed_gpt_step_equals_each_document_alone(packed_batch):
    """Loss, token count and every gradient of the built-in GPT on a packed batch equal the sums
    over its documents run one by one (positions from 0, plain causal attention)."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=SEQ, d_model=32, n_layers=2, n_heads=4), seed=0)
    assert documents_in(packed_batch) > 4
    _assert_packing_equals_alone(model, lambda m, b: m(**b), packed_batch, terms=4 * SEQ * 128)


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen2", "eager")])
def test_a_packed_hub_step_equals_each_document_alone(packed_batch, family, attention):
    """The same for two hub families, through trainmesh's causal_lm_loss (position ids in)."""
    transformers = pytest.importorskip("transformers")
    from trainmesh import causal_lm_loss
    torch.manual_seed(0)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    config = cls[0](vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                    use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = attention
    _assert_packing_equals_alone(cls[1](config), causal_lm_loss, packed_batch, terms=4 * SEQ * 128)


@pytest.mark.parametrize("mode,segment", [("full", 1), ("full", 2), ("selective", 1)])
def test_recomputation_keeps_the_documents(packed_batch, mode, segment):
    """Recomputed in backward (whole blocks, segments of blocks, attention internals), a packed
    step is the same step: the position ids reach the recomputed layers."""
    from tolerances import SAME_KERNELS_ABS

    from trainmesh.engine.recompute import apply_recompute
    cfg = GPTConfig(vocab_size=256, seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)
    loss_fn = lambda m, b: m(**b)   # noqa: E731
    plain = _step(GPT(cfg, seed=0), loss_fn, [packed_batch])
    model = GPT(cfg, seed=0)
    apply_recompute(model, mode, segment=segment)
    again = _step(model, loss_fn, [packed_batch])
    assert abs(float(plain[0]) - float(again[0])) <= SAME_KERNELS_ABS
    for (name, _), a, b in zip(model.named_parameters(), plain[2], again[2]):
        assert float((a - b).abs().max()) <= SAME_KERNELS_ABS, name
