"""DiLoCo through ``trainmesh train``: with one inner step, outer lr 1, no outer momentum and
plain SGD it is DP step by step; at eight inner steps it sends an eighth of DP's bytes and
still learns; a run resumed between two synchronisations (from an --async-save checkpoint)
continues the uninterrupted one. Replicas that are themselves several ranks — ZeRO-2 inside
each (--dp 4 --dp-shard 2: 2 replicas of 2 ranks), tp inside each, pp in bf16 — follow a
one-process reference of the same DiLoCo semantics step by step: one Engine per replica on its
rows, and every H steps ``torch.optim.SGD(nesterov=True)`` on the averaged parameter change.
One job per configuration, several checks on each.

Planted and seen failing: the outer gradient summed over the replicas, not averaged, and each
replica's gradient scaled by the global token count instead of its own (both: the loss of step
2 off by > 0.02 against DP); the inner-step count not restored on resume (the resumed run
synchronises at step 36 instead of 32); heavy-ball outer momentum in place of Nesterov's (the
sharded replicas against the reference: loss off by ~3e-2 from step 3); a replica of 2 ranks
scaling by one rank's token count (off at step 1).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from helpers import SMALL, run_train, steps, summary
from tolerances import LOSS_ABS, MIXED_PRECISION_LOSS_ABS

from trainmesh.cli import main

pytestmark = pytest.mark.slow

SGD = [*SMALL, "--optimizer", "sgd", "--grad-clip", "0", "--dp", "2"]
AS_DP = ["--strategy", "diloco", "--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0"]
# H = 8 with the default outer step (lr 0.7, Nesterov 0.9) and AdamW inside; saves at step 28,
# half-way between the synchronisations of steps 24 and 32.
H8 = [*SMALL, "--dp", "2", "--strategy", "diloco", "--inner-steps", "8", "--steps", "40",
      "--lr", "0.01", "--save-every", "28", "--async-save"]


def _ok(result):
    proc, records = result
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    return _ok(run_train(SGD, tmp_path_factory.mktemp("dp")))


@pytest.fixture(scope="module")
def h8_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h8")
    return _ok(run_train([*H8, "--save-dir", str(tmp / "ck")], tmp)), tmp / "ck"


def _dp_bytes(records) -> dict:
    return summary(records)["ranks"][0]["comm_bytes_per_step"]


@pytest.mark.timeout(240)
def test_one_inner_step_is_dp(dp_run, tmp_path):
    records = _ok(run_train([*SGD, *AS_DP], tmp_path))
    ref, run = steps(dp_run), steps(records)
    assert len(ref) == len(run) == 20
    for a, b in zip(ref, run):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] is None and b["outer"] is True, b
    # the same bytes as DP: one all-reduce of the 4-byte parameters per step
    assert _dp_bytes(records)["dp"] == _dp_bytes(dp_run)["dp"]
    assert summary(records)["layout"]["strategy"] == "diloco"


@pytest.mark.timeout(240)
def test_eight_inner_steps_send_an_eighth_and_learn(dp_run, h8_run):
    records, _ = h8_run
    run = steps(records)
    params = summary(records)["params"]
    sent = _dp_bytes(records)
    # dp: the outer all-reduce of Δ, 4Ψ bytes every 8 steps; DP all-reduces 4Ψ every step
    assert _dp_bytes(dp_run)["dp"] == {"all_reduce": 4 * params}
    assert sent["dp"]["all_reduce"] == pytest.approx(4 * params / 8, rel=1e-12)
    # other: the loss sum, token count and each replica's token count (2 + 2 float64) and each
    # replica's squared gradient norm (2 float32)
    assert sent["other"] == {"all_reduce": pytest.approx((2 + 2) * 8 + 2 * 4, rel=1e-12)}
    assert [r["step"] for r in run if r.get("outer")] == [8, 16, 24, 32, 40]
    assert all(r["grad_norm"] is None for r in run)
    assert run[-1]["loss"] < 0.6 * run[0]["loss"], (run[0]["loss"], run[-1]["loss"])


@pytest.mark.timeout(240)
def test_resume_between_synchronisations(h8_run, tmp_path):
    records, ck = h8_run
    saves = [r for r in records if r["event"] == "save"]
    assert [s["step"] for s in saves] == [28, 40]
    resumed_dir = tmp_path / "ck"
    shutil.copytree(ck, resumed_dir)
    shutil.rmtree(resumed_dir / "step-00000040")
    resumed = steps(_ok(run_train([*H8, "--save-dir", str(resumed_dir), "--resume"], tmp_path)))
    want = steps(records)[28:]
    assert [r["step"] for r in resumed] == list(range(29, 41))
    for a, b in zip(want, resumed):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (a["step"], a["loss"], b["loss"])
        assert a.get("outer") == b.get("outer"), a["step"]


def reference_diloco(args: list[str], replicas: int) -> list[float]:
    """The losses of ``trainmesh train ARGS`` (a DiLoCo run of ``replicas`` replicas) computed
    in this one process: replica r is a one-process Engine on rows [r/R, (r+1)/R) of each global
    batch (the run's optimizer, LR schedule, clipping and precision); every H steps the replicas'
    mean parameter change Δ = mean_r(θ - θ_r) steps θ through torch.optim.SGD(nesterov=True,
    lr=outer lr, momentum=outer momentum), and every replica restarts from θ."""
    from trainmesh import Engine, ParallelConfig, ParallelMesh
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    from trainmesh.models.gpt import GPT
    from trainmesh.run.optimizers import no_decay, optimizer_factory
    from trainmesh.run.schedule_lr import warmup_cosine
    cfg = build_train_config(collect(build_parser().parse_args(["train", *args]), True))
    p, gpt = cfg.parallel, cfg.gpt_config()
    one = ParallelConfig(precision=p.precision, grad_clip=p.grad_clip)
    engines = [Engine(GPT(gpt, seed=cfg.seed), optimizer_factory(cfg, torch.device("cpu")),
                      lambda m, b: m(**b), one, mesh=ParallelMesh(local=True), param_groups=no_decay,
                      lr_scheduler=lambda o: warmup_cosine(o, warmup_steps=cfg.warmup_steps,
                                                           total_steps=cfg.steps))
               for _ in range(replicas)]
    # θ: fp32, as the replicas' optimizers hold it (their fp32 masters in bf16)
    theta = [t.detach().clone() for t in engines[0].grad_sync.optimizer_params()]
    outer = torch.optim.SGD(theta, lr=p.outer_lr, momentum=p.outer_momentum,
                            nesterov=p.outer_momentum > 0)
    data = SyntheticCorpus(gpt.vocab_size, gpt.seq_len)
    losses = []
    for k in range(cfg.steps):
        batch = data.batch(cfg.seed, k + 1, cfg.global_batch)   # steps count from 1
        losses.append(sum(e.train_step(dp_slice(batch, r, replicas)) for r, e in enumerate(engines))
                      / replicas)
        if (k + 1) % p.inner_steps == 0:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    t.grad = sum(t - e.grad_sync.optimizer_params()[i] for e in engines) / replicas
                outer.step()
                for e in engines:
                    for mine, t in zip(e.grad_sync.optimizer_params(), theta):
                        mine.copy_(t)
                    e.grad_sync.params_changed()
    return losses


SHARDED = [*SMALL, "--strategy", "diloco", "--inner-steps", "2", "--steps", "8", "--lr", "0.01"]
REPLICA_LAYOUTS = {
    # 2 replicas of 2 ranks, ZeRO-2 inside each: outer step over dp_replicate on each shard;
    # SGD inside, no clipping (linear in the gradient: a replica's mean over its own tokens shows)
    "zero2-inside": (["--dp", "4", "--dp-shard", "2", "--zero", "2", "--optimizer", "sgd",
                      "--lr", "0.1", "--grad-clip", "0"], 2, LOSS_ABS),
    # 2 replicas of a tp pair each, fp32
    "tp-inside": (["--dp", "2", "--tp", "2"], 2, LOSS_ABS),
    # 2 replicas of 2 pipeline stages, bf16: the outer step on the fp32 masters; the reference
    # computes in bf16 too, on one process (the same arithmetic but for reduction order and
    # bf16 rounding: MIXED_PRECISION_LOSS_ABS)
    "pp-inside-bf16": (["--dp", "2", "--pp", "2", "--precision", "bf16"], 2, MIXED_PRECISION_LOSS_ABS),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label", list(REPLICA_LAYOUTS))
def test_replicas_of_several_ranks_follow_the_one_process_reference(label, tmp_path):
    """Bugs: heavy-ball outer momentum instead of Nesterov's; the outer step on the wrong group
    (averaging a replica's shards with each other); a replica's gradient scaled by one rank's
    token count; the outer state in bf16."""
    layout, replicas, tol = REPLICA_LAYOUTS[label]
    args = [*SHARDED, *layout]
    run = steps(_ok(run_train(args, tmp_path, timeout=240)))
    want = reference_diloco(args, replicas)
    assert [r["step"] for r in run if r.get("outer")] == [2, 4, 6, 8]
    assert len(run) == len(want) == 8
    for r, loss in zip(run, want):
        assert abs(r["loss"] - loss) <= tol, (label, r["step"], r["loss"], loss)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,flag", [
    (["--dp", "2", "--zero", "1"], "--zero"), (["--dp", "2", "--ep", "2", "--experts", "2"], "--ep"),
    (["--dp", "2", "--cp", "2", "--dp-shard", "1", "--zero", "1"], "--cp"),
    (["--dp", "2", "--fault-tolerant"], "--fault-tolerant"),
    (["--outer-momentum", "1"], "--outer-momentum"),
])
def test_layouts_that_mean_nothing_are_refused(args, flag, capsys):
    assert main(["train", "--strategy", "diloco", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0], err


@pytest.mark.timeout(60)
def test_diloco_flags_need_the_strategy(capsys):
    assert main(["train", "--inner-steps", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--inner-steps" in err[0] and "--strategy diloco" in err[0], err
