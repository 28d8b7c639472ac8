"""ZeRO-Offload (--offload cpu / nvme, --offload-params) in real processes: the same training run
as one process (README.md's promise, fp32, 20 steps, AdamW and SGD), the bytes each rank keeps off the
device (measured from its tensors and files) and none on it, the NVMe files on disk and gone
after, the gradient shards streamed to the host bucket by bucket during backward (counted when
backward returns), a full disk mid-run (the job ends naming the rank, its last checkpoint
resumes), resume between offloaded and resident layouts both ways, and bad input refused before
any worker starts."""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import SMALL, run_train, steps
from test_zero import (
    CFG,
    PSI,
    SHORT,
    SMALL_BUCKET,
    STEPS,
    _references,
    _train,
    loss_fn,
    no_decay,
    optimizer,
)
from tolerances import LOSS_ABS, NORM_REL, TRAINED_WEIGHTS_ABS

from trainmesh import Engine, ParallelConfig
from trainmesh.checkpoint.sharded import latest
from trainmesh.cli import main
from trainmesh.models.gpt import GPT
from trainmesh.testing import run_distributed

# (name, optimizer, param groups?, ParallelConfig kwargs, steps); offload_dir "TMP": a directory
# the test names (its files are listed while the run is alive), else the store's own temp
# directory. Each offload target keeps 20-step runs with AdamW and with SGD; the variants (ZeRO-3,
# parameters on the host, bf16) take SHORT steps: a shard, a state or a master copy that is not
# written back, or written to the wrong place, moves the loss from the second step on. fp16
# starts at the default loss scale and needs more steps than its search's ~7 skips.
FP16_STEPS = 13
CONFIGS = [
    ("zero1-cpu-adamw", "adamw", False, {"zero": 1, "offload": "cpu"}, STEPS),
    ("zero2-cpu-sgd", "sgd", False, {"zero": 2, "offload": "cpu"}, STEPS),
    ("zero3-cpu-adamw-m2", "adamw", False, {"zero": 3, "offload": "cpu", "microbatches": 2}, SHORT),
    ("zero3-cpu-sgd-params", "sgd", False, {"zero": 3, "offload": "cpu", "offload_params": True}, SHORT),
    ("zero2-nvme-adamw-groups", "adamw", True, {"zero": 2, "offload": "nvme", "offload_dir": "TMP"},
     STEPS),
    ("zero2-nvme-sgd", "sgd", False, {"zero": 2, "offload": "nvme"}, STEPS),
    ("zero1-nvme-bf16-adamw", "adamw", False, {"zero": 1, "offload": "nvme", "precision": "bf16"}, SHORT),
    ("zero2-cpu-bf16-adamw-m2", "adamw", False,
     {"zero": 2, "offload": "cpu", "precision": "bf16", "microbatches": 2}, SHORT),
    # fp16 from the default loss scale: the first steps overflow and are skipped (copies dropped)
    ("zero2-cpu-fp16-sgd-m2", "sgd", False,
     {"zero": 2, "offload": "cpu", "precision": "fp16", "microbatches": 2}, FP16_STEPS),
]


def _engine(opt: str, groups: bool, cfg: ParallelConfig, **kw) -> Engine:
    return Engine(GPT(CFG, seed=0), optimizer(opt), loss_fn, cfg,
                  param_groups=no_decay if groups else None, **kw)


def _nvme_files(engine: Engine, rank: int) -> dict:
    """Sizes of this rank's files under the store's directory, then whether closing the store
    removed them (and the directory it made)."""
    store = engine.grad_sync.offloaded.store
    directory = store.path.parent
    listed = sum(f.stat().st_size for f in directory.glob(f"*rank{rank}-*"))
    store.close()
    return {"listed": listed, "left": [str(f) for f in directory.glob(f"*rank{rank}-*")],
            "dir_left": directory.exists()}


def _run(configs: list, tmp: str) -> dict:
    """Each config against the one-process run (fp32; computed once, on one rank: test_zero's
    _references) or the same layout without offload (mixed precision), of as many steps."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    refs = _references({(opt, groups, n) for _, opt, groups, kw, n in configs
                        if kw.get("precision", "fp32") == "fp32"})
    out = {}
    for name, opt, groups, kwargs, n in configs:
        precision = kwargs.get("precision", "fp32")
        if precision == "fp32":
            ref_rows, ref_weights = refs[opt, groups, n]
        else:   # the same layout, resident
            resident = {k: v for k, v in kwargs.items() if k != "offload"}
            ref = _engine(opt, groups, ParallelConfig(dp=dp, bucket_mb=SMALL_BUCKET, **resident))
            ref_rows, ref_weights = _train(ref, rank, dp, n), ref.full_state_dict()
        if kwargs.get("offload_dir") == "TMP":
            kwargs = {**kwargs, "offload_dir": str(Path(tmp) / name)}
        engine = _engine(opt, groups, ParallelConfig(dp=dp, bucket_mb=SMALL_BUCKET, **kwargs))
        rows = _train(engine, rank, dp, n)
        weights = engine.full_state_dict()
        out[name] = {
            "loss_err": max(abs(a[0] - b[0]) for a, b in zip(ref_rows, rows)),
            "norm_err": max(abs(a[1] - b[1]) / max(a[1], 1e-30) for a, b in zip(ref_rows, rows)),
            "skipped": sum(b[1] == 0.0 for b in rows),   # fp16 overflow: grad_norm 0, no update
            "weight_err": max((weights[k].float() - ref_weights[k].float()).abs().max().item()
                              for k in ref_weights),
            "state": engine.state_bytes, "offloaded": engine.offloaded_bytes, "optimizer": opt,
            "kwargs": kwargs, "stream": dataclasses.asdict(engine.grad_sync.offloaded.stats),
            "files": _nvme_files(engine, rank) if kwargs["offload"] == "nvme" else None}
    return out


def expected_offloaded(r: dict, n: int) -> int:
    """Optimizer states (AdamW 8Ψ/N, SGD momentum 4Ψ/N) + fp32 masters where the parameters
    are 16-bit (4Ψ/N) + the parameter shards with --offload-params (4Ψ/N)."""
    kw = r["kwargs"]
    per_param = (8 if r["optimizer"] == "adamw" else 4) + 4 * (kw.get("precision", "fp32") != "fp32")
    per_param += 4 * kw.get("offload_params", False)
    return per_param * PSI // n


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_offload_matches_one_process_and_holds_its_shard_off_the_device(tmp_path):
    res = run_distributed(_run, 2, CONFIGS, str(tmp_path), timeout_s=230)
    for rank, runs in res.items():
        for name, r in runs.items():
            where = f"rank {rank} {name}"
            assert r["loss_err"] <= LOSS_ABS, f"{where}: loss differs by {r['loss_err']}"
            assert r["norm_err"] <= NORM_REL, f"{where}: grad_norm differs by {r['norm_err']:.2e}"
            assert r["weight_err"] <= TRAINED_WEIGHTS_ABS, f"{where}: weights differ by {r['weight_err']}"
            assert r["state"]["optimizer"] == 0, (where, r["state"])
            # Every shard streamed to the host once its last reduction landed, none copied at
            # the step; ZeRO-2/3 reduce-scatter through transient buffers of which at most
            # ``max_inflight`` are pending, so earlier buckets (units) landed inside backward.
            s = r["stream"]
            assert s["by_step"] == s["total"] > 0, (where, s)
            if r["kwargs"]["zero"] > 1:
                assert s["in_backward"] > 0, (where, "nothing streamed during backward", s)
            if r["kwargs"].get("precision") == "fp16":   # skipped steps dropped their copies
                assert 1 <= r["skipped"] < 10, (where, r["skipped"])
            if r["kwargs"].get("offload_params"):
                assert r["state"]["params"] == 0, (where, r["state"])
            kind = r["kwargs"]["offload"]
            other = "cpu" if kind == "nvme" else "nvme"
            want = expected_offloaded(r, 2)
            assert abs(r["offloaded"][kind] - want) <= 0.05 * want, (where, r["offloaded"], want)
            assert r["offloaded"][other] <= 64, (where, r["offloaded"])   # (step counters)
            if kind == "nvme":   # the files really hold it while the run lives, and go after
                f = r["files"]
                assert f["listed"] >= r["offloaded"]["nvme"] >= 0.95 * want, (where, f, want)
                assert not f["left"], (where, f)
                if "offload_dir" not in r["kwargs"]:
                    assert not f["dir_left"], (where, "the store's own directory is removed")


RESUME = [*SMALL, "--seed", "0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 20 steps, checkpoints at 10 and 20 (resident optimizer states)."""
    tmp = tmp_path_factory.mktemp("offload-ref")
    proc, records = run_train([*RESUME, "--save-dir", str(tmp / "ck"), "--save-every", "10"], tmp)
    assert proc.returncode == 0, proc.stderr
    return steps(records), tmp / "ck"


def _assert_continues(ref: list[dict], records: list[dict], what: str) -> None:
    resumed = steps(records)
    assert [r["step"] for r in resumed] == list(range(11, 21)), what
    for a, b in zip(ref[10:], resumed):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (what, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= NORM_REL * a["grad_norm"], (what, a, b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_disk_keeps_the_checkpoint_and_resume_crosses_offload(reference, tmp_path, monkeypatch):
    from trainmesh.data_parallel.nvme import FAULT_ENV
    ref, ref_ck = reference
    # dp 2 ZeRO-2 with the states in NVMe files; the disk is full from step 11 on: per rank 4
    # writes per step (2 parameter groups x 2 AdamW moments) and 4 for the save of step 10.
    ck, states = tmp_path / "from-nvme", tmp_path / "states-a"
    with monkeypatch.context() as env:
        env.setenv(FAULT_ENV, "44")
        proc, records = run_train([*RESUME, "--dp", "2", "--zero", "2", "--offload", "nvme", "--offload-dir",
                                   str(states), "--save-dir", str(ck), "--save-every", "10"], tmp_path, name="a")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"rank \d", last) and "No space left" in last and "checkpoint" in last, last
    assert [r["step"] for r in steps(records)] == list(range(1, 11))
    assert latest(ck).name == "step-00000010"
    assert not list(states.iterdir()), "state files removed when the run ended"
    # ... its checkpoint is whole: one process, resident states, resumes it exactly
    proc, records = run_train([*RESUME, "--save-dir", str(ck), "--resume"], tmp_path, name="b")
    assert proc.returncode == 0, proc.stderr
    _assert_continues(ref, records, "nvme dp2-zero2 -> one process")
    # saved by one process, resident (its step-10 checkpoint) -> dp 2 ZeRO-3, NVMe, parameters on the host
    ck = tmp_path / "to-nvme"
    shutil.copytree(ref_ck, ck)
    shutil.rmtree(ck / "step-00000020")
    proc, records = run_train([*RESUME, "--dp", "2", "--zero", "3", "--offload", "nvme", "--offload-params",
                               "--offload-dir", str(tmp_path / "states-c"), "--save-dir", str(ck), "--resume"],
                              tmp_path, name="c")
    assert proc.returncode == 0, proc.stderr
    _assert_continues(ref, records, "one process -> nvme dp2-zero3")
    assert not list((tmp_path / "states-c").iterdir()), "state files removed at exit"


@pytest.mark.parametrize("args, field", [
    (["--offload", "nvme"], "--offload"),                                      # ZeRO 0
    (["--zero", "2", "--offload-params", "--offload", "cpu"], "--offload-params"),
    (["--zero", "2", "--offload-dir", "/tmp"], "--offload-dir"),               # without nvme
    (["--zero", "2", "--offload", "nvme", "--offload-dir", "FILE"], "--offload-dir"),
    (["--zero", "2", "--offload", "nvme", "--offload-dir", "FILE/sub"], "--offload-dir"),
    (["--zero", "2", "--offload", "nvme", "--offload-dir", "RO/sub"], "--offload-dir"),
])
def test_bad_offload_input_exits_2_naming_the_field(args, field, tmp_path, capsys):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "RO").mkdir()
    (tmp_path / "RO").chmod(0o500)
    if "RO/sub" in args and __import__("os").access(tmp_path / "RO", __import__("os").W_OK):
        pytest.skip("running as root: a read-only directory is writable")
    args = [str(tmp_path / a) if a.startswith(("FILE", "RO")) else a for a in args]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0], err


def test_too_little_space_for_the_states_is_refused_before_start(tmp_path, monkeypatch, capsys):
    from trainmesh.data_parallel import nvme
    need = {}

    def usage(path):
        need["path"] = path
        return shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000)
    monkeypatch.setattr(nvme.shutil, "disk_usage", usage)
    args = ["train", *SMALL, "--dp", "2", "--zero", "2", "--offload", "nvme", "--offload-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--offload-dir" in err[0] and "GB free" in err[0], err
    assert Path(need["path"]) == tmp_path
    # the bytes asked for: AdamW's 8 bytes per parameter (fp32: the parameters are the masters)
    free = 8 * PSI - 1
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 0, free))
    with pytest.raises(Exception) as exc:
        nvme.check_space(str(tmp_path), 8 * PSI)
    assert "--offload-dir" in str(exc.value)
    nvme.check_space(str(tmp_path), free)


def test_planner_prices_offload_and_frees_the_device():
    from trainmesh.planner.candidate import ModelShape, evaluate
    from trainmesh.planner.cluster import Cluster
    model = ModelShape(params=7_500_000_000)
    cluster = Cluster(gpus=8)
    got = {o: evaluate(ParallelConfig(dp=8, zero=2, offload=o, precision="bf16"), model, cluster)
           for o in ("none", "cpu", "nvme")}
    assert got["none"].memory.optimizer > 0
    assert got["cpu"].memory.optimizer == got["nvme"].memory.optimizer == 0
    times = {o: c.time.total for o, c in got.items()}
    assert times["none"] < times["cpu"] < times["nvme"], times


def test_host_adamw_steps_strided_shards_right():
    """Under offload the trainer's AdamW is the fused CPU kernel, which miscomputes strided
    parameters (a ZeRO-1/2 shard of several buckets): those get the foreach kernel."""
    from trainmesh.config.train import build_train_config
    from trainmesh.run.optimizers import optimizer_factory
    cfg = build_train_config({"zero": 1, "offload": "cpu"})
    make = optimizer_factory(cfg, torch.device("cpu"))
    flat = torch.randn(3, 2, 5)                                # (n_buckets, world, chunk)
    for shard in (flat[:, 1], flat[:, 1].contiguous()):        # strided view; contiguous copy
        p = torch.nn.Parameter(shard)
        q = torch.nn.Parameter(shard.detach().clone())
        ours = make([{"params": [p], "weight_decay": 0.1}])
        ref = torch.optim.AdamW([q], lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
        for k in range(3):
            p.grad = torch.full_like(q, 0.1 * (k + 1))
            q.grad = p.grad.clone()
            ours.step()
            ref.step()
        assert (p.detach() - q.detach()).abs().max() <= 1e-6, p.is_contiguous()
    assert make([torch.nn.Parameter(torch.zeros(4))]).defaults["fused"], "the fast kernel where it is right"
