"""A chain of resumes across layouts, saving every step, with every rank drawing its own hash
seed: each step's loss and every saved optimizer moment equal the uninterrupted run's.

The states of a resumed run are exactly those saved, however often it is resumed: the order in
which ranks gather optimizer states must not depend on a per-process hash seed (a set of state
keys built after a load once made ranks gather each other's ``exp_avg`` and ``exp_avg_sq``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL, steps, trainmesh_process
from tolerances import LOSS_ABS, MOMENT_REL

from trainmesh.checkpoint.sharded import MANIFEST, _Reader

LAST = 8
# Each stage resumes the one before from the same --save-dir, runs two steps, saves each step.
CHAIN = [["--dp", "2"], ["--dp", "2", "--zero", "3"], ["--dp", "2", "--zero", "2"], []]
TORCHRUN_STAGE = 1   # this stage runs under torchrun, each rank with its own PYTHONHASHSEED
STATE_KEYS = "{k for k in ('step', 'exp_avg', 'exp_avg_sq')}"


def _env(**extra: str) -> dict[str, str]:
    """This environment without a fixed hash seed or a torchrun rank; checking collectives."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONHASHSEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "TRAINMESH_CHECK_COLLECTIVES": "1", **extra}


def _seeds_ordering_differently() -> tuple[int, int]:
    """Two hash seeds under which a set of Adam's state keys iterates in different orders."""
    orders: dict[str, int] = {}
    for seed in range(64):
        out = subprocess.run([sys.executable, "-c", f"print(list({STATE_KEYS}))"], text=True,
                             capture_output=True, env={**_env(), "PYTHONHASHSEED": str(seed)}).stdout
        orders.setdefault(out, seed)
        if len(orders) > 1:
            return tuple(orders.values())   # type: ignore[return-value]
    raise AssertionError("no two hash seeds order the state keys differently")


def _train(args: list[str], metrics: Path, name: str, *,
           torchrun: Path | None = None) -> subprocess.CompletedProcess:
    """``trainmesh train ARGS`` from the test zygote (its launcher's workers forked from one
    server: one hash seed for all ranks, as from any launcher), or under torchrun through
    ``torchrun``'s wrapper (a fresh interpreter per rank)."""
    args = [*args, "--metrics-out", str(metrics)]
    if torchrun is None:
        return trainmesh_process(["train", *args], metrics.parent, env=_env(), timeout=240, name=name)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(torchrun), *args], capture_output=True,
                          text=True, timeout=240, env=_env())


def _wrapper(tmp: Path, seeds: tuple[int, int]) -> Path:
    """torchrun's entry: sets PYTHONHASHSEED per LOCAL_RANK, then becomes `trainmesh train`."""
    path = tmp / "per_rank_seed.py"
    path.write_text(
        "import os, sys\n"
        f"os.environ['PYTHONHASHSEED'] = str({list(seeds)}[int(os.environ['LOCAL_RANK'])])\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'trainmesh', 'train', *sys.argv[1:]])\n")
    return path


def _moments(ck: Path, step: int) -> dict[str, object]:
    d = ck / f"step-{step:08d}"
    assert (d / MANIFEST).exists(), f"no checkpoint of step {step} in {ck}"
    reader = _Reader(d)
    return {k: reader.get(k) for k in reader.manifest["tensors"] if k.startswith("optimizer.state.")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chain_of_resumes_keeps_every_state(tmp_path):
    run = [*SMALL, "--save-every", "1"]
    ref_ck, ck = tmp_path / "ref", tmp_path / "ck"
    proc = _train([*run, "--save-dir", str(ref_ck), "--exit-after", str(LAST)], tmp_path / "ref.jsonl", "ref")
    assert proc.returncode == 0, proc.stderr[-3000:]
    wrapper = _wrapper(tmp_path, _seeds_ordering_differently())
    per_stage = LAST // len(CHAIN)
    for i, layout in enumerate(CHAIN):
        resume = ["--resume"] if i else []
        proc = _train([*run, *layout, "--save-dir", str(ck), *resume, "--exit-after", str((i + 1) * per_stage)],
                      tmp_path / "chain.jsonl", f"stage{i}", torchrun=wrapper if i == TORCHRUN_STAGE else None)
        assert proc.returncode == 0, (layout, proc.stderr[-3000:])
    import json
    ref = steps([json.loads(x) for x in (tmp_path / "ref.jsonl").read_text().splitlines()])
    got = steps([json.loads(x) for x in (tmp_path / "chain.jsonl").read_text().splitlines()])
    assert [r["step"] for r in got] == list(range(1, LAST + 1))
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (a, b)
    for step in range(1, LAST + 1):
        want, have = _moments(ref_ck, step), _moments(ck, step)
        assert sorted(want) == sorted(have), step
        kinds = {key.rsplit(".", 1)[1] for key in want}
        # The scale of a kind of state is its largest magnitude in the model (a key bias's
        # gradient cancels to ~0 but carries the rounding of large terms).
        scales = {kind: max(float(w.abs().max()) for k, w in want.items() if k.endswith("." + kind))
                  for kind in kinds}
        for key, w in want.items():
            h = have[key]
            if key.endswith("exp_avg_sq"):
                assert float(h.min()) >= 0, f"step {step}: {key} has negative entries"
            scale = scales[key.rsplit(".", 1)[1]] or 1.0
            err = float((w - h).abs().max())
            assert err <= MOMENT_REL * scale, f"step {step}: {key} differs by {err} (scale {scale})"
