"""No traceback anywhere: every subcommand answers bad or odd input with exit 2 and one line
naming why (or exit 0 where the input is valid), never a traceback.

:data:`ROWS` is the table, one line per input: the argv (``{name}`` fields name the files of
:func:`files`: missing, empty, truncated, non-JSON, of another run kind, checkpoints of every
layout) and the exit status expected. The train and plan flags get generated rows from their
declared type and range (:func:`generated`: a wrong type, a value below the range, a value not
among the choices, non-finite numbers, an empty path), so a new flag of the config table has
rows at once; a flag of another parser without a row fails
:func:`test_every_flag_of_every_subcommand_has_a_row`, naming it. A new subcommand or flag is one
more line of :data:`ROWS`.

Everything runs in process (``trainmesh train`` with the launcher stubbed: a run that gets past
validation returns :data:`~helpers.LAUNCHED`), except the checkpoints and metrics files of real
multi-process runs of every layout and mode (tests/observed.py), in one slow test.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from helpers import LAUNCHED
from observed import OBSERVED

from trainmesh.cli import build_parser, main
from trainmesh.config.parallel import ParallelConfig
from trainmesh.config.train import FLAGS, TrainConfig

T = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
     "--global-batch", "8", "--steps", "4"]
"""The tiny model of the in-process checkpoints (and a valid train run)."""
MOE = ["--experts", "4", "--top-k", "2"]


@dataclass(frozen=True)
class Row:
    """``trainmesh ARGV`` exits ``code``; with 2, its first stderr line contains ``says`` (None:
    the answer is the usage on stdout)."""

    argv: tuple[str, ...]
    code: int = 2
    says: str | None = ""


def row(line: str, code: int = 2, says: str | None = "") -> Row:
    """A row from one shell-like line (fields split on spaces; ``''`` is the empty string)."""
    return Row(tuple("" if w == "''" else w for w in line.split()), code, says)


ROWS = [
    # ---- trainmesh itself
    row("", 2, None), row("--version", 0), row("nonsense", 2, "COMMAND"), row("--dpp 2", 2, "COMMAND"),
    row("train --version", 0), row("train --dpp 2", 2, "--dp"), row("train --help", 0, None),
    # ---- train: files and values the generated rows do not reach
    row("train --config {missing}", 2, "--config"), row("train --config {empty}", LAUNCHED),
    row("train --config {notjson}", 2, "--config"), row("train --config {bad_toml}", 2, "--config"),
    row("train --config {negative_toml}", 2, "--dp"), row("train --config {nan_toml}", 2, "--lr"),
    row("train --config {dir}", 2, "--config"), row("train --config {binary}", 2, "--config"),
    row("verify --config {missing}", 2, "--config"), row("verify --config {bad_toml}", 2, "--config"),
    row("verify --model-dir {missing} --layers 1", 2, "--model-dir"),
    row("train --data {missing}", 2, "--data"), row("train --data {empty}", 2, "--data"),
    row("train --data {dir}", 2, "--data"), row("train --data {binary}", 2, "--vocab-size"),
    row("train --data {ckpt_dense}", 2, "--data"),
    row("train --init-from {missing}", 2, "--init-from"),
    row("train --init-from {notjson}", 2, "--init-from"),
    row("train --init-from {truncated_safetensors}", 2, "--init-from"),
    row("train --model-dir {missing}", 2, "--model-dir"), row("train --model-dir {dir}", 2, "--model-dir"),
    row("train --model-dir {ckpt_dense}", 2, "--model-dir"),
    row("train --metrics-out {dir}", 2, "--metrics-out"),
    row("train --metrics-out /dev/null/x.jsonl", 2, "--metrics-out"),
    row("train --trace-out {dir}", 2, "--trace-out"), row("train --timeline-out {dir}", 2, "--timeline-out"),
    row("train --save-dir {notjson}", 2, "--save-dir"),
    row("train --tensorboard {notjson}", 2, "--tensorboard"),
    row("train --offload-dir {notjson} --zero 1 --offload nvme", 2, "--offload-dir"),
    row("train --compile-backend aot_eager", 2, "--compile-backend"),
    row("train --resume --save-dir {ckpt_corrupt}", 2, "--resume"),
    row("train --resume --save-dir {ckpt_dense} " + " ".join(T), LAUNCHED),
    row("train --resume --save-dir {ckpt_dense} " + " ".join(T[:2]) + " --d-model 48 --heads 4", 2,
        "--d-model"),
    row("train --resume --save-dir {ckpt_moe} " + " ".join(T), 2, "--experts"),
    row("train --resume --save-dir {ckpt_moe} " + " ".join(T + MOE) + " --dp 2 --ep 2", LAUNCHED),
    row("train --dp 2 --ep 2", 2, "--ep"), row("train --experts 3 --ep 2 --dp 2", 2, "--ep"),
    row("train --steps 1e3", 2, "--steps"), row("train --seed 0x10", 2, "--seed"),
    row("train --lr -1", 2, "--lr"), row("train --fault-tolerant", 2, "--fault-tolerant"),
    row("train --sequence-parallel=yes", 2, "--sequence-parallel"),
    row("train --tokenizer nonsense", 2, "--tokenizer"), row("train --reduce-dtype fp8", 2, "--reduce-dtype"),
    row("train --gpu nonsense", 2, "--gpu"), row("train --verbose --steps 2", LAUNCHED),
    row("train --verbose=yes", 2, "--verbose"),
    # ---- plan
    row("plan", 2), row("plan --model nonsense --gpus 8", 2, "--model"), row("plan --list-gpus", 0),
    row("plan --params -1 --gpus 8", 2, "--params"), row("plan --params nan --gpus 8", 2, "--params"),
    row("plan --params 7B --gpus 0 --layers 32 --hidden 4096 --heads 32 --seq-len 2048", 2, "--gpus"),
    row("plan --params 7B --gpus 8 --layers 32 --hidden 4096 --heads 32 --seq-len 2048 --micro-batch 0",
        2, "--micro-batch"),
    row("plan --params 7B --gpus 8 --layers 32 --hidden 0 --heads 32 --seq-len 2048", 2, "--hidden"),
    row("plan --model llama3-8b --gpus 8 --gpus-per-node 0", 2, "--gpus-per-node"),
    row("plan --model tiny --document-len 0", 2, "--document-len"),
    row("plan --model tiny --document-len 1e9", 2, "--document-len"),
    row("plan --model llama3-8b --gpus 8 --gpu-mem -80GB", 2, "--gpu-mem"),
    row("plan --model llama3-8b --gpus 8 --gpu-mem lots", 2, "--gpu-mem"),
    row("plan --model llama3-8b --gpus 8 --intra-node-bw inf", 2, "--intra-node-bw"),
    row("plan --model llama3-8b --gpus 8 --inter-node-bw 0GB/s", 2, "--inter-node-bw"),
    row("plan --model llama3-8b --gpus 8 --peak-tflops nan", 2, "--peak-tflops"),
    row("plan --model llama3-8b --gpus 8 --gpu nonsense", 2, "--gpu"),
    row("plan --model llama3-8b --gpus 8 --json", 0),
    row("plan --model-dir {missing} --gpus 8", 2, "--model-dir"),
    row("plan --model-dir {dir} --gpus 8", 2, "--model-dir"),
    row("plan --model llama3-8b --gpus 8 --kernels nonsense", 2, "--kernels"),
    row("plan --model llama3-8b --gpus 8 --calibrate {missing}", 2, "--calibrate"),
    row("plan --model llama3-8b --gpus 8 --calibrate {notjson}", 2, "--calibrate"),
    row("plan --model llama3-8b --gpus 8 --calibrate {empty}", 2, "--calibrate"),
    row("plan --model tiny --dp 2 --json", 0),
    # ---- schedule
    row("schedule --pp 0", 2, "pp"), row("schedule --pp -2", 2, "pp"),
    row("schedule --microbatches 0", 2, "microbatches"),
    row("schedule --microbatches x", 2, "--microbatches"),
    row("schedule --schedule nonsense", 2, "--schedule"),
    row("schedule --virtual-stages 2", 2, "virtual"),
    row("schedule --virtual-stages 0 --schedule interleaved", 2, "virtual"),
    row("schedule --out {dir}/x.gif", 2, "out"), row("schedule --out /dev/null/x.svg", 2, "out"),
    row("schedule --pp 2 --microbatches 2 --json", 0),
    # ---- bench (never valid here: a valid one starts processes)
    row("bench", 2), row("bench comm --sizes 12XB", 2, "sizes"), row("bench comm --sizes -4KB", 2, "sizes"),
    row("bench comm --sizes ''", 2, "sizes"), row("bench comm --ops nonsense", 2, "ops"),
    row("bench comm --algorithms ''", 2, "algorithms"), row("bench comm --nproc 1", 2, "nproc"),
    row("bench comm --iters 0", 2, "iters"), row("bench comm --nproc x", 2, "--nproc"),
    row("bench comm --json --iters -1", 2, "iters"),
    # ---- checkpoint
    row("checkpoint", 2), row("checkpoint consolidate", 2), row("checkpoint nonsense", 2),
    row("checkpoint consolidate {missing} {out}/m.safetensors", 2, "DIR"),
    row("checkpoint consolidate {empty_dir} {out}/m.safetensors", 2, "DIR"),
    row("checkpoint consolidate {notjson} {out}/m.safetensors", 2, "DIR"),
    row("checkpoint consolidate {ckpt_corrupt} {out}/m.safetensors", 2, "DIR"),
    row("checkpoint consolidate {ckpt_dense} {out}/m.txt", 2, "OUT"),
    row("checkpoint consolidate {ckpt_dense} {ckpt_dense}/m.safetensors", 2, "OUT"),
    row("checkpoint consolidate {ckpt_dense} {existing_safetensors}", 2, "OUT"),
    row("checkpoint consolidate {ckpt_dense} {existing_safetensors} --force", 0),
    row("checkpoint consolidate {ckpt_moe} {out}/moe.safetensors", 0),
    row("checkpoint export-hf {missing} {out}/hf1", 2, "DIR"),
    row("checkpoint export-hf {empty_dir} {out}/hf2", 2, "DIR"),
    row("checkpoint export-hf {ckpt_corrupt} {out}/hf3", 2, "DIR"),
    row("checkpoint export-hf {ckpt_dense} {notjson}", 2, "OUTDIR"),
    row("checkpoint export-hf {ckpt_dense} {ckpt_dense}/hf", 2, "OUTDIR"),
    row("checkpoint export-hf {ckpt_moe} {out}/hf4", 2, "--experts"),
    row("checkpoint export-hf {ckpt_dense} {out}/hf5", 0),
    # ---- launch
    # ---- coordinator (a valid one serves until its run ends: none here)
    row("coordinator", 2, None), row("coordinator --version", 0),
    row("coordinator --bind x --replicas 3", 2, "--bind"),
    row("coordinator --bind 127.0.0.1:99999 --replicas 3", 2, "--bind"),
    row("coordinator --bind :29400 --replicas 3", 2, "--bind"),
    row("coordinator --bind 192.0.2.1:0 --replicas 3 --secret-file {secret}", 2, "--bind"),   # not this host's
    row("coordinator --bind 127.0.0.1:0 --replicas 3 --secret-file {notjson}", 2, "--secret-file"),   # 0644
    row("coordinator --bind 127.0.0.1:0 --replicas 3 --secret-file {missing}", 2, "--secret-file"),
    row("coordinator --bind 127.0.0.1:0 --replicas 1", 2, "--replicas"),
    row("coordinator --bind 127.0.0.1:0 --replicas -3", 2, "--replicas"),
    row("coordinator --bind 127.0.0.1:0 --replicas x", 2, None),
    # ---- train: a replica of a fault-tolerant run across hosts
    row("train --replica-id 0", 2, "--replica-id"),
    row("train --dp 3 --fault-tolerant --secret-file {secret}", 2, "--secret-file"),   # one host
    row("train --dp 3 --fault-tolerant --coordinator 127.0.0.1:1", 2, "--replica-id"),
    row("train --dp 3 --fault-tolerant --coordinator 127.0.0.1:1 --replica-id 0 --replicas 2", 2,
        "--replicas"),
    row("train --fault-tolerant --coordinator 127.0.0.1:1 --replica-id 3 --replicas 3", 2,
        "--replica-id"),
    row("train --fault-tolerant --coordinator nonsense --replica-id 0 --replicas 3", 2,
        "--coordinator"),
    row("train --fault-tolerant --coordinator 127.0.0.1:0 --replica-id 0 --replicas 3", 2,
        "--coordinator"),
    row("train --fault-tolerant --coordinator @ --replica-id 0 --replicas 3", 2, "--coordinator"),
    row("train --fault-tolerant --coordinator 127.0.0.1:1 --replica-id 0 --replicas 3", LAUNCHED),
    row("train --fault-tolerant --coordinator @{empty} --replica-id 0 --replicas 3", LAUNCHED),
    row("launch", 2), row("launch nonsense", 2), row("launch slurm", 2, "--nodes"),
    row("launch slurm --nodes 0 --gpus-per-node 4", 2, "nodes"),
    row("launch slurm --nodes 1 --gpus-per-node -1", 2, "gpus-per-node"),
    row("launch slurm --nodes x --gpus-per-node 1", 2, "--nodes"),
    row("launch slurm --nodes 2 --gpus-per-node 8 -- --dp 4", 2, "--dp"),
    row("launch slurm --nodes 1 --ntasks-per-node 0", 2, "--ntasks-per-node"),
    row("launch slurm --nodes 1 --gpus-per-node 2 --ntasks-per-node 4", 2, "--ntasks-per-node"),
    row("launch slurm --nodes 1 --cpus-per-task 0", 2, "--cpus-per-task"),
    row("launch slurm --nodes 2 --ntasks-per-node 2 --cpus-per-task 4 -- --steps 5", 0),
    row("launch slurm --nodes 1 --gpus-per-node 2 -- --dp 2 --zero 9", 2, "--zero"),
    row("launch slurm --nodes 1 --gpus-per-node 2 --job-name '' -- --dp 2", 2, "job-name"),
    row("launch slurm --nodes 1 --gpus-per-node 2 --partition '' -- --dp 2", 2, "partition"),
    row("launch slurm --nodes 1 --gpus-per-node 2 --time soon -- --dp 2", 2, "time"),
    row("launch slurm --nodes 1 --gpus-per-node 2 --time 01:00:00 -- --dp 2", 0),
    # ---- report: files of every kind
    row("report {missing}", 2, "RUN.jsonl"), row("report {empty}", 2, "RUN.jsonl"),
    row("report {dir}", 2, "RUN.jsonl"), row("report {notjson}", 2, "RUN.jsonl"),
    row("report {binary}", 2, "RUN.jsonl"), row("report {plan_json}", 2, "RUN.jsonl"),
    row("report {truncated_safetensors}", 2, "RUN.jsonl"),
    row("report {metrics_step_only} -o {out}/a.html", 0),
    row("report {metrics_cut} -o {out}/b.html", 0), row("report {metrics_ft} -o {out}/c.html", 0),
    row("report {metrics_nonfinite} -o {out}/d.html", 0), row("report {metrics_types} -o {out}/e.html", 0),
    row("report {metrics_summary_only} -o {out}/f.html", 0),
    row("report {metrics_ft} -o {dir}", 2, "--out"),
    row("report {metrics_ft} --out /dev/null/r.html", 2, "--out"),
]


def generated(command: str, flags: list[str], prefix: tuple[str, ...] = ()) -> list[Row]:
    """Rows from each flag's declared type and range (module docstring)."""
    meta = {f.name: f.metadata for cls in (TrainConfig, ParallelConfig) for f in fields(cls)}
    out = []
    for flag in flags:
        f = FLAGS[flag]
        m = meta[f.field]
        bad = []
        if f.kind is bool:
            bad.append(f"{flag}=1")
        elif f.choices:
            bad.append("nonsense" if f.kind is str else "-7")
        elif f.kind is int:
            bad += ["x", str(2**70)]
        elif f.kind is float:
            bad += ["nan", "-inf"]
        else:   # a string, a path
            bad.append("")
        for bound in ("ge", "gt"):
            if m.get(bound) is not None and f.kind in (int, float):
                bad.append(str(int(m[bound]) - 1 if f.kind is int or bound == "ge" else m[bound]))
        for value in bad:
            argv = (command, *prefix, value) if "=" in value else (command, *prefix, flag, value)
            out.append(Row(argv, 2, flag))
    return out


def _plan_flags() -> list[str]:
    from trainmesh.cli.plan import _plan_flags as keep
    return keep()


GENERATED = [*generated("train", list(FLAGS)), *generated("verify", list(FLAGS)),
             *generated("plan", _plan_flags(), ("--model", "tiny"))]


# ---------------------------------------------------------------- the files the rows name
def _checkpoint(root: Path, extra: list[str]) -> Path:
    """A checkpoint of the built-in GPT of ``T + extra``, written in this process after one
    step (one rank: the format is the same under every layout)."""
    from trainmesh.checkpoint.resume import run_record
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.engine.engine import Engine
    from trainmesh.models.gpt import GPT
    cfg = build_train_config(collect(build_parser().parse_args(["train", *T, *extra]), True))
    engine = Engine(GPT(cfg.gpt_config(), seed=0), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                    lambda m, b: m(**b), ParallelConfig(), mesh=ParallelMesh(local=True))
    engine.train_step(SyntheticCorpus(64, 16).batch(0, 1, 8))
    engine.save(str(root), {"run": run_record(cfg)})
    return root


def _lines(records: list) -> str:
    return "\n".join(json.dumps(r) for r in records) + "\n"


STEP = {"event": "step", "step": 1, "loss": 4.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 128,
        "step_time_s": 0.1, "tokens_per_s": 1280.0, "mfu": None}
FT_SUMMARY = {"event": "summary", "world_size": 2, "layout": {"dp": 2, "pp": 1, "tp": 1, "cp": 1,
              "fault_tolerant": True, "replicas": 2, "precision": "fp32"}, "params": 10,
              "final_loss": 3.0, "steps": 2, "ranks": [{"rank": 0, "replica": 0, "pids": [1],
              "restarts": 0}, {"rank": 1, "replica": 1, "pids": [2, 3], "restarts": 1}],
              "fault_tolerance": {"degraded_steps": 1, "failed_attempts": 1, "recovery_s": 0.5,
                                  "state_transfer_s": 0.01}}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Name -> path of every file the rows name."""
    tmp = tmp_path_factory.mktemp("inputs")
    out = tmp / "out"
    out.mkdir()
    (tmp / "dir").mkdir()
    (tmp / "empty_dir").mkdir()
    writes = {
        "empty": "", "notjson": "this is { not json\n", "bad_toml": "dp = [1,\n",
        "negative_toml": "dp = -2\n", "nan_toml": "lr = nan\n",
        "plan_json": json.dumps({"candidates": [], "recommended": None}) + "\n",
        "metrics_step_only": _lines([{"event": "step", "step": 1}]),
        "metrics_cut": _lines([STEP, {**STEP, "step": 2}]) + '{"event": "step", "step": 3, "lo',
        "metrics_ft": _lines([{**STEP, "replicas": 2},
                              {"event": "discarded", "step": 2, "replicas": 2, "attempt_s": 0.3,
                               "why": "replica 1 lost"},
                              {"event": "quorum", "step": 2, "replicas": 1, "lost": [1], "joined": [],
                               "recovering_s": 0.4}, {**STEP, "step": 2, "replicas": 1},
                              FT_SUMMARY]),
        "metrics_nonfinite": _lines([{**STEP, "loss": math.nan, "grad_norm": math.inf}]),
        "metrics_types": _lines([{**STEP, "step": "1"}, {**STEP, "loss": "low", "moe": [1]},
                                 {"event": "summary", "layout": "dp 2", "ranks": 3, "moe": 1},
                                 [1, 2], 7, None]),
        "metrics_summary_only": _lines([FT_SUMMARY]),
    }
    paths = {name: tmp / f"{name}.txt" for name in writes}
    for name, text in writes.items():
        paths[name].write_text(text)
    (tmp / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (tmp / "secret").write_text("a-secret-of-this-job-0123456789")
    (tmp / "secret").chmod(0o600)
    (tmp / "truncated.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    (tmp / "existing.safetensors").write_bytes(b"")
    dense, moe = _checkpoint(tmp / "ckpt_dense", []), _checkpoint(tmp / "ckpt_moe", MOE)
    corrupt = tmp / "ckpt_corrupt"
    import shutil
    shutil.copytree(dense, corrupt)
    for f in corrupt.rglob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    return {**{k: str(v) for k, v in paths.items()}, "missing": str(tmp / "missing"),
            "dir": str(tmp / "dir"), "empty_dir": str(tmp / "empty_dir"), "out": str(out),
            "secret": str(tmp / "secret"),
            "binary": str(tmp / "binary.bin"), "truncated_safetensors": str(tmp / "truncated.safetensors"),
            "existing_safetensors": str(tmp / "existing.safetensors"), "ckpt_dense": str(dense),
            "ckpt_moe": str(moe), "ckpt_corrupt": str(corrupt)}


# ---------------------------------------------------------------- the checks
def answer(argv: list[str], capsys) -> tuple[int, list[str]]:
    """``trainmesh ARGV`` in process: (exit status, stderr lines)."""
    try:
        code = main(argv)
    except SystemExit as exc:   # argparse's own exits (--help, --version, a bad type)
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:   # noqa: BLE001 - what `python -m trainmesh` shows: a traceback, exit 1
        sys.stderr.write(traceback.format_exc())
        code = 1
    return code, capsys.readouterr().err.strip().splitlines()


def check(r: Row, argv: list[str], capsys) -> None:
    code, err = answer(argv, capsys)
    text = "\n".join(err)
    assert "Traceback" not in text, (argv, text)
    assert code == r.code, (argv, code, text)
    assert len(err) <= 2, (argv, err)
    if r.code == 2 and r.says is not None:
        assert err and r.says in err[0], (argv, err)


def _id(r: Row) -> str:
    return " ".join(r.argv)[:80] or "(nothing)"


@pytest.fixture(scope="module")
def one_parser():
    """The parsers built once for the module (argparse parsers keep no state between parses):
    building them is most of the cost of a row."""
    import functools

    import trainmesh.cli
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainmesh.cli, "build_parser", functools.cache(trainmesh.cli.build_parser))
        yield


@pytest.mark.timeout(120)
@pytest.mark.parametrize("r", ROWS + GENERATED, ids=_id)
def test_bad_input_is_answered_in_one_line(r, files, capsys, no_launch, one_parser):
    check(r, [a.format(**files) for a in r.argv], capsys)


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """(sub-command path, option or positional metavar) of every argument of every parser."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _options(sub, (*path, name))
        elif isinstance(action, argparse._HelpAction):
            continue
        else:
            out.append((path, action.option_strings[-1] if action.option_strings
                        else action.metavar or action.dest))
    return out


def _covers(r: Row, path: tuple[str, ...], option: str) -> bool:
    """Whether row ``r`` gives ``option`` (a positional: any argument) to sub-command ``path``."""
    rest = r.argv[len(path):]
    if r.argv[:len(path)] != path:
        return False
    if option.startswith("-"):
        return any(a == option or a.startswith(option + "=") for a in rest)
    return any(not a.startswith("-") for a in rest)


def test_every_flag_of_every_subcommand_has_a_row():
    """A flag added to any parser without a row here fails, naming it: add one line to ROWS."""
    rows = ROWS + GENERATED
    missing = [f"trainmesh {' '.join(path)} {option}".replace("  ", " ")
               for path, option in _options(build_parser(), ())
               if not any(_covers(r, path, option) for r in rows)]
    assert not missing, f"no bad-input row for: {', '.join(missing)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_files_of_every_layout_and_mode(observed_run, tmp_path, capsys, no_launch):
    """The checkpoints and metrics files of real runs of every layout and mode: consolidate and
    export (MoE: refused in one line), resume under one process; the file of one kind where
    another is expected is refused in one line (test_report draws every run's metrics)."""
    for name, spec in OBSERVED.items():
        run = observed_run(name)
        check(Row(("train",), 2, "--config"), ["train", "--config", str(run / "run.jsonl")], capsys)
        check(Row(("checkpoint",), 2, "DIR"), ["checkpoint", "consolidate", str(run / "run.jsonl"),
                                               str(tmp_path / f"{name}-x.safetensors")], capsys)
        if not spec.saves:
            continue
        ckpt = str(run / "ckpt")
        check(Row(("checkpoint",), 0), ["checkpoint", "consolidate", ckpt,
                                        str(tmp_path / f"{name}.safetensors")], capsys)
        moe = "--experts" in spec.flags
        check(Row(("checkpoint",), 2 if moe else 0, "--experts"),
              ["checkpoint", "export-hf", ckpt, str(tmp_path / f"{name}-hf")], capsys)
        shape = [*T, *(MOE if moe else [])]
        check(Row(("train",), LAUNCHED), ["train", "--resume", "--save-dir", ckpt, *shape], capsys)
        check(Row(("report",), 2, "RUN.jsonl"), ["report", ckpt, "-o", str(tmp_path / "x.html")], capsys)
