"""Every numerical tolerance of the suite, each derived from the arithmetic it allows for.

Two kinds of comparison:

* **Training runs** (Engine or ``trainmesh train``, many steps): the README's promise, loss within
  ``LOSS_ABS`` and grad norm within ``NORM_REL``. Reduction-order noise (~1e-7 relative per step)
  grows through AdamW's normalisation to ~1e-5 over 20 steps; every planted bug below moves a loss
  or a norm by more than 1e-2 within a few steps.
* **One computation against a float64 reference** (layer parity, one step's gradients): the
  float32 result may carry the rounding of its reductions and nothing more. A float32 sum of n
  terms of magnitude <= s errs by about sqrt(n) * eps * s (random-walk rounding; n * eps * s worst
  case, Higham, "Accuracy and Stability of Numerical Algorithms", sec. 4.2). The result itself is
  no measure of s: a gradient that cancels to ~0 (a key bias, a bias summed over b*s tokens of both
  signs) still carries the rounding of its large terms. So the scale is the largest magnitude of
  that kind of quantity in the computation (the largest output, the largest gradient of the
  model), and ``FP32_SAFETY`` covers the few layers each adding their own rounding. Being
  independent of the CPU's summation order, this holds on any x86/ARM CPU and any torch >= 2.5.

Planted bugs the suite is known to catch (each was put back by hand and seen failing with an
assertion, not a timeout):

============================================  ==================================================
bug                                           caught by
============================================  ==================================================
DDP gradients summed instead of averaged      test_ddp: planted scale bug; gradients vs float64
one TP all-reduce removed (fwd or bwd)        test_tensor_parallel: test_parity_tp2 / tp4
ZeRO-3 backward prefetches the wrong unit     test_step_semantics: zero3_prefetches_...
warm-up off by one                            test_step_semantics: warmup_cosine_...;
                                              test_train_cli: lr_column_...
lr column read after the scheduler stepped    test_train_cli: lr_column_...
LR scheduler stepping on skipped fp16 steps   test_step_semantics: fp16_skipped_step_...
initial DP broadcast of weights skipped       test_step_semantics: dp_replicas_start_...
fp16 loss-scaler state missing in checkpoint  test_step_semantics: fp16_..._survives_a_checkpoint
DDP bucket with an unused parameter unreduced test_step_semantics: bucket_with_an_unused_...
clipping with a rank's local norm             test_step_semantics: clipping_uses_the_global_norm
fp16 skip decided per rank                    test_precision: overflow_on_one_rank_... (20 s
                                              collective timeout, reported as an assertion)
a tensor batch iterated as rows               test_batches: a_tensor_batch_is_one_batch_...
auto device on fewer GPUs than local ranks    test_device (GPU count monkeypatched)
GPT-2 c_attn split as one column chunk        test_hf_tp: grad_norm at step 1
attention head count left global under tp     test_hf_tp: the GPT-2 run reports its failure
parallel_input reading positional args only   test_hf_tp: the Llama run reports its TypeError
fused qkv shard read as one slice / gathered  test_hf_tp: loaded first loss / consolidated
  in rank order / checkpoint sliced as one    weights / reloaded checkpoint vs the saved ones
elastic dp that breaks the global batch,      test_elastic: resize_picks_... / fit_world_...
or microbatches not raised on a shrink
a returning node's workers start from step 1  test_elastic: lose_a_node_then_get_it_back (loss)
an elastic restart rewrites the metrics file  test_elastic: lose_a_node_... (resize records)
zb1p: W pass skipped for one microbatch       test_pipeline: equivalence_world2 (pp2-zb1p)
ZeRO-2 in a pipeline: full gradients kept,    test_pipeline: zero_inside_pipeline_memory_...
  reduced once after the last backward        (dp.reduce_scatter m x 4Psi)
ZeRO-2 in a pipeline: the second round of     test_pipeline: equivalence_world4
  buckets never reduced                       (dp2-pp2-zero2)
ZeRO-3 reshard step: units freed between      test_pipeline: zero_inside_pipeline_memory_...
  microbatches (re-gathered)                  (dp.all_gather 4Psi per step)
ZeRO-3 reshard microbatch: units kept after   test_pipeline: zero_inside_pipeline_memory_...
  their forward                               (dp.all_gather 2m x 4Psi)
zb1p W producing weight gradients first       test_pipeline: zero_inside_pipeline_memory_...
  layer first: ZeRO-2 stages every bucket     (transient buckets below 8 buckets)
zb1p with experts, ZeRO-1/2: the walk at W    test_zb1p_experts (ZeRO-1: a rank aborted on
  left out (an idle expert never passes its   a size mismatch; ZeRO-2: a stall diagnosed;
  round)                                      ep 2 ZeRO-2: grad norm 0.4% off at step 2)
split backward: intermediates not pinned to   test_split_backward: weight_used_at_several_...
  their recorded gradients (counted twice)
ZeRO state keys gathered in a per-process     test_checkpoint_chain (moments, negative
  set order after a load                      exp_avg_sq, or the next resume's exit 1)
--resume loading a corrupt newest checkpoint  test_checkpoint_ops: resume_skips_a_corrupt_...
consolidate overwriting OUT / a piece of DIR  test_checkpoint_ops: consolidate_never_destroys
manifest paths not confined to the directory  test_checkpoint_ops: manifest_cannot_name_...
SP partial gradients not summed over tp by   test_tp_train_path: matrix_matches_one_process
  the engine (grad_norm 12% low at step 1)      (every SP layout, world 2 and 4)
SP tp-sum skipped on ZeRO-2/3 shard pieces    test_tp_train_path: matrix (dp2-tp2-sp-zero2/3)
sequence_parallel style recording no partial  test_tensor_parallel: parity_tp2 (LayerNorm grads)
  gradient (LayerNorms)
ZeRO-3 units from a ModuleDict's children     test_any_model: nanogpt_in_a_module_dict_...
  (transformer.h whole: its hooks never fire)  (the step's error reported)
unused parameter handed a zero gradient        test_any_model: unused_parameters_get_no_update
  (DDP, or idle flat-shard elements stepped)   (the unused branch moved by ~2e-3)
an idle parameter's step count advanced with   test_idle_params: zero_steps_each_parameter_...
  the flat shard's (ZeRO 1-3, offload)         (step 4.0 vs 3.0); moe_idle_expert_untouched_...
                                              (the idle expert changed); test_any_model:
                                              unused_parameters_... (state keys differ)
MoE expert run on zero rows (gradient zeros,   test_idle_params: moe_does_not_run_an_expert_...;
  not None)                                    moe_idle_expert_untouched_... (expert changed)
ZeRO-3: a unit holding a parameter idle on one test_idle_params: moe_idle_expert_untouched_...
  rank reduced after the others (order differs) (a collective's 30 s timeout, reported)
ZeRO-3 with ep: a unit of experts no row      test_edp_idle_experts (dp 8 x ep 4, pp 2 x dp 4
  reached not passed at its open (reduced at   x ep 2 1F1B and zb1p: a stall diagnosed after
  the end), or passed before the backward      30 s, "rank 7 diverged at op #7")
ZeRO 1-3: a group every member of which is    test_idle_params: a_group_every_parameter_...
  idle stepped whole (zero gradients)         (weights 3.5e-2 off); test_edp_idle_experts
                                              (dp 8 x ep 4: loss 3.7e-3 off at step 4)
buffers never broadcast                        test_any_model: buffers_follow_ddp_... (~0.9)
no agreement on the unit before a gather       test_any_model: module_on_some_ranks_is_named
Phi-3 fused qkv split as one slice             test_hf_families: phi3 (loss off by 1.6e-2)
Phi-3 attention config left global             test_hf_families: phi3 (its error reported)
Qwen3 q/k norm gradients not all-reduced       test_hf_families: qwen3 (k_norm off by 1.7e-3)
tied alias missing from full_state_dict (tp)   test_hf_families: tied_alias_under_tp_...
tied alias missing from consolidate           test_hf_families: model_dir_any_family_...
GPT -> GPT-2 export fusing q, k, v misordered  test_export_hf: builtin_gpt_exports_... (0.2)
HF experts stacked in string order (10 < 2)    test_hf_moe: weights_read_...; qwen2_moe run
                                              (loss off by 4.7e-2 at step 1)
HF router's routing weights detached           test_hf_moe: layouts_train_like_... (the engine
                                              names the router as receiving no gradient)
export-hf writing stacked expert names         test_hf_moe: checkpoints_resume_... (key set)
export-hf leaving out a persistent buffer,     test_hf_buffers: export_hf_writes_the_...
  or writing it at its init                    (key missing; zeros, logits 3.9 off)
a checkpoint leaving out the buffers of every  test_hf_buffers: a_multi_process_...[pp2] (key
  pipeline stage but the first                 missing from the export)
HF ep: experts reduced over dp, not edp        test_hf_moe: layouts_train_like_one_process
                                              [mixtral ep] (norm 1.1e-3 rel at step 1, loss
                                              1.3e-2 at step 2)
HF ep: shared experts placed as routed         test_hf_moe: layouts_...[qwen2_moe tp ep zero2]
  experts (reduced over edp)                   (norm 1.9e-3 rel, step 1); test_hf_moe_families
                                              (deepseek_v3 dp2 ep2: loss 6.4e-3, step 2)
HF router aux over a rank's batch, not per     test_hf_moe: one_process_trains_like_plain_...
  sequence                                     (aux 8.4 vs 2.2 at step 1)
HF router aux left out of the gradient         test_hf_moe: one_process_... (norm, step 1)
HF tp: an attention projection read as a       test_hf_moe_families: olmoe tp2 (its error
  fused gate/up pair (OLMoE's q_proj)          reported)
HF tp: an MoE block holding split shared       test_hf_moe_families: deepseek_v3 tp2 (norm
  experts given parallel_input (router grad    3.823 vs 3.811 at step 1)
  summed tp times)
HSDP: shards not all-reduced across replicas   test_hsdp: zero2 (grad_norm 1.40 vs 0.98, step 1)
HSDP: shard and replica groups swapped         test_hsdp: zero2 (traffic keyed on the wrong
                                              axis: dp_shard.all_reduce)
a sync reducing over dp, not its own group     test_grad_sync_compose (expert grads off by ~2e-2)
MoE: a routed slot dropped from the combine    test_moe: matches_the_dense_loop (0.24)
MoE: gates not renormalised over the top k     test_moe: matches_the_dense_loop (0.29)
MoE: aux gradient without the sequence weight  test_moe: matches_the_dense_loop (router grad)
EP: a received row dropped in the exchange     test_expert_parallel: dp4-ep4 (norm, step 2)
EP: expert gradients reduced over dp, not edp  test_expert_parallel: dp4-ep2-zero1 (norm, step 1)
EP: experts' start broadcast over dp, not edp  test_expert_parallel: python_api_... (2.7e-3)
EP ZeRO-3: experts' units over dp, not edp    test_expert_parallel: dp4-ep2-zero3 (norm, step 1)
EP ZeRO-3: experts' reduce-scatter left out   test_expert_parallel: dp4-ep2-zero3 (norm, step 1)
EP ZeRO-3: experts skipped on a load          test_expert_parallel: dp4-ep2-zero3 (resume back)
EP ZeRO-3: experts missing in full_state_dict test_expert_parallel: python_api_... (weights)
EP under pp: experts reduced over dp          test_expert_parallel: pp2-dp2-ep2 (norm, step 1)
MoE activations: k copies not counted         test_planner: moe_activation_count_... (k = 2)
MoE slot counts not summed over cp            test_layout_matrix: moe-cp2 (grad norm 4% off)
MoE slot counts not summed over tp under SP   test_layout_matrix: moe-tp2-sp (6% off)
HSDP x tp: replicas' all-reduce skipped       test_layout_matrix: dp4-shard2-zero3-tp2 (57% off)
offload x SP: host copies not retaken after   test_layout_matrix: dp2-zero1-offload-tp2-sp
  the tp sum                                    (grad norm 7% off)
fault-tolerant: failed step applied anyway     test_fault_tolerance: replica_lost_... (step 5
  (not discarded)                               loss off by 3.5e-2)
fault-tolerant: batch not re-split among the   test_fault_tolerance: replica_lost_... (step 5
  replicas present (split by --dp)              loss off by 9.7e-3)
fault-tolerant: joiner keeps its own weights   test_fault_tolerance: replica_lost_... (step 12
  (live state not loaded)                       loss off by 0.2)
fault-tolerant 2-rank replica: a joiner's     test_fault_tolerance_shards: a_rank_lost_...
  rank j paired with the source's other rank    (step 10 loss off by 0.19)
fault-tolerant 2-rank replica: the failed      test_fault_tolerance_shards: a_rank_lost_...
  step's gradients dropped by rank 0 only       (step 5 loss off by 0.12)
fault-tolerant 2-rank replica: each rank       test_fault_tolerance_shards: failures_during_...
  keeps its own outcome (no agreement)          (step 2 grad_norm 1.38 vs 2.12)
fault-tolerant: the lead treats its own       test_fault_tolerance_everything: checkpoints_...
  discarded attempt as taken (a checkpoint of   (step 8 loss 1.17 vs 1.37)
  a step not every replica committed)
fault-tolerant: fp16 overflow decided on a     test_fault_tolerance_everything: ...[cp2-moe-
  replica's own gradient                        fp16] (step 6 non-finite grad_norm: exit 1)
fault-tolerant: a restarted coordinator takes  test_fault_tolerance_hosts: coordinator_...
  the oldest step held as committed             ("a step applied twice": 12, 12)
fault-tolerant: a replica back from a silence  test_fault_tolerance_hosts: coordinator_...
  behind the committed step not sent the state  (step 9 loss 3.99 vs 3.86)
fault-tolerant: the remainder rows dropped     test_fault_tolerance: uneven_split_covers_...
  by the re-split                               (the last piece ends at 6 of 7 rows)
ZeRO-2 accumulation overwriting the shard     test_zero: stages_..._at_dp2 (zero2-m2, 6 steps)
param_groups options dropped at ZeRO          test_zero: stages_..._at_dp2 (zero1-groups, 2e-3)
a trainer's push lost on a PS server          test_parameter_server: sync_is_data_parallel
AdamW's exp_avg_sq misread on load            test_checkpoint: resume_under_another_layout
eval loss off under dp > 1                    test_observe: eval_loss_is_the_same_... (1e-2)
frozen parameters of a meta model never       test_frozen_params (each stage's error reported:
  materialised                                a meta tensor in the forward)
frozen layer not broadcast from the DP root   test_frozen_params (0.weight differs by rank)
frozen parameters missing from checkpoints    test_frozen_params (0.weight reloaded)
HF cp: rotary positions local to the chunk    test_hf_axes: layout_trains_like_one_process
                                              (cp2, loss at step 1)
HF pp: a stage dropping the position state    test_hf_axes: pipeline_stages_compose_... (logits)
HF SP: norm gradients not summed over tp      test_hf_axes: layout_trains_like_one_process
                                              (tp2-sp, grad_norm)
HF selective recompute not checkpointing      test_hf_axes: selective_recompute_... (call count)
GQA ring: k/v heads repeated tiled            test_context_parallel: grouped_query_ring_...
a float64 model's gradients reduced, its loss  test_fp64_layouts: float64_layouts_equal_... (a
  (plain or vocab-parallel) or its grad norm    weight 1e-8 or a norm 2e-8 off, bound ~1e-13)
  computed in float32
Muon tp x ZeRO: tp owners balanced over every  test_muon_zero_owners: tp_x_zero_owners_... (a
  cut matrix, not per ZeRO owner; a tp rank     rank's FLOPs 2x its table's; weights 1.7e-2
  handed the other's shard of a result          off the every-rank run's, bound 0)
============================================  ==================================================
"""
from __future__ import annotations

import math

import torch

LOSS_ABS = 1e-3
"""README.md: per-step loss of a layout vs one process (absolute). Catches a DP sum instead of a
mean (the loss drifts by > 1e-2 within 5 AdamW steps), a missing all-reduce, a wrong LR."""

NORM_REL = 1e-3
"""README.md: per-step grad norm vs one process (relative). A sum instead of a mean is x dp;
a TP-replicated parameter counted twice moves it by > 1e-2."""

MOMENT_REL = 2 * NORM_REL
"""A saved optimizer moment vs the one-process run's at the same step, as a fraction of the
largest magnitude of that kind of moment in the model: first moments are averages of
gradients (within ``NORM_REL``), second moments of their squares (twice the relative error).
Ranks gathering each other's moments, or a moment swapped with another, are off by the
moments' own scale."""

FP32_EPS = torch.finfo(torch.float32).eps
"""2**-23: one float32 rounding, relative."""

FP32_SAFETY = 16.0
"""Layers each adding their rounding (forward, backward, a loss): a tiny model has <= ~8 such
stages in a chain; x2 margin. The budget is then 16 * eps * sqrt(n) = 2e-5 .. 8e-5 of the scale
for n = 100 .. 1500 terms. A removed all-reduce or a wrong factor errs by the tensor's own
magnitude, >= 1e-3 of the scale for every gradient here that is not zero by symmetry: >= 12x
above the budget. Headroom for other CPUs: the TP parity checks also pass with a safety of 1."""


def fp32_atol(scale: float, terms: int) -> float:
    """Absolute rounding budget of a float32 result built from sums of ``terms`` values of
    magnitude <= ``scale``."""
    return FP32_SAFETY * FP32_EPS * math.sqrt(max(terms, 1)) * float(scale)


def scale_of(tensors) -> float:
    """The largest magnitude among ``tensors`` (float64): the scale of their summands."""
    return max(float(t.detach().abs().max()) for t in tensors if t is not None and t.numel())


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor, *, scale: float, terms: int,
                      what: str = "") -> None:
    """``got`` (float32, any summation order) equals ``want`` (a float64 reference) up to the
    rounding of sums of ``terms`` values of magnitude <= ``scale``."""
    atol = fp32_atol(scale, terms)
    err = float((got.detach().double() - want.detach().double()).abs().max()) if got.numel() else 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert err <= atol, f"{what}: max error {err:.3e} > {atol:.3e} (scale {scale:.3e}, {terms} terms)"


LOSS_ONE_STEP_REL = 64 * FP32_EPS
"""A loss over one batch (no training yet) computed in another order/partition: a mean of
cross-entropies is a sum over the tokens of values of the loss's own magnitude; for the <= 1024
tokens here sqrt(n) * eps * 16 <= 512 eps covers it; in practice 64 eps with a loss of ~4 is
3e-5, and a wrong microbatch weighting or a missing stage moves it by > 1e-2."""


def loss_one_step_atol(loss: float, tokens: int) -> float:
    """Budget of one step's mean loss over ``tokens`` tokens, of magnitude ``loss``."""
    return fp32_atol(abs(loss), tokens)


SAME_KERNELS_ABS = 1e-6
"""Two runs that execute the same kernels on the same inputs in the same order (recomputation
replays the forward; a pipeline of one model vs an nn.Sequential of it) are bit-identical on any
CPU; 1e-6 only admits a library choosing another kernel for a recomputed shape. A recompute bug
(a stale input, a skipped layer) moves the loss by > 1e-3 in one step."""

SHORT_RUN_REL = 1e-5
"""A few (<= 3) SGD steps of a small model under another microbatch split, relative to the loss
(or norm): ~1e-7 of rounding per reduction, amplified at most ~10x per step by the update. A lost
or doubled microbatch moves the loss by > 10%."""

TRAINED_WEIGHTS_LOSS_ABS = 1e-4
"""The loss of weights trained 10 AdamW steps under another layout, evaluated once against the
reference run's loss on the same batch: AdamW turns reduction-order noise into ~1e-5 of weight
drift; a misplaced or stale shard moves the loss by > 1e-2."""

TRAINED_WEIGHTS_ABS = 2e-3
"""Consolidated weights of a sharded run vs the one-process run's weights after 20 AdamW steps:
AdamW moves each weight by ~lr per step whatever the gradient's size, so reduction-order noise
that flips a small gradient's sign costs up to ~lr (1e-2) x a few steps on a few elements; kept
to 2e-3 as observed well below it. A misplaced shard is off by the init scale (0.02-1)."""

MIXED_PRECISION_LOSS_ABS = 0.05
"""bf16/fp16 loss curves vs fp32 over 30 steps (loss 4.2 -> 2.2): bf16 rounds to 2^-8 relative
per op (~4e-3), fp16 to 2^-11; observed gaps: bf16 0.022, fp16 0.007 (16-bit parameters and
gradients, fp32 masters). A lost loss scale or an unscaled
gradient diverges by > 0.5."""

FP64_EPS = torch.finfo(torch.float64).eps
"""2**-52: one float64 rounding, relative (the ring-attention math against plain attention)."""


def fp64_atol(scale: float, terms: int) -> float:
    """:func:`fp32_atol` for a float64 computation: a wrong log-sum-exp merge, a mask off by a
    chunk or a lost dK/dV hop errs by the result's own magnitude, ~1e10 times above it."""
    return FP32_SAFETY * FP64_EPS * math.sqrt(max(terms, 1)) * float(scale)
