"""Layout-independent randomness (trainmesh.core.randomness, trainmesh.models.hf_random).

Fast tier, in process: the counter-based generator equals a plain 32-bit reference of its hash;
it keeps a fraction 1 - p within the binomial's spread; the numbers of a tensor split any way
(rows, tokens by cp's zigzag and by sequence parallelism, heads, features) are the pieces of the
whole tensor's; the attention function's output of a share of the rows or heads is the share of
the whole output; a hub model's dropout (Seed-OSS: attention and residual) and router noise
(Mixtral's jitter, PhiMoE's sampling) on a share of the batch equal the share of the whole
batch's forward (and GPT-2's attention, residual and embedding dropout); the ring's attention
with dropout at cp 2 and 4 (ring, all-gather) equals one process's forward and backward. A slow
tests train through ``trainmesh train --model-dir`` against one process: Seed-OSS (attention and
residual dropout 0.1) under dp 2 x tp 2 and under cp 2; PhiMoE (input jitter, sampled experts)
under dp 2 x ep 2 x tp 2.
"""
from __future__ import annotations

import math

import pytest
import torch

from trainmesh.context_parallel.partition import zigzag_positions
from trainmesh.core.randomness import Draws, drawing, keep_mask, site_of, uniform

B, S, F, P = 4, 16, 32, 0.1


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_hash_is_the_32_bit_mixer_folded_over_the_key():
    seed, step, site = (1 << 40) + 12345, 7, site_of("model.layers.3.self_attn")
    idx = [torch.tensor([0, 1, 2**31 + 5, 2**32 - 1]), torch.tensor([3, 0, 9, 2**32 - 1])]
    got = uniform(seed, step, site, *idx)
    for j in range(4):
        h = 0
        for word in (seed & 0xFFFFFFFF, seed >> 32, step, site, int(idx[0][j]), int(idx[1][j])):
            h = _lowbias32(h ^ word)
        assert got[j].item() == (h >> 8) / 2**24, j


def test_keep_fraction_is_one_minus_p_within_the_binomial_spread():
    n = 1 << 18
    u = uniform(3, 1, 5, torch.arange(n))
    kept = float((keep_mask(u, P) > 0).float().mean())
    assert abs(kept - (1 - P)) <= 6 * math.sqrt(P * (1 - P) / n), kept
    assert abs(float(u.mean()) - 0.5) <= 6 * math.sqrt(1 / 12 / n)
    assert float(keep_mask(u, P).max()) == pytest.approx(1 / (1 - P))
    assert not torch.equal(uniform(3, 1, 5, torch.arange(64)), uniform(3, 2, 5, torch.arange(64)))
    assert not torch.equal(uniform(3, 1, 5, torch.arange(64)), uniform(4, 1, 5, torch.arange(64)))


def _whole() -> Draws:
    return Draws(seed=3, step=2, row0=0, rows=B, positions=torch.arange(S))


def test_hidden_numbers_of_any_split_are_the_pieces_of_the_whole():
    site, whole = 77, _whole().hidden_uniform(77, torch.Size([B, S, F]), F)   # (b, s, f)
    dp1 = Draws(3, 2, row0=2, rows=2, positions=torch.arange(S))             # dp rank 1 of 2
    assert torch.equal(dp1.hidden_uniform(site, torch.Size([2, S, F]), F), whole[2:])
    for r in range(2):                                                        # cp 2: zigzag
        pos = zigzag_positions(S // 2, r, 2)
        cp = Draws(3, 2, 0, B, positions=pos)
        assert torch.equal(cp.hidden_uniform(site, torch.Size([B, S // 2, F]), F), whole[:, pos])
        sp = Draws(3, 2, 0, B, torch.arange(S), tp_index=r, tp=2, sequence_parallel=True)
        chunk = slice(r * S // 2, (r + 1) * S // 2)                          # SP: tp's chunk
        assert torch.equal(sp.hidden_uniform(site, torch.Size([B, S // 2, F]), F), whole[:, chunk])
        tp = Draws(3, 2, 0, B, torch.arange(S), tp_index=r, tp=2)             # tp: features
        feats = slice(r * F // 2, (r + 1) * F // 2)
        assert torch.equal(tp.hidden_uniform(site, torch.Size([B, S, F // 2]), F), whole[..., feats])
    flat = _whole().hidden_uniform(site, torch.Size([B * S, F]), F)          # (b·s, f): a router's
    assert torch.equal(flat, whole.reshape(B * S, F))


def _placed(module: torch.nn.Module, heads: int):
    """The installed draws of one attention ``module``: site 11, ``heads`` heads in all."""
    from trainmesh.models.hf_random import DrawSite, InstalledDraws
    installed = InstalledDraws()
    installed.sites[module] = DrawSite(11, heads)
    return installed


def _attention(draws: Draws, q, k, v, heads: int, scaling: float = 0.3):
    from trainmesh.models.hf_random import _DroppedAttention
    module = torch.nn.Module()
    causal = torch.full((S, S), float("-inf"), dtype=q.dtype).triu(1).expand(q.shape[0], 1, S, S)
    with drawing(draws):
        return _DroppedAttention("sdpa", _placed(module, heads))(module, q, k, v, causal,
                                                                 scaling=scaling, dropout=P)[0]


def test_attention_sinks_take_part_in_the_softmax_only():
    """GPT-OSS's sinks (``s_aux``: one logit per head, dropped after the softmax): at a dropout
    too small to drop anything, the drawn attention equals the family's own eager attention."""
    oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from trainmesh.models.hf_random import _DroppedAttention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, 4, S, 8, generator=g, dtype=torch.float64) for _ in range(3))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = torch.randn(4, generator=g, dtype=torch.float64), 1, False
    causal = torch.full((S, S), float("-inf"), dtype=q.dtype).triu(1).expand(B, 1, S, S)
    want = oss.eager_attention_forward(module, q, k, v, causal, scaling=0.3)[0]
    with drawing(_whole()):
        got = _DroppedAttention("eager", _placed(module, 4))(module, q, k, v, causal, scaling=0.3,
                                                             dropout=1e-300, s_aux=module.sinks)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_attention_of_a_share_of_rows_or_heads_is_the_share_of_the_whole():
    """(b, s, h, hd) outputs in float64: dp's rows and tp's heads (grouped-query k/v: each tp
    rank its kv head) equal the pieces of one process's; each probability kept with 1 - p."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, S, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    whole = _attention(_whole(), q, k, v, 4)                                  # (b, s, h, hd)
    rows = _attention(Draws(3, 2, row0=2, rows=2, positions=torch.arange(S)), q[2:], k[2:], v[2:], 4)
    torch.testing.assert_close(rows, whole[2:], rtol=0, atol=1e-12)
    for r in range(2):
        tp = Draws(3, 2, 0, B, torch.arange(S), tp_index=r, tp=2)
        heads = _attention(tp, q[:, 2 * r:2 * r + 2], k[:, r:r + 1], v[:, r:r + 1], 4)
        torch.testing.assert_close(heads, whole[:, :, 2 * r:2 * r + 2], rtol=0, atol=1e-12)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                             v.repeat_interleave(2, 1), is_causal=True, scale=0.3)
    assert (whole - plain.transpose(1, 2)).abs().max() > 1e-3                # dropped, not plain


def _ring_with_dropout(q, k, v, dout, cp: int, mode: str):
    """(out, dq, dk, dv) of the whole sequence from ``cp`` emulated ranks, each dropping by its
    own Draws (its zigzag positions) through the cp attention's keep mask."""
    from test_context_parallel import emulate_ranks

    from trainmesh.context_parallel.hf_attention import _dropout
    from trainmesh.context_parallel.partition import shard_sequence
    from trainmesh.context_parallel.ring import ring_attention
    module = torch.nn.Module()
    installed = _placed(module, q.shape[1])
    shares = [[shard_sequence(t, r, cp, dim=2) for t in (q, k, v, dout)] for r in range(cp)]
    keeps = []
    for r in range(cp):           # each rank's keep mask, built from its Draws before the threads
        with drawing(Draws(3, 2, 0, B, positions=zigzag_positions(S // cp, r, cp))):
            keeps.append(_dropout(module, shares[r][0], P, installed))
    def body(r, ring):
        mine = [t.detach().requires_grad_() for t in shares[r][:3]]
        out = ring_attention(*mine, ring, mode=mode, keep=keeps[r])
        out.backward(shares[r][3])
        return (out.detach(), *(t.grad for t in mine))
    return emulate_ranks(cp, body)


@pytest.mark.parametrize("cp,mode", [(2, "ring"), (4, "ring"), (2, "allgather")])
def test_ring_attention_with_dropout_equals_one_process(cp, mode):
    """cp ranks' ring attention with dropout: out and dq, dk, dv (float64, grouped-query) equal
    one process's dropped attention (the math path the model registers) on the whole sequence."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, 4, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _attention(_whole(), *want, 4, scaling=8 ** -0.5).transpose(1, 2)   # (b, h, s, hd)
    ref.backward(dout)
    got = _ring_with_dropout(q, k, v, dout, cp, mode)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, [ref.detach()] + [t.grad for t in want]):
        err = float((a - w).abs().max())
        assert err <= 1e-12, f"cp {cp} {mode}: {name} max error {err:.3e}"


def _family(kind: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=S, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "seed_oss":       # attention and residual dropout 0.1 by default
        model = transformers.SeedOssForCausalLM(transformers.SeedOssConfig(**common))
    elif kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1))
    elif kind == "gpt2":         # attn_pdrop, resid_pdrop, embd_pdrop 0.1 by default
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=S))
    else:     # PhiMoE: its sampling among experts within router_jitter_noise of the best, input jitter
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5,
            input_jitter_noise=0.1))
    return (model.double() if kind in ("seed_oss", "gpt2") else model).train()   # grouped mm: fp32


def _forward_backward(model, draws: Draws, embeds: torch.Tensor, weights: torch.Tensor):
    """Logits of ``embeds`` under ``draws`` and the gradient of (logits · weights).sum() on them."""
    x = embeds.detach().requires_grad_(True)
    with drawing(draws):
        logits = model(inputs_embeds=x).logits
        (logits * weights).sum().backward()
    return logits.detach(), x.grad


@pytest.mark.parametrize("kind", ["seed_oss", "gpt2", "mixtral", "phimoe"])
def test_a_hub_models_draws_on_a_share_of_the_batch_are_the_share_of_the_whole(kind):
    """Rows 2-3 of the batch as dp rank 1 of 2 computes them equal rows 2-3 of one process's
    forward and backward (the input's gradient: PhiMoE's coin acts there) (Seed-OSS and GPT-2
    in float64; the MoE in float32, its grouped kernel's, within its rounding); another step
    draws other numbers, evaluation none."""
    from trainmesh.models.hf_random import install_draws
    model = _family(kind)
    done = install_draws(model).replaced
    assert any("attention dropout" in d or "sampling" in d or "jitter" in d for d in done), done
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(B, S, 32, generator=g).to(dtype)
    weights = torch.randn(B, S, 64, generator=g).to(dtype)
    whole, grad = _forward_backward(model, _whole(), embeds, weights)
    share, share_grad = _forward_backward(model, Draws(3, 2, row0=2, rows=2, positions=torch.arange(S)),
                                          embeds[2:], weights[2:])
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(share, whole[2:], rtol=0, atol=atol)
    torch.testing.assert_close(share_grad, grad[2:], rtol=0, atol=atol)
    other, _ = _forward_backward(model, Draws(3, 3, row0=0, rows=B, positions=torch.arange(S)), embeds, weights)
    assert (other - whole).abs().max() > 1e-6
    with torch.no_grad():
        evaluated = model.eval()(inputs_embeds=embeds).logits      # no dropout, no noise
    assert (evaluated - whole).abs().max() > 1e-6


def test_the_draw_sites_are_held_by_the_installer_not_by_the_modules():
    """``install_draws`` returns where each module draws (its site, the head count its heads
    are numbered in) and puts nothing on the modules; a second model installed in the same
    process leaves the first model's draws as they were (each its own attention function)."""
    from trainmesh.core.randomness import site_of
    from trainmesh.models.hf_random import install_draws
    model = _family("seed_oss")
    installed = install_draws(model)
    loose = [(n, k) for n, m in model.named_modules() for k in vars(m) if k.startswith("_trainmesh")]
    assert not loose, loose
    attentions = [(n, m) for n, m in model.named_modules() if n.endswith("self_attn")]
    assert len(attentions) == 2, attentions
    for name, module in attentions:   # a tp rank's 2 of the 4 heads are numbered among the 4
        assert installed.attention_key(module, 2) == (site_of(name), 4), name
    embeds = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad(), drawing(_whole()):
        first = model(inputs_embeds=embeds).logits
        install_draws(_family("seed_oss"))
        again = model(inputs_embeds=embeds).logits
    assert torch.equal(first, again), (first - again).abs().max()


def _hub_dir(tmp, kind: str) -> str:
    """A tiny saved ``kind``, matrices at std 0.2: Seed-OSS (attention and residual dropout 0.1,
    its defaults) or PhiMoE (sampling among experts within 0.5 of the best, input jitter 0.1)."""
    from helpers import widened
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=False)
    if kind == "seed_oss":
        model = transformers.SeedOssForCausalLM(transformers.SeedOssConfig(**common))
        assert model.config.attention_dropout == model.config.residual_dropout == 0.1
    else:
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5,
            input_jitter_noise=0.1))
    widened(model).save_pretrained(str(tmp / kind))
    return str(tmp / kind)


def _one_process(flags: list[str], steps: int) -> list[dict]:
    """The step records of the engine `trainmesh train FLAGS` builds, run in this process."""
    from helpers import train_config

    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.trainer import build_engine
    cfg = train_config(flags)
    engine = build_engine(cfg, torch.device("cpu"), ParallelMesh(local=True))
    data = make_datasets(cfg.data, vocab_size=256, seq_len=cfg.seq_len, held_out=False)[0]
    out = []
    for step in range(1, steps + 1):
        loss = engine.train_step(data.batch(cfg.seed, step, cfg.global_batch))
        out.append({"event": "step", "step": step, "loss": loss, "grad_norm": engine.last["grad_norm"]})
    return out


def _check_layouts(tmp, kind: str, layouts: list[list[str]]) -> None:
    """`trainmesh train --model-dir` of a tiny ``kind`` under each layout follows one process
    with the same seed for 4 steps (loss 1e-3 abs, grad norm 1e-3 rel)."""
    from helpers import assert_equivalent, run_train, steps
    text = tmp / "corpus.txt"
    text.write_text("\n\n".join(f"paragraph {i}: " + "abc def ghij " * (i % 7 + 1) for i in range(200)))
    base = ["--model-dir", _hub_dir(tmp, kind), "--data", str(text), "--tokenizer", "bytes",
            "--seq-len", "16", "--global-batch", "4", "--steps", "4", "--lr", "0.01",
            "--warmup-steps", "1", "--seed", "3"]
    ref = _one_process(base, 4)
    for layout in layouts:
        proc, records = run_train([*base, *layout], tmp, timeout=240, name="-".join(layout)[2:])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert_equivalent(ref, steps(records), min_steps=4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_seed_oss_with_dropout_under_dp2_tp2_and_cp2_equals_one_process(tmp_path):
    """Seed-OSS with attention and residual dropout 0.1 at dp 2 x tp 2 (each rank its rows and
    its heads) and at cp 2 (the ring dropping each block's pairs) equals one process (drawn
    from each rank's generator it differed by 2e-3 at step 1). One process: the engine
    `trainmesh train` builds, in this process."""
    _check_layouts(tmp_path, "seed_oss", [["--dp", "2", "--tp", "2"], ["--cp", "2"]])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_phimoe_router_noise_under_dp2_ep2_tp2_equals_one_process(tmp_path):
    """PhiMoE's input jitter and sampling of experts at dp 2 x ep 2 x tp 2 (each rank its rows,
    its experts, its heads) equals one process (drawn from each rank's generator: 5.6e-3 in
    loss at step 1 at dp 2 x ep 2)."""
    _check_layouts(tmp_path, "phimoe", [["--dp", "2", "--ep", "2", "--tp", "2"]])
