"""Checkpoints shared with plain PyTorch (torch.distributed.checkpoint, FSDP2), both ways, and a
save that dies at each of its phases."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers import run_train, steps
from tolerances import LOSS_ABS

from trainmesh.checkpoint.chunks import flat_boxes

# The built-in GPT as `trainmesh train` builds it from these flags (seed 0).
SHAPE = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4}
FLAGS = ["--vocab-size", "64", "--seq-len", "16", "--d-model", "32", "--layers", "2", "--heads", "4",
         "--global-batch", "8", "--lr", "3e-3", "--warmup-steps", "0", "--grad-clip", "0"]
BEFORE, AFTER = 2, 3
"""Steps the PyTorch script takes before its save, and after it (trainmesh's steps 1..AFTER)."""


def _fsdp2_script(out: str, saved: str) -> None:
    """Plain PyTorch on 2 processes: FSDP2 on the built-in GPT, AdamW as trainmesh sets it up,
    BEFORE steps, `dcp.save(get_state_dict(...))` to ``out``; then AFTER steps more on
    trainmesh's batches and LR schedule of steps 1..AFTER, their losses to ``out``/losses.json;
    then ``saved`` (a trainmesh checkpoint) loaded with dcp.load + set_state_dict: its weights
    to ``out``/loaded.pt."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    from trainmesh.models.gpt import GPT, GPTConfig
    from trainmesh.run.optimizers import no_decay
    from trainmesh.run.schedule_lr import warmup_cosine
    rank = dist.get_rank()
    model = GPT(GPTConfig(**SHAPE), seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    groups: dict[float, list] = {}
    for name, p in model.named_parameters():
        groups.setdefault(no_decay(name)["weight_decay"], []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()],
                            lr=3e-3, betas=(0.9, 0.95))
    data = SyntheticCorpus(64, 16)

    def step(seed: int, k: int) -> float:
        loss_sum, count = model(**dp_slice(data.batch(seed, k, 8), rank, 2))
        loss = loss_sum / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / 2
    for k in range(1, BEFORE + 1):
        step(7, k)                                       # its own data
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
    schedule = warmup_cosine(opt, warmup_steps=0, total_steps=AFTER)
    losses = []
    for k in range(1, AFTER + 1):                        # trainmesh's steps 1..AFTER
        losses.append(step(0, k))
        schedule.step()
    if rank == 0:
        Path(out, "losses.json").write_text(json.dumps(losses))
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=saved)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in get_state_dict(model, opt)[1]["state"].items()}
    if rank == 0:
        torch.save({"model": full, "exp_avg": exp_avg}, str(Path(out, "loaded.pt")))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_checkpoints_resume_in_trainmesh_and_trainmesh_ones_load_in_pytorch(tmp_path):
    from trainmesh.checkpoint.sharded import _Reader
    from trainmesh.testing import run_distributed
    ours = tmp_path / "ours"                  # trainmesh's, at dp 2 ZeRO-3, read back by PyTorch
    proc, _ = run_train([*FLAGS, "--steps", "2", "--dp", "2", "--zero", "3", "--save-dir", str(ours)],
                        tmp_path, name="ours")
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_dir = tmp_path / "torch"
    run_distributed(_fsdp2_script, 2, str(torch_dir), str(ours / "step-00000002"), timeout_s=120)
    proc, records = run_train([*FLAGS, "--steps", str(AFTER), "--dp", "2", "--tp", "2", "--pp", "2",
                               "--microbatches", "2", "--resume-from", str(torch_dir)], tmp_path, name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads((torch_dir / "losses.json").read_text())
    got = steps(records)
    assert [r["step"] for r in got] == list(range(1, AFTER + 1))
    for k, (a, b) in enumerate(zip(want, got), 1):
        assert abs(a - b["loss"]) <= LOSS_ABS, (k, a, b["loss"])
    loaded = torch.load(str(torch_dir / "loaded.pt"))
    reader = _Reader(ours / "step-00000002")
    for name, value in loaded["model"].items():
        assert torch.equal(value, reader.get(f"model.{name}")), name
    for name, value in loaded["exp_avg"].items():
        assert torch.equal(value, reader.get(f"optimizer.state.{name}.exp_avg")), name


def test_flat_ranges_are_cut_into_at_most_three_boxes_per_matrix():
    for shape in [(4, 10), (3, 4, 5), (7,)]:
        n = int(torch.Size(shape).numel())
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                seen = torch.zeros(shape)
                boxes = flat_boxes(shape, lo, hi)
                for offs, sizes in boxes:
                    seen[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] += 1
                flat = seen.reshape(-1)
                assert bool((flat[lo:hi] == 1).all()) and flat.sum() == hi - lo, (shape, lo, hi)
                assert len(shape) != 2 or len(boxes) <= 3, (shape, lo, hi, boxes)


def test_metadata_that_would_run_code_is_refused(tmp_path):
    from trainmesh.checkpoint.sharded import CheckpointError, open_reader
    (tmp_path / ".metadata").write_bytes(pickle.dumps(print))   # any callable outside DCP's classes
    with pytest.raises(CheckpointError, match="refusing builtins.print"):
        open_reader(tmp_path).check_files(verify=True)


class _Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight (tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())


def test_a_tied_weight_is_saved_under_each_name_pytorch_loads(tmp_path):
    """In process: `dcp.load` into a PyTorch state_dict (which names a tied weight under each
    of its names) reads a trainmesh checkpoint whole, the alias included."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import trainmesh as tm
    from trainmesh import ParallelMesh
    from trainmesh.checkpoint.sharded import _Reader
    torch.manual_seed(0)
    engine = tm.Engine(_Tied(), lambda ps: torch.optim.SGD(ps, lr=0.5), lambda m, b: m(b),
                       tm.ParallelConfig(), mesh=ParallelMesh(local=True))
    engine.train_step(torch.randint(0, 8, (2, 3)))
    engine.save(str(tmp_path))
    fresh = _Tied()
    state = {"model": {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}}
    assert sorted(state["model"]) == ["embed.weight", "head.weight"]
    assert {"model.embed.weight", "model.head.weight"} <= set(_Reader(tmp_path / "step-00000001").manifest["tensors"])
    with warnings.catch_warnings():   # "torch.distributed is not initialised": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(tmp_path / "step-00000001"), no_dist=True)
    for name in ("embed.weight", "head.weight"):
        assert torch.equal(state["model"][name], engine.module.embed.weight.detach()), name
