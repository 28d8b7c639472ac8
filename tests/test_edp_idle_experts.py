"""Idle experts under ZeRO-3 when the experts' group (``edp``) is not ``dp``, through
`trainmesh train`, against one process on the same batches.

With ``--ep``, the experts are a ZeRO-3 strategy of their own over ``edp`` (the dp x cp / ep
ranks holding the same experts), whose units hold a layer's experts (docs/ZERO.md): a rank
whose ep group routed no row of a microbatch to any of its experts of a layer does not reach
that unit at all, and passes it when the unit's backward opens (``Zero3._open_unreached``),
where a peer of its ``edp`` group whose ep group did route rows there reduce-scatters it once
its gradients are in, after that layer's ep all-to-all. Both must issue the same ``edp``
collectives in the same order, among the dense units' collectives over ``dp`` and the ep
all-to-alls, or the run hangs or mixes the units' gradients.

The model makes that happen several times in every run: 8 experts, top-1, every layer MoE, a
microbatch of one sequence of 2 tokens per rank (global batch 8, 2 microbatches), so an ep group
of 2 routes 4 rows per layer and a rank's 4 experts of a layer may all stay idle, on one rank
of an ``edp`` group and not on the other: counted in instrumented runs, 14 of the dp 4 x ep 2
run's 64 (rank, layer, microbatch) passed a whole unit at its open, on both layers, and 14 in
the zb1p pipeline's (1/16 each if the routing were uniform). Layouts, each with ``edp`` 2 (two ep groups, a rank's ``edp`` peer in the other):
ZeRO-3 at dp 4 x ep 2, and inside a pipeline at pp 2 x dp 4 x ep 2 (one MoE layer per stage)
under 1F1B and under zb1p. (dp 2 x ep 2 has ``edp`` 1: its collectives over ``edp`` are
no-ops, the order cannot differ; it passes, and is left out to save its run.) Per step, loss
within LOSS_ABS and grad norm within NORM_REL of the one process, the routing counts within 2
(test_zb1p_experts.run_as_one_process); the ranks' collectives compared every step
(``TRAINMESH_CHECK_COLLECTIVES=1``) and a stalled collective ended after 30 s (``--timeout``)
with the diagnosis, so a rank reducing a unit where its peer does not fails the run instead of
hanging the test. No code change was needed.

Planted: ``_open_unreached`` passing nothing (the unit reduced at the end of the backward, or
at the pipeline's finish): dp 4 x ep 2 fails with "AssertionError: trainmesh train: rank 0 on
vm: reduce_scatter on dp failed (op #105): Application timeout caused pair closure; diagnosis:
rank 3 diverged at op #68: rank 3 ran all_gather@edp(640,) while ranks 0, 1, 2 ran nothing",
1F1B and zb1p with "diagnosis: rank 4, 5, 6, 7 diverged at op #1: ... while ranks 0, 1, 2, 3
ran all_gather@dp(16,)" (about 35 s each). A unit not reached at all passed at once, before
the backward (as a partly reached unit's other parameters): dp 4 x ep 2 fails with
"reduce_scatter on edp failed (op #82): ...; diagnosis: rank 2, 3 diverged at op #50: rank 2
ran reduce_scatter@edp(32768,); rank 3 ran reduce_scatter@edp(32768,) while ranks 0, 1 ran
nothing", 1F1B with "rank 4, 5, 6, 7 diverged at op #1".
"""
from __future__ import annotations

import pytest
from test_zb1p_experts import BASE as ZB1P_BASE
from test_zb1p_experts import run_as_one_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BASE = [*ZB1P_BASE, "--seq-len", "2", "--global-batch", "8"]   # the later value of a flag wins
TOKENS = 8 * 2                                                  # per step
ZERO3 = ["--zero", "3", "--dp", "4", "--ep", "2", "--microbatches", "2", "--timeout", "30"]
LAYOUTS = {
    "dp4-ep2-zero3": ZERO3,
    "pp2-dp4-ep2-zero3-1f1b": [*ZERO3, "--pp", "2", "--schedule", "1f1b"],
    "pp2-dp4-ep2-zero3-zb1p": [*ZERO3, "--pp", "2", "--schedule", "zb1p"],
}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_idle_expert_units_over_edp_equal_one_process(label, reference_run, tmp_path, monkeypatch):
    run_as_one_process(BASE, LAYOUTS[label], reference_run(BASE), TOKENS, tmp_path, monkeypatch)
