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

The model makes that happen many times in every run: 8 experts, top-1, every layer MoE, one
sequence of 2 tokens per rank and microbatch (global batch 8), so a rank's experts of a layer
may all stay idle, on one rank of an ``edp`` group and not on the other. Layouts, each with
``edp`` 2 (a rank's ``edp`` peer in another ep group):

* ZeRO-3 at dp 8 x ep 4 (2 experts a rank; an ep group of 4 routes 8 rows a layer): in an
  instrumented run 32 of the 64 (rank, layer, step) passed a whole unit at its open, two ep
  peers idle at the same layer among them, and in step 3 both ranks of one ``edp`` group idle
  at both layers (the experts' strategy's whole shard without a gradient anywhere in its
  group: it must take no step);
* inside a pipeline at pp 2 x dp 4 x ep 2 (one MoE layer per stage, 4 experts a rank, 2
  microbatches) under 1F1B and under zb1p: 14 of the 64 (rank, stage, microbatch) passed a
  whole unit at its open (1/16 each if the routing were uniform).

dp 4 x ep 2 without a pipeline (the stages' layout, Zero3 rather than PipelineZero3) and
dp 2 x ep 2 (``edp`` 1: its collectives over ``edp`` are no-ops) pass too and are left out to
save their runs. Per step, loss within LOSS_ABS and grad norm within NORM_REL of the one
process, the routing counts within 2 (test_zb1p_experts.run_as_one_process); the ranks'
collectives compared every step (``TRAINMESH_CHECK_COLLECTIVES=1``) and a stalled collective
ended after 30 s (``--timeout``) with the diagnosis, so a rank reducing a unit where its peer
does not fails the run instead of hanging the test.

Planted: ``_open_unreached`` passing nothing (the unit reduced at the end of the backward, or
at the pipeline's finish): dp 8 x ep 4 fails with "AssertionError: trainmesh train: rank 1 on
vm: reduce_scatter on dp failed (op #43): Application timeout caused pair closure; diagnosis:
rank 7 diverged at op #7: rank 7 ran all_gather@edp(16384,) while ranks 0, 1, 2, 3, 4, 5, 6
ran nothing", 1F1B and zb1p with "diagnosis: rank 4, 5, 6, 7 diverged at op #1: ... while
ranks 0, 1, 2, 3 ran all_gather@dp(16,)" (about 35 s each). A unit not reached at all passed
at once, before the backward (as a partly reached unit's other parameters): dp 8 x ep 4 fails
with "reduce_scatter on edp failed (op #25): ...; diagnosis: rank 1, 2, 3, 5, 7 diverged at
op #11: rank 1 ran all_to_all@ep(2, 32); ... while ranks 0, 4, 6 ran all_to_all@ep(0, 32)"
(idle ranks waiting on ``edp`` before their ep all-to-all), 1F1B with "rank 4, 5, 6, 7
diverged at op #1". The flat shard's stepper stepping a group every member of which is idle
(data_parallel/shard_step.py, as it did): dp 8 x ep 4 fails with "AssertionError: step 4: loss
4.187092304229736 vs 4.183386325836182" (that rank's experts moved by ~4e-3 in step 3).
"""
from __future__ import annotations

import pytest
from test_zb1p_experts import BASE as ZB1P_BASE
from test_zb1p_experts import run_as_one_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BASE = [*ZB1P_BASE, "--seq-len", "2", "--global-batch", "8"]   # the later value of a flag wins
TOKENS = 8 * 2                                                  # per step
ZERO3 = ["--zero", "3", "--timeout", "30"]
PP = [*ZERO3, "--pp", "2", "--dp", "4", "--ep", "2", "--microbatches", "2"]
LAYOUTS = {
    "dp8-ep4-zero3": [*ZERO3, "--dp", "8", "--ep", "4"],
    "pp2-dp4-ep2-zero3-1f1b": [*PP, "--schedule", "1f1b"],
    "pp2-dp4-ep2-zero3-zb1p": [*PP, "--schedule", "zb1p"],
}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_idle_expert_units_over_edp_equal_one_process(label, reference_run, tmp_path, monkeypatch):
    run_as_one_process(BASE, LAYOUTS[label], reference_run(BASE), TOKENS, tmp_path, monkeypatch)
