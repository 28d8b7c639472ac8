"""The training state beside the tensors (step, learning rates, LR schedule, loss scaler, RNG) is
one piece: saved in a checkpoint's ``trainer`` record and restored from it, also from a
checkpoint written before the generators were part of it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tolerances import LOSS_ABS, NORM_REL

from trainmesh.config.train import build_train_config
from trainmesh.data.corpus import make_datasets
from trainmesh.run.trainer import build_engine

OLD = Path(__file__).parent / "data" / "checkpoint_v1"
"""Written by ``trainmesh train --layers 1 --d-model 8 --heads 2 --seq-len 8 --vocab-size 16
--global-batch 2 --steps 6 --exit-after 3 --warmup-steps 2 --precision fp16 --save-dir`` before
the training state had its own class (no ``rng`` in its record): step 3, the fp16 scale search
at 2^13 after three skipped steps, the LR schedule not yet advanced."""
FLAGS = {"layers": 1, "d_model": 8, "heads": 2, "seq_len": 8, "vocab_size": 16, "global_batch": 2,
         "steps": 6, "warmup_steps": 2, "precision": "fp16"}
UNINTERRUPTED = [(4, 2.7966527938842773, 1.6950572300704514, False), (5, None, 0.0, True),
                 (6, 2.809246778488159, 1.3396436803265832, False)]
"""Steps 4-6 of the same run without the stop (its metrics file): step, loss, grad_norm, skipped."""


def _engine():
    cfg = build_train_config(dict(FLAGS))
    return cfg, build_engine(cfg, torch.device("cpu"), cfg.parallel.build_mesh())


def test_a_checkpoint_of_the_old_format_resumes_the_run(tmp_path):
    """Bug: a record without ``rng`` (or any field the class added) refused or half restored:
    the step, the LRs, the scheduler's position and the loss scale all come back, and the
    next steps are those of the run that never stopped."""
    shutil.copytree(OLD, tmp_path / "ckpt")
    cfg, engine = _engine()
    saved = engine.load(str(tmp_path / "ckpt"))
    assert "rng" not in saved
    state = engine.state
    assert state.step == 3 and state.lr_scheduler.last_epoch == 0
    assert [g["lr"] for g in engine.optimizer.param_groups] == pytest.approx([1.5e-3, 1.5e-3])
    assert (engine.precision.scaler.scale, engine.precision.scaler.good_steps) == (2.0**13, 0)
    data, _ = make_datasets("synthetic", vocab_size=16, seq_len=8, held_out=False)
    for step, loss, norm, skipped in UNINTERRUPTED:
        got = engine.train_step(data.batch(cfg.seed, step, cfg.global_batch))
        assert engine.last["skipped"] == skipped, (step, engine.last)
        if loss is not None:
            assert abs(got - loss) <= LOSS_ABS, (step, got, loss)
        assert abs(engine.last["grad_norm"] - norm) <= NORM_REL * norm, (step, engine.last)


def test_the_state_round_trips_with_its_generators():
    """Bug: the RNG (or the scaler, or the count of non-finite steps in a row) left out of the
    record a rejoining replica copies."""
    _, a = _engine()
    a.precision.scaler.scale, a.precision.scaler.good_steps = 2.0**9, 5
    a.state.step, a.state.nonfinite_run = 7, 3
    record = a.state.state_dict()
    expected = torch.rand(4)
    _, b = _engine()
    torch.rand(3)   # moves the generator on
    b.state.load_state_dict(record)
    assert torch.equal(torch.rand(4), expected)
    assert b.state.step == 7 and (b.precision.scaler.scale, b.precision.scaler.good_steps) == (2.0**9, 5)
    assert b.state.nonfinite_run == 3
