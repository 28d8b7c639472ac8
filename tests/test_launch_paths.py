"""One launcher for every run: the plain launch and the fault-tolerant one set up their elastic
agents the same way, the fault-tolerant run differing only where it must (workers per agent,
run ids, restarts, its secret, what each worker runs after the common preamble).

Both paths run in process with torch's ``elastic_launch``, the fork server's preload, the
--save-dir lock and the coordinator replaced by recorders; nothing starts. Bugs: a path with a
start method of its own (a --model-dir run's workers without transformers preloaded), its own
entry point, environment, monitor interval, grace or rendezvous, or without the --save-dir lock
the plain launch takes.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import types
from pathlib import Path

import pytest

from trainmesh.config.train import build_train_config
from trainmesh.core.stores import STORE_ENV
from trainmesh.fault_tolerance.auth import SECRET_ENV
from trainmesh.run.launch import HF_PRELOAD, WORKER_IMAGE, launch_local
from trainmesh.run.worker import WorkerMain, worker_entry

LEGITIMATE = ("nproc_per_node", "run_id", "max_restarts")
"""LaunchConfig fields in which the two paths differ by design: one agent for the whole job
against one per replica, each with its own run id and restart budget."""
SECRET = "s" * 64


class _FakeCoordinator:
    """What the fault-tolerant launcher asks of its local coordinator, every step committed."""

    address = "127.0.0.1:1"
    committed = final_loss = 0
    error = None

    def __init__(self, cfg, records: list) -> None:
        self.committed = cfg.exit_after or cfg.steps
        self.tally = types.SimpleNamespace(pids={0: [11], 1: [12, 13]}, degraded_steps=1,
                                           failed_attempts=2, recovery_s=0.5, transfer_s=0.25)
        self.metrics = types.SimpleNamespace(write=records.append)

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def join(self, timeout: float) -> None: ...
    def drain(self) -> None: ...


@pytest.fixture
def recorder(monkeypatch) -> dict:
    """Every launch recorded, nothing started: returns {"launches": [...], "locks": [...]}."""
    import torch.distributed.launcher.api as api

    import trainmesh.checkpoint.savedir
    import trainmesh.run.ft_launch
    import trainmesh.run.launch
    seen: dict = {"launches": [], "locks": [], "preload": None, "records": []}

    def elastic_launch(config, entrypoint):
        return lambda *args: seen["launches"].append(
            {"config": config, "entry": entrypoint, "args": args, "preload": seen["preload"]})

    class Lock:
        def __init__(self, path) -> None:
            seen["locks"].append(str(path))

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None: ...

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload",
                        lambda modules: seen.update(preload=list(modules)))
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(trainmesh.checkpoint.savedir, "SaveDirLock", Lock)
    monkeypatch.setattr(trainmesh.run.launch, "_prepare_agent", lambda: None)   # this process's torch
    board = types.SimpleNamespace(record=lambda r: None, close=lambda s: None)
    monkeypatch.setattr(trainmesh.run.ft_launch, "_local_coordinator",
                        lambda cfg, secret: (_FakeCoordinator(cfg, seen["records"]), board))
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")   # restored after the test
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)   # so that the threads each path picks show
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield seen
    for sig, handler in handlers.items():   # the fault-tolerant launcher takes the signals
        signal.signal(sig, handler)


def _launched(seen: dict, run) -> list[dict]:
    """Run ``run()`` (exit 0 expected) and return its launches, one per agent, by run id (a
    fault-tolerant run's agents are threads: they launch in any order)."""
    seen["launches"].clear()
    seen["locks"].clear()
    assert run() == 0
    return sorted(seen["launches"], key=lambda launch: launch["config"].run_id)


def _shape(launch: dict, here: int) -> dict:
    """What a launch's set-up must share with every other path's: its LaunchConfig but the
    legitimate differences (and what each launch makes afresh: the store's port, the log
    directory), the entry point, the fork server's preload, the workers' environment but the
    store's port and the secret, with OpenMP threads checked against ``here``, the workers
    this host runs, the entry's arguments by kind."""
    config = launch["config"]
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in LEGITIMATE}
    fields["rdzv_endpoint"] = fields["rdzv_endpoint"].rsplit(":", 1)[0]
    fields["rdzv_configs"] = {k: type(v).__name__ for k, v in fields["rdzv_configs"].items()}
    fields["logs_specs"] = type(fields["logs_specs"]).__name__
    cfg, pid, setup, env, stdio, main = launch["args"]
    env = {k: v for k, v in env.items() if k != SECRET_ENV}
    env[STORE_ENV] = env[STORE_ENV].rsplit(":", 1)[0]
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // here)), (env, here)
    env["OMP_NUM_THREADS"] = "the cores / the workers here"
    return {"config": fields, "entry": launch["entry"], "preload": launch["preload"],
            "cfg": cfg, "pid": pid, "setup": setup, "env": env, "stdio": type(stdio),
            "main": isinstance(main, WorkerMain)}


def _both(seen: dict, cfg, setup) -> tuple[list[dict], list[dict], list[str], list[str]]:
    from trainmesh.run.ft_launch import launch_fault_tolerant
    plain = _launched(seen, lambda: launch_local(cfg, nproc=cfg.parallel.world_size,
                                                 max_restarts=0, worker_setup=setup))
    plain_locks = list(seen["locks"])
    ft = _launched(seen, lambda: launch_fault_tolerant(cfg, max_restarts=3, worker_setup=setup))
    return plain, ft, plain_locks, list(seen["locks"])


def _assert_same_setup(plain: list[dict], ft: list[dict]) -> None:
    assert len(plain) == 1, plain
    want = _shape(plain[0], plain[0]["config"].nproc_per_node)
    for launch in ft:
        got = _shape(launch, launch["config"].nproc_per_node * len(ft))
        differ = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
        assert not differ, f"the fault-tolerant launch sets up its agent otherwise: {differ}"
        assert launch["args"][3][SECRET_ENV], "the workers' secret"


def _setup() -> None:
    """The caller's worker set-up (the CLI's logging configuration)."""


@pytest.mark.timeout(60)
def test_fault_tolerant_and_plain_launches_set_up_agents_alike(recorder, tmp_path, capsys):
    cfg = build_train_config({"dp": 2, "fault_tolerant": True, "steps": 2, "layers": 1,
                              "d_model": 16, "heads": 2, "save_dir": str(tmp_path / "ckpt")})
    plain, ft, plain_locks, ft_locks = _both(recorder, cfg, _setup)
    _assert_same_setup(plain, ft)
    assert [launch["config"].run_id.rsplit("-", 1)[1] for launch in ft] == ["r0", "r1"]
    assert plain[0]["preload"] == [WORKER_IMAGE]
    assert plain[0]["entry"] is worker_entry
    assert plain_locks == ft_locks == [str(tmp_path / "ckpt")], \
        f"the --save-dir lock: plain {plain_locks}, fault-tolerant {ft_locks}"
    summary, = recorder["records"]   # the launcher's part after the agents: the run's summary
    assert list(summary) == ["event", "world_size", "layout", "params", "final_loss", "steps",
                             "ranks", "fault_tolerance"], summary
    assert summary["ranks"] == [{"rank": 0, "replica": 0, "pids": [11], "restarts": 0},
                                {"rank": 1, "replica": 1, "pids": [12, 13], "restarts": 1}]
    assert summary["fault_tolerance"] == {"degraded_steps": 1, "failed_attempts": 2,
                                          "recovery_s": 0.5, "state_transfer_s": 0.25}
    assert (summary["world_size"], summary["steps"]) == (2, 2)
    assert "2 steps in" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_model_dir_workers_preload_transformers_on_both_paths(recorder, tmp_path, monkeypatch):
    """The drift this launcher removed: the fault-tolerant path's workers did not start with
    transformers imported for a --model-dir run. (The model's config alone: no weights are
    read, and its parameter count, which the launcher prints, would build the model.)"""
    pytest.importorskip("transformers")
    from trainmesh.config.train import TrainConfig
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64,
        "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 1, "max_position_embeddings": 16}))
    monkeypatch.setattr(TrainConfig, "num_params", lambda self: 1)
    cfg = build_train_config({"model_dir": str(tmp_path), "dp": 2, "fault_tolerant": True,
                              "steps": 2, "seq_len": 16, "global_batch": 4})
    plain, ft, _, _ = _both(recorder, cfg, None)
    forked = "forkserver" in multiprocessing.get_all_start_methods()
    assert plain[0]["preload"] == ([WORKER_IMAGE, HF_PRELOAD] if forked else None), plain[0]["preload"]
    _assert_same_setup(plain, ft)


@pytest.mark.timeout(60)
def test_a_replica_across_hosts_launches_as_the_plain_run_without_the_lock(recorder, tmp_path):
    """Across hosts: one agent (this host's replica), the same set-up, and no --save-dir lock
    (the replicas share the directory)."""
    cfg = build_train_config({"dp": 2, "fault_tolerant": True, "steps": 2, "layers": 1,
                              "d_model": 16, "heads": 2, "coordinator": "127.0.0.1:29999",
                              "replica_id": 1, "replicas": 2, "save_dir": str(tmp_path / "c")})
    plain, ft, plain_locks, ft_locks = _both(recorder, cfg, _setup)
    _assert_same_setup(plain, ft)
    assert [launch["config"].run_id.rsplit("-", 1)[1] for launch in ft] == ["r1"]
    assert ft[0]["args"][5].address == "127.0.0.1:29999"
    assert plain_locks == [str(tmp_path / "c")] and ft_locks == []


def test_one_module_sets_up_elastic_agents():
    """No second launcher beside run/launch.py (a copy of the set-up is where drift starts)."""
    import trainmesh.run
    others = [path.name for path in Path(trainmesh.run.__file__).parent.glob("*.py")
              if path.name != "launch.py"
              and ("LaunchConfig(" in path.read_text() or "elastic_launch(" in path.read_text())]
    assert not others, f"elastic agents set up outside run/launch.py: {others}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, launcher, restarts", [
    (["--dp", "2"], "plain", 0),
    (["--dp", "2", "--strategy", "ps"], "plain", 0),
    (["--dp", "2", "--strategy", "diloco", "--inner-steps", "2"], "plain", 0),
    (["--dp", "2", "--fault-tolerant"], "fault-tolerant", 3),
])
def test_each_strategy_goes_to_its_launcher(no_launch, monkeypatch, argv, launcher, restarts):
    """``trainmesh train`` hands every strategy to the launcher it declares, with the run's
    restarts and the workers' logging set-up."""
    import trainmesh.run.ft_launch
    import trainmesh.run.launch
    from trainmesh.cli import main
    from trainmesh.cli.logs import configure_worker_logging
    calls = []
    for module, name, kind in ((trainmesh.run.launch, "launch_local", "plain"),
                               (trainmesh.run.ft_launch, "launch_fault_tolerant", "fault-tolerant")):
        monkeypatch.setattr(module, name, lambda cfg, *, kind=kind, **kw: calls.append((kind, kw)) or 0)
    assert main(["train", "--steps", "2", "--layers", "1", "--d-model", "16", "--heads", "2",
                 *argv]) == 0
    (kind, kwargs), = calls
    assert kind == launcher
    assert kwargs["max_restarts"] == restarts and kwargs["worker_setup"] is configure_worker_logging
