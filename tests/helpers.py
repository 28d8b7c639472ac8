"""Shared test helpers: run `trainmesh train` end to end and compare runs by the README's promise."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_zygote import zygote
from tolerances import LOSS_ABS, NORM_REL

LAUNCHED = 99
"""What ``trainmesh train`` returns under the ``no_launch`` fixture once validation has passed."""



def _compile_refusal() -> str:
    """Why ``--compile`` cannot run on this machine's CPU ('' when it can): the same check
    ``trainmesh train --compile`` makes before any worker starts."""
    from trainmesh.core.errors import ConfigError
    from trainmesh.engine.compile import check_compile
    try:
        check_compile("cpu")
    except ConfigError as e:
        return str(e)
    return ""


_COMPILE_REFUSAL = _compile_refusal()
needs_cxx = pytest.mark.skipif(bool(_COMPILE_REFUSAL), reason=_COMPILE_REFUSAL or "-")
"""For tests that run ``--compile`` on CPU: inductor builds C++ kernels."""


def skip_if_the_compiler_failed(proc: subprocess.CompletedProcess) -> None:
    """Skip a ``--compile`` test whose run found this machine's C++ compiler failing (refused
    before any worker, or failing inside inductor): the machine's fault, named in the skip."""
    said = proc.stderr.strip().splitlines()
    if proc.returncode == 2 and said and "needs a working C++ compiler" in said[-1]:
        pytest.skip(f"{said[-1]} {_compiler_now()}")
    if proc.returncode != 0 and "CppCompileError" in proc.stderr and "cannot execute" in proc.stderr:
        pytest.skip(f"{next(line for line in said if 'cannot execute' in line).strip()} {_compiler_now()}")


def _compiler_now() -> str:
    """The launcher's check again from the test's process, at once, and where the compiler
    looks for its compiler proper: whether the fault lasts (for a report of an intermittent one)."""
    from trainmesh.engine.compile import _compiler_fault, inductor_cxx
    cxx = inductor_cxx()
    fault = _compiler_fault.__wrapped__(cxx) or "passes"   # not the launcher's cached answer
    try:
        where = subprocess.run([cxx, "-print-prog-name=cc1plus"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(checked again from the test: {fault}; {exc})"
    return (f"(checked again from the test: {fault}; {cxx} finds cc1plus at {where!r}, which "
            f"{'exists' if Path(where).exists() else 'does not exist'})")

# A small but real GPT for end-to-end runs (fast on 2 cores).
SMALL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16",
         "--vocab-size", "64", "--global-batch", "8", "--steps", "20", "--warmup-steps", "5"]
EVAL = ["--eval-every", "5", "--eval-batches", "2"]


def one_process(optimizer: str = "adamw") -> list[str]:
    """The arguments of the one-process reference run of :data:`SMALL` that several modules
    compare layouts with (the ``reference_run`` fixture runs it once per session); it also
    scores the held-out batches every 5 steps (evaluating leaves training untouched)."""
    return [*SMALL, "--optimizer", optimizer, *EVAL]


def run_train(args: list[str], tmp: Path, *, timeout: float = 180, name: str = "m") -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`python -m trainmesh train ARGS --metrics-out ...` -> (process, metrics records)."""
    out = tmp / f"{name}.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = trainmesh_process(["train", *args, "--metrics-out", str(out)], tmp, env=env,
                             timeout=timeout, name=name)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, records


def trainmesh_process(argv: list[str], tmp: Path, *, env: dict[str, str], timeout: float,
                      name: str = "m", cwd: Path | None = None,
                      umask: int | None = None) -> subprocess.CompletedProcess:
    """``trainmesh ARGV`` run to its end as a launcher process of its own, forked from this
    test process's zygote (tests/launcher_zygote.py: the interpreter's start-up shared), or
    started afresh where the zygote is off; its output captured. It runs in ``cwd`` (default:
    this process's), with file mode creation mask ``umask`` where one is given."""
    stdout, stderr = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
    cwd = cwd or Path.cwd()
    code = zygote().run(argv, env, cwd, stdout, stderr, timeout, umask=umask)
    if code is None:
        return subprocess.run([sys.executable, "-m", "trainmesh", *argv], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=cwd,
                              preexec_fn=None if umask is None else lambda: os.umask(umask))
    return subprocess.CompletedProcess(["trainmesh", *argv], code, stdout.read_text(),
                                       stderr.read_text())


class Launched:
    """``trainmesh ARGV`` running in the background as a launcher of its own: forked from this
    test process's zygote (the interpreter's start-up shared), or started afresh where the
    zygote is off (``TRAINMESH_TEST_ZYGOTE=0``). The subset of ``subprocess.Popen`` tests use,
    its output in files (``communicate`` returns their text), and its workers (:meth:`workers`). With
    ``own_fork_server`` (tests that signal the launcher or end its process tree) its workers
    fork from a fork server of its own, as a fresh launcher's do; without (tests that kill a
    worker), from the zygote's shared one, so no interpreter starts for the run. With
    ``hostname``, it and its workers run under that hostname (a UTS namespace: root only)."""

    def __init__(self, argv: list[str], tmp: Path, *, env: dict[str, str], name: str,
                 own_fork_server: bool = True, hostname: str | None = None) -> None:
        self.out, self.err = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
        self.zygote = zygote()
        self.proc = self.zygote.start(argv, env, Path.cwd(), self.out, self.err,
                                      own_fork_server=own_fork_server, hostname=hostname)
        if self.proc is None:
            self.zygote = None
            renamed = (["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh"]
                       if hostname else [])
            with open(self.out, "w") as out, open(self.err, "w") as err:
                self.proc = subprocess.Popen([*renamed, sys.executable, "-m", "trainmesh", *argv], env=env,
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                             start_new_session=True)
        self.pid = self.proc.pid
        self.shared = self.zygote is not None and not own_fork_server

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (TimeoutExpired after ``timeout`` s); its stdout and stderr."""
        self.proc.wait(timeout)
        return self.out.read_text(), self.err.read_text()

    def workers(self) -> list[int]:
        """Its worker processes, by pid (rank order): the children of its own fork server, or
        of the zygote's shared one (this test's only run)."""
        from trainmesh.testing import worker_pids
        return worker_pids(self.zygote.proc.pid if self.shared else self.pid)

    def end(self) -> None:
        """Clean-up: SIGKILL its process group if it still runs, and wait for it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:   # no group yet (just forked) or no longer
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(30)


def train_config(args: list[str]):
    """The TrainConfig ``trainmesh train ARGS`` would run with (parsed and validated in process)."""
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    return build_train_config(collect(build_parser().parse_args(["train", *args]), True))


def step_differences(ref: list[tuple[float, float]], run: list[tuple[float, float]], what: str,
                     first: int = 1) -> list[str]:
    """Where the (loss, grad_norm) pairs of ``run``, from step ``first`` on, leave those of the
    one-process ``ref`` (loss beyond LOSS_ABS, grad norm beyond NORM_REL); one line each."""
    out = [] if run else [f"{what}: no steps"]
    for step, ((a, na), (b, nb)) in enumerate(zip(ref[first - 1:], run), first):
        if abs(a - b) > LOSS_ABS:
            out.append(f"{what} step {step}: loss {b} vs one process {a}")
        if abs(na - nb) > NORM_REL * na:
            out.append(f"{what} step {step}: grad_norm {nb} vs one process {na}")
    return out


def assert_refused(capsys, argv: list[str], flag: str) -> str:
    """``trainmesh ARGV`` (in process) exits 2 with exactly one line on stderr naming ``flag``,
    without a traceback; returns that line."""
    from trainmesh.cli import main
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0], err
    return err[0]


def steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "step"]


def summary(records: list[dict]) -> dict:
    return next(r for r in records if r["event"] == "summary")


def assert_equivalent(ref: list[dict], run: list[dict], *, loss_tol: float = LOSS_ABS, norm_rtol: float = NORM_REL,
                      min_steps: int = 20, first: int | None = None) -> None:
    """README.md: per step, loss within 1e-3 absolute and grad_norm within 1e-3 relative, over
    at least ``min_steps`` steps (``first``: the first steps of ``ref``, as many as ``run`` has,
    a run stopped by --exit-after on the same schedule)."""
    a, b = steps(ref), steps(run)
    if first is not None:
        assert len(b) == first, (len(b), first)
        a = a[:first]
    assert len(a) == len(b) and len(a) >= min_steps, (len(a), len(b))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= loss_tol, f"step {x['step']}: loss {x['loss']} vs {y['loss']}"
        assert abs(x["grad_norm"] - y["grad_norm"]) <= norm_rtol * abs(x["grad_norm"]), \
            f"step {x['step']}: grad_norm {x['grad_norm']} vs {y['grad_norm']}"


def check_prediction(args: list[str], measured: dict) -> None:
    """`trainmesh plan`'s model predicts what the run measured (plan vs measurement)."""
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    from trainmesh.planner.predict import compare, predict_run
    cfg = build_train_config(collect(build_parser().parse_args(["train", *args]), True))
    problems = compare(predict_run(cfg), measured)
    assert not problems, problems


def check_one_replica_restarted(records: list[dict], *, ranks: int, degraded: int) -> None:
    """A fault-tolerant run's summary: replica 0's ``ranks`` processes never restarted, replica 1
    restarted once (its ranks twice over), one failed attempt, ``degraded`` steps short of a
    replica."""
    s = summary(records)
    pids = {r["replica"]: r["pids"] for r in s["ranks"]}
    assert len(pids[0]) == ranks and len(pids[1]) == 2 * ranks, pids
    assert [r["restarts"] for r in s["ranks"]] == [0, 1]
    ft = s["fault_tolerance"]
    assert ft["failed_attempts"] == 1 and ft["degraded_steps"] == degraded, ft


def widened(model, std: float = 0.2):
    """``model`` with every matrix redrawn at ``std`` (transformers draws 0.02), from the
    global generator: attention far from uniform and each expert's output large, so that a
    weight, an expert or a position read in another's place shows in the loss."""
    import torch
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


def saved_models(tmp_path_factory, name: str, build, kinds) -> dict[str, str]:
    """A module fixture's hub models: each of ``kinds`` built by ``build(kind)`` and written
    with ``save_pretrained`` into its own directory of a fresh temporary ``name`` folder;
    {kind: directory}."""
    root = tmp_path_factory.mktemp(name)
    out = {}
    for kind in kinds:
        build(kind).save_pretrained(str(root / kind))
        out[kind] = str(root / kind)
    return out


def run_in_child(module: str, fn: str, args: list[str], tmp: Path, *, timeout: float = 120) -> tuple[int, str, str]:
    """``module.fn(args)`` (returning an exit code) in a process of its own: forked from the
    test zygote (torch already imported), else a fresh interpreter. (code, stdout, stderr)."""
    from launcher_zygote import TESTS
    out, err = tmp / f"{fn}.out", tmp / f"{fn}.err"
    child = zygote().start(args, dict(os.environ), tmp, out, err, call=f"{module}:{fn}")
    if child is not None:
        return child.wait(timeout), out.read_text(), err.read_text()
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           f"from {module} import {fn}; sys.exit({fn}(sys.argv[2:]))",
                           str(TESTS), *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr
