"""The MoE layer in one process, against a dense loop over tokens in float64.

Checked: the layer's output and every gradient (router and experts, the load-balancing term
included) equal a token-by-token loop that applies the definition (softmax router, top-k,
gates renormalised over the k, gate-weighted sum of the k experts' GELU MLPs, per-sequence
``E * sum_e f_e P_e``); dropless routing (every token's rows reach exactly its k experts); the
aux loss summed per sequence does not depend on how the batch is split; the parameter counts
(total and active) count the experts; invalid MoE flags exit 2 naming the flag.

Planted bugs this module catches (each seen failing with an assertion): one routed slot dropped
from the combine (output, 0.24 off); gates not renormalised over the k (output, 0.29 off); the
aux gradient without the sequence length's weight (router gradient).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_refused

from trainmesh.models.gpt import GPT, GPTConfig
from trainmesh.models.moe import MoE, MoEStats

pytestmark = pytest.mark.timeout(60)
E, K, D, H, COEF = 4, 2, 8, 12, 0.05


def _layer(dtype=torch.float64) -> MoE:
    torch.manual_seed(0)
    layer = MoE(D, E, K, H, aux_coef=COEF, index=0, stats=MoEStats(1, E))
    return layer.to(dtype)


def _reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, sum over sequences of the aux loss) by the definition, one token at a time."""
    b, s, _ = x.shape
    out = torch.zeros_like(x)
    aux = x.new_zeros(())
    for i in range(b):
        probs = [F.softmax(layer.router(x[i, t]), -1) for t in range(s)]
        share = x.new_zeros(E)
        for t in range(s):
            top = torch.topk(probs[t], K).indices.tolist()
            gates = probs[t][top] / probs[t][top].sum()
            for g, e in zip(gates, top):
                ex = layer.experts[str(e)]
                out[i, t] = out[i, t] + g * ex.proj(F.gelu(ex.fc(x[i, t])))
                share[e] += 1.0 / (s * K)
        aux = aux + E * (share * torch.stack(probs).mean(0)).sum()
    return out, aux


def test_matches_the_dense_loop_in_float64_forward_and_backward():
    layer = _layer()
    x = torch.randn(3, 5, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, D, dtype=torch.float64)
    y = layer(x)
    (y * w).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref, aux = _reference(layer, x)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12), (y - ref).abs().max()
    assert torch.allclose(layer.stats.aux_sum, aux.detach().reshape(1), rtol=0, atol=1e-12)
    # the layer's backward adds the aux term with weight coef * s (per sequence, module docstring)
    ((ref * w).sum() + COEF * x.shape[1] * aux).backward()
    for n, p in layer.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=0, atol=1e-12), (n, (got[n] - p.grad).abs().max())
    assert torch.allclose(gx, x.grad, rtol=0, atol=1e-12)


def test_dropless_every_token_reaches_its_k_experts():
    layer = _layer()
    x = torch.randn(4, 6, D, dtype=torch.float64)
    seen: dict[int, torch.Tensor] = {}
    for e in range(E):
        layer.experts[str(e)].register_forward_hook(
            lambda _m, args, _out, e=e: seen.__setitem__(e, args[0].detach().clone()))
    layer(x)
    flat = x.reshape(-1, D)
    chosen = layer.route(flat)[1]                       # (T, k)
    for e in range(E):
        tokens = (chosen == e).any(-1).nonzero().flatten()
        assert torch.equal(seen[e], flat[tokens]), f"expert {e} did not get exactly its tokens"
    assert layer.stats.counts.sum().item() == flat.shape[0] * K
    assert layer.stats.received.item() == flat.shape[0] * K


def test_aux_loss_per_sequence_is_independent_of_the_batch_split():
    layer = _layer(torch.float32)
    x = torch.randn(4, 6, D)
    layer(x)
    whole = layer.stats.aux_sum.clone()
    layer.stats.reset()
    layer(x[:1])
    layer(x[1:3])
    layer(x[3:])
    assert torch.allclose(layer.stats.aux_sum, whole, rtol=1e-6)
    assert layer.stats.sequences.item() == 4


def test_no_statistics_or_aux_in_evaluation():
    layer = _layer(torch.float32)
    with torch.no_grad():
        layer(torch.randn(2, 3, D))
    assert layer.stats.sequences.item() == 0


def test_parameter_counts_include_the_experts():
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4, n_experts=4,
                    top_k=2, moe_every=2)
    model = GPT(cfg)
    assert cfg.moe_blocks() == [1, 3]
    assert cfg.moe_hidden == 4 * 32 // 2
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    per_expert = sum(p.numel() for p in model.blocks[1].mlp.experts["0"].parameters())
    assert cfg.num_params() - cfg.num_params(active=True) == 2 * (E - K) * per_expert
    top4 = GPTConfig(**{**cfg.__dict__, "top_k": 4, "moe_hidden": 64})   # twice the active experts
    assert cfg.flops_per_token() < top4.flops_per_token()


@pytest.mark.parametrize("flags, flag", [
    (["--ep", "2"], "--ep"),                      # ep must divide dp x cp = 1
    (["--dp", "2", "--ep", "2", "--experts", "3", "--top-k", "1"], "--ep"),
    (["--top-k", "5"], "--top-k"),
    (["--moe-every", "3"], "--moe-every"),                # 2 layers: no MoE block
])
def test_unsupported_layouts_exit_2_naming_the_flag(capsys, flags, flag):
    base = ["train", "--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16",
            "--vocab-size", "64", "--global-batch", "8", "--steps", "1"]
    experts = [] if "--experts" in flags else ["--experts", "4"]
    assert_refused(capsys, [*base, *experts, *flags], flag)
