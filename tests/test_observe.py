"""Seeing a run: validation loss and the trace under every layout (one launch per layout,
shared by every check)."""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers import EVAL, SMALL, assert_equivalent, one_process, run_train

from trainmesh.cli import main
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.mesh import ParallelMesh
from trainmesh.data.corpus import _EVAL_STREAM, SyntheticCorpus, make_datasets
from trainmesh.engine.engine import Engine
from trainmesh.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
EVAL_MB2 = [*EVAL, "--microbatches", "2"]
LAYOUTS = {"dp2": ["--dp", "2"], "dp2tp2zero3": ["--dp", "2", "--tp", "2", "--zero", "3"],
           "dp2pp2": ["--dp", "2", "--pp", "2"]}
"""One launch per layout, each checked for several things; tp and ZeRO-3 share a launch. The
one process is the session's shared reference (helpers.one_process: it evaluates too)."""
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run) -> dict[str, list[dict]]:
    """Each layout trained once with every observation switched on: its metrics records."""
    out = {"one": reference_run(one_process("adamw"))}
    for name, layout in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(name)
        trace = tmp / "trace.json"
        board = ["--tensorboard", str(tmp / "tb")] if HAS_TENSORBOARD and name == "dp2pp2" else []
        proc, records = run_train([*SMALL, *EVAL_MB2, *layout, "--trace-out", str(trace), *board],
                                  tmp, timeout=240)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        out[name] = records
        out[name + ".trace"] = json.loads(trace.read_text())
        out[name + ".tb"] = str(tmp / "tb")
    return out


def evals(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "eval"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_loss_is_the_same_under_every_layout(runs, layout):
    ref, run = runs["one"], runs[layout]
    assert_equivalent(ref, run)   # evaluating between steps leaves training untouched
    a, b = evals(ref), evals(run)
    assert [r["step"] for r in a] == [5, 10, 15, 20] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] == 2 * 8 * 16
        assert abs(x["loss"] - y["loss"]) <= 1e-3, (layout, x, y)


def _reference_loss(model: torch.nn.Module, batches: list[dict]) -> float:
    """float64 mean next-token loss over every token of ``batches``."""
    model = copy.deepcopy(model).double()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            loss_sum, n = model(**b)
            total, count = total + float(loss_sum), count + int(n)
    return total / count


@pytest.mark.timeout(60)
def test_evaluate_is_forward_only_and_exact():
    """Engine.evaluate: the mean loss over every token of the batches (a float64 reference);
    gradients and weights unchanged."""
    engine = Engine(GPT(CFG, seed=0), lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m, b: m(**b),
                    ParallelConfig(microbatches=2), mesh=ParallelMesh(local=True))
    data = SyntheticCorpus(64, 16)
    engine.train_step(data.batch(0, 1, 8))
    held = [SyntheticCorpus(64, 16, stream=_EVAL_STREAM).batch(0, k, 8) for k in (1, 2)]
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    grads = [None if p.grad is None else p.grad.clone() for p in engine.module.parameters()]
    loss = engine.evaluate(held)
    assert loss == pytest.approx(_reference_loss(engine.module, held), abs=1e-5)
    after = [p.grad for p in engine.module.parameters()]
    assert all(a is None if g is None else torch.equal(a, g) for g, a in zip(grads, after))
    assert all(torch.equal(v, engine.module.state_dict()[k]) for k, v in before.items())


def test_held_out_split_is_disjoint(tmp_path):
    """The last 5% of a token file is held out; the synthetic eval stream differs from training."""
    path = tmp_path / "t.npy"
    np.save(path, np.arange(1000, dtype=np.int64) % 50)
    train, val = make_datasets(str(path), vocab_size=64, seq_len=8, held_out=True)
    assert len(train.tokens) == 950 and len(val.tokens) == 50
    assert np.array_equal(val.tokens, np.arange(950, 1000) % 50)
    syn, syn_val = make_datasets("synthetic", vocab_size=64, seq_len=8, held_out=True)
    assert not torch.equal(syn.batch(0, 1, 4)["input_ids"], syn_val.batch(0, 1, 4)["input_ids"])
    assert torch.equal(syn.successors, syn_val.successors)   # the same language


def spans(trace: dict, **match) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"
            and all(e.get(k) == v or e["args"].get(k) == v for k, v in match.items())]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trace_of_dp2_pp2_is_valid_and_books_every_byte(runs):
    trace = runs["dp2pp2.trace"]
    assert isinstance(trace["traceEvents"], list)
    xs = spans(trace)
    for e in xs:
        assert isinstance(e["name"], str) and e["dur"] >= 0 and e["ts"] >= 0
        assert all(isinstance(e[k], (int, float)) for k in ("ts", "dur", "pid", "tid"))
    assert {e["pid"] for e in xs} == {0, 1, 2, 3}          # one process per rank
    names = {e["pid"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0, 1, 2, 3}
    assert {e["args"]["step"] for e in xs} == {19, 20}      # the last --trace-steps (2) steps
    comm = defaultdict(int)
    for e in spans(trace, cat="comm"):
        comm[e["pid"]] += e["args"]["bytes"]
    assert all(comm[r] > 0 for r in range(4))
    assert {str(r): b for r, b in comm.items()} == trace["otherData"]["ledger_bytes"]
    for r in range(4):   # forward and backward of both microbatches, both steps, every rank
        assert len(spans(trace, pid=r, cat="forward")) == len(spans(trace, pid=r, cat="backward")) == 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trace_of_ddp_shows_all_reduce_overlapping_backward(runs):
    trace, summary = runs["dp2.trace"], runs["dp2"][-1]
    for rank in (0, 1):
        reduces = spans(trace, pid=rank, cat="comm", axis="dp", name="all_reduce")
        per_step = summary["ranks"][rank]["comm_bytes_per_step"]["dp"]["all_reduce"]
        assert sum(e["args"]["bytes"] for e in reduces) == pytest.approx(2 * per_step)
        overlapped = [r for r in reduces
                      if r["ts"] < max(b["ts"] + b["dur"] for b in spans(
                          trace, pid=rank, cat="backward", step=r["args"]["step"]))]
        assert overlapped, "no gradient all-reduce starts before the backward ends"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not HAS_TENSORBOARD, reason="the tensorboard package (extra [tensorboard])")
def test_tensorboard_scalars_match_the_metrics_file(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(runs["dp2pp2.tb"], size_guidance={"scalars": 0})
    acc.Reload()
    jsonl = [r for r in runs["dp2pp2"] if r["event"] == "step"]
    for key in ("loss", "grad_norm", "lr"):
        logged = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in logged] == [r["step"] for r in jsonl], key
        for (_, v), r in zip(logged, jsonl):   # event files hold float32
            assert v == pytest.approx(r[key], rel=1e-6, abs=1e-12), (key, r["step"])
    assert [e.value for e in acc.Scalars("eval/loss")] == pytest.approx(
        [r["loss"] for r in evals(runs["dp2pp2"])], rel=1e-6)
    tags = acc.Tags()["scalars"]
    assert {"tokens_per_s", "memory/rank0_bytes", "comm_bytes/dp", "comm_bytes/pp"} <= set(tags)
    assert {f"memory/peak_bytes/rank{r}" for r in range(4)} <= set(tags)


@pytest.mark.parametrize("args, field", [
    (["--eval-every", "0"], "--eval-every"),
    (["--eval-batches", "0"], "--eval-batches"),
    (["--trace-steps", "0"], "--trace-steps"),
    (["--trace-out", "/dev/null/trace.json"], "--trace-out"),
    (["--trace-out", "/tmp"], "--trace-out"),
    (["--tensorboard", "/dev/null/tb"], "--tensorboard"),
])
def test_bad_observation_input_exits_2_naming_the_flag(args, field, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0], err


def test_tensorboard_missing_exits_2_naming_the_flag(tmp_path, monkeypatch, no_launch, refused):
    """Without the tensorboard package, --tensorboard is refused before any worker starts."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)   # `import tensorboard` fails
    line = refused(["train", "--tensorboard", str(tmp_path / "tb")], "--tensorboard")
    assert "tensorboard" in line[14:] and no_launch == [], line


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_TENSORBOARD, reason="the tensorboard package (extra [tensorboard])")
def test_tensorboard_gets_every_number_of_every_record(tmp_path):
    """What a fault-tolerant MoE run writes to its metrics file reaches TensorBoard: replicas,
    moe/*, save times, quorum changes (lists as counts); flags, nulls and paths do not."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainmesh.observe.metrics import MetricsWriter
    from trainmesh.observe.tensorboard import TensorBoardLog
    board = TensorBoardLog(str(tmp_path / "tb"), {"dp": 2, "pp": 1, "tp": 1, "experts": 4})
    metrics = MetricsWriter(str(tmp_path / "m.jsonl"), also=board.record)
    records = [{"event": "step", "step": 1, "loss": 4.0, "mfu": None, "replicas": 2, "outer": True,
                "moe": {"aux_loss": 1.01, "max_over_mean_load": 1.5}},
               {"event": "save", "step": 1, "blocking_s": 0.25, "total_s": 0.5, "path": "ck/step-1"},
               {"event": "quorum", "step": 2, "replicas": 1, "lost": [1], "joined": [],
                "recovering_s": 0.75}]
    for r in records:
        metrics.write(r)
    board.close({"ranks": [], "steps": 2})
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got == {"loss": [(1, 4.0)], "replicas": [(1, 2.0)],
                   "moe/aux_loss": [(1, pytest.approx(1.01))],
                   "moe/max_over_mean_load": [(1, 1.5)], "save/blocking_s": [(1, 0.25)],
                   "save/total_s": [(1, 0.5)], "quorum/replicas": [(2, 1.0)],
                   "quorum/lost": [(2, 1.0)], "quorum/joined": [(2, 0.0)],
                   "quorum/recovering_s": [(2, 0.75)]}, got
    assert [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()] == records
