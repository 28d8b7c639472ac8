"""Every layout rule has one home (``trainmesh.config.parallel`` / ``trainmesh.config.train``) and is
checked before any worker starts: ``trainmesh train`` exits 2 with one line naming the flag,
``trainmesh plan`` refuses the same layout, and ``ParallelConfig`` (the Python API) raises
:class:`~trainmesh.core.errors.ConfigError` naming the same flag. All in process: no worker starts.
"""
from __future__ import annotations

import pytest
from helpers import SMALL

from trainmesh.config.parallel import ParallelConfig, check_pipeline
from trainmesh.core.errors import ConfigError

T = [a for a in SMALL if a not in ("--steps", "20")]   # the tiny model, 2 layers, global batch 8
FOUR = ["--layers", "4"]
PLAN_FLAGS = {"--d-model", "--heads", "--seq-len", "--vocab-size", "--dp", "--pp", "--tp", "--zero", "--microbatches", "--min-dp", "--schedule",
              "--virtual-stages", "--zero3-reshard", "--sequence-parallel", "--strategy",
              "--ps-servers", "--allreduce", "--layers", "--global-batch", "--reduce-dtype",
              "--offload", "--offload-dir", "--offload-params"}
PLAN_T = [a for flag, value in zip(T[::2], T[1::2]) if flag in PLAN_FLAGS for a in (flag, value)]

# (flags, the flag the error names, the same layout as ParallelConfig fields or None)
LAYOUTS = [
    (["--pp", "2", "--schedule", "zigzag"], "--schedule", dict(pp=2, schedule="zigzag")),
    (["--pp", "2", "--virtual-stages", "2"], "--virtual-stages", dict(pp=2, virtual_stages=2)),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "1",
      *FOUR], "--microbatches", dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=1)),
    (["--pp", "2", "--schedule", "interleaved", "--microbatches", "3", "--global-batch", "6", *FOUR],
     "--microbatches", dict(pp=2, schedule="interleaved", microbatches=3)),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"],
     "--pp", None),   # pp x virtual-stages = 4 chunks of a 2-layer model
    (["--pp", "3"], "--pp", None),
    (["--virtual-stages", "0"], "--virtual-stages", dict(virtual_stages=0)),
    (["--dp", "3"], "--global-batch", None),
    (["--dp", "2", "--microbatches", "3"], "--global-batch", None),
    (["--tp", "3"], "--tp", None),
    (["--sequence-parallel"], "--sequence-parallel", dict(sequence_parallel=True)),
    (["--reduce-dtype", "bf16"], "--reduce-dtype", dict(reduce_dtype="bf16")),
    (["--dp", "2", "--min-dp", "3"], "--min-dp", dict(dp=2, min_dp=3)),
    (["--offload", "cpu"], "--offload", dict(offload="cpu")),
    (["--dp", "2", "--zero", "2", "--offload-params", "--offload", "cpu"], "--offload-params",
     dict(dp=2, zero=2, offload="cpu", offload_params=True)),
    (["--offload-dir", "/tmp/x"], "--offload-dir", dict(offload_dir="/tmp/x")),
    (["--dp", "2", "--zero", "3", "--zero3-reshard", "microbatch"], "--zero3-reshard",
     dict(dp=2, zero=3, zero3_reshard="microbatch")),
    (["--dp", "2", "--zero", "1", "--allreduce", "ring"], "--allreduce",
     dict(dp=2, zero=1, allreduce="ring")),
    (["--ps-servers", "2"], "--ps-servers", dict(ps_servers=2)),
    (["--strategy", "ps", "--dp", "2", "--tp", "2"], "--tp", dict(strategy="ps", dp=2, tp=2)),
    (["--timeline-out", "t.svg"], "--timeline-out", None),
    (["--cp-comm", "allgather"], "--cp-comm", dict(cp_comm="allgather")),
    (["--dp", "2", "--ep", "4"], "--ep", dict(dp=2, ep=4)),
    (["--dp", "2", "--zero", "1", "--dp-shard", "3"], "--dp-shard", dict(dp=2, zero=1, dp_shard=3)),
    (["--dp", "2", "--dp-shard", "1"], "--dp-shard", dict(dp=2, dp_shard=1)),
    (["--strategy", "ps", "--dp", "2", "--cp", "2"], "--cp", dict(strategy="ps", dp=2, cp=2)),
    (["--strategy", "diloco", "--dp", "2", "--fault-tolerant"], "--fault-tolerant",
     dict(strategy="diloco", dp=2, fault_tolerant=True)),
    (["--dp", "4", "--zero", "2", "--fault-tolerant"], "--zero",       # one replica: nothing stands in
     dict(dp=4, zero=2, fault_tolerant=True)),
    # experts spread beyond one replica (a lost replica would take experts with it)
    (["--dp", "4", "--dp-shard", "2", "--zero", "2", "--fault-tolerant", "--ep", "4", "--experts", "4"],
     "--ep", dict(dp=4, dp_shard=2, zero=2, fault_tolerant=True, ep=4)),
    (["--dp", "2", "--ep", "2", "--experts", "2", "--fault-tolerant"], "--ep",
     dict(dp=2, ep=2, fault_tolerant=True)),
    (["--dp", "4", "--dp-shard", "2", "--zero", "1", "--offload", "cpu", "--fault-tolerant"],
     "--offload", dict(dp=4, dp_shard=2, zero=1, offload="cpu", fault_tolerant=True)),
    (["--dp", "3", "--pp", "2", "--global-batch", "6", "--microbatches", "2", "--fault-tolerant"],
     "--global-batch", None),    # 1..3 replicas cut 6 rows into 2 equal microbatches: needs 12
    (["--cp", "2", "--seq-len", "6"], "--seq-len", None),
    (["--dp", "2", "--ep", "2"], "--ep", None),                                  # no --experts
    (["--dp", "2", "--ep", "2", "--experts", "3"], "--ep", None),
    (["--experts", "2", "--top-k", "3"], "--top-k", None),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, flag, fields", LAYOUTS, ids=[" ".join(x[0]) for x in LAYOUTS])
def test_invalid_layout_exits_2_before_any_worker(no_launch, refused, flags, flag, fields):
    refused(["train", *T, *flags], flag)
    if all(not f.startswith("--") or f in PLAN_FLAGS for f in flags):   # the planner's own flags
        refused(["plan", "--model", "tiny", *PLAN_T, *flags], flag)
    assert no_launch == [], "a worker was started for an invalid layout"
    if fields is not None:
        with pytest.raises(ConfigError) as exc:
            ParallelConfig(**fields)
        assert exc.value.field == flag


@pytest.mark.timeout(60)
def test_bad_virtual_stages_from_a_toml_file(no_launch, refused, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[parallel]\npp = 2\nschedule = "interleaved"\nvirtual-stages = 2\nmicrobatches = 3\n'
                    "global-batch = 6\nlayers = 4\n")
    line = refused(["train", *T, "--config", str(path)], "--microbatches")
    assert "multiple of --pp (2)" in line
    assert no_launch == []


@pytest.mark.timeout(60)
def test_valid_layouts_get_past_validation(no_launch):
    from helpers import LAUNCHED

    from trainmesh.cli import main
    assert main(["train", *T, "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                 "--microbatches", "2", *FOUR]) == LAUNCHED
    assert len(no_launch) == 1 and no_launch[0].parallel.virtual_stages == 2
    assert no_launch[0].parallel.grad_clip == 1.0      # trainmesh train's default clip
    assert ParallelConfig().grad_clip == 0.0           # the Python API's: no clipping
    # what runs inside a fault-tolerant replica composes as in any run (the axis table's rules)
    for inside in (dict(tp=2, sequence_parallel=True), dict(tp=2, cp=2), dict(cp=2, ep=2),
                   dict(dp_shard=2, zero=1, pp=2), dict(dp_shard=2, zero=2, ep=2)):
        ParallelConfig(dp=4 if "dp_shard" in inside else 2, fault_tolerant=True, **inside)
    # fault-tolerant replicas of one HSDP shard group each (2 replicas of 2 ranks)
    assert ParallelConfig(dp=4, dp_shard=2, zero=2, fault_tolerant=True).replica_ranks == 2
    assert ParallelConfig(dp=3, fault_tolerant=True).replica_ranks == 1
    # ... of the tp ranks of one dp index (2 replicas of 2), or of a shard group's (2 of 4)
    tp = ParallelConfig(dp=2, tp=2, fault_tolerant=True)
    assert (tp.replica_ranks, tp.replica_dp, tp.replicas) == (2, 1, 2)
    both = ParallelConfig(dp=4, dp_shard=2, zero=2, tp=2, fault_tolerant=True)
    assert (both.replica_ranks, both.replica_dp, both.replicas) == (4, 2, 2)
    pp = ParallelConfig(dp=2, pp=2, tp=2, fault_tolerant=True)      # 2 replicas of pp x tp = 4
    assert (pp.replica_ranks, pp.replica_dp, pp.replicas) == (4, 1, 2)


@pytest.mark.timeout(30)
def test_the_schedule_builder_applies_the_same_rule():
    import trainmesh.config.parallel as config
    from trainmesh.pipeline_parallel.schedules import SCHEDULES, build_schedule
    assert SCHEDULES is config.SCHEDULES
    for args in [("interleaved", 2, 3, 2), ("1f1b", 2, 4, 2)]:
        with pytest.raises(ConfigError) as built:
            build_schedule(*args)
        with pytest.raises(ConfigError) as checked:
            check_pipeline(args[0], pp=args[1], microbatches=args[2], virtual_stages=args[3])
        assert str(built.value) == str(checked.value)
