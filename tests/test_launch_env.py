"""The local launcher gives its workers their environment (its own as it is at the launch, its
store, OpenMP threads, unbuffered output) through the elastic launcher's entry-point arguments,
never by writing its own os.environ."""
from __future__ import annotations

import os

import pytest

from trainmesh.core.stores import STORE_ENV
from trainmesh.run.launch import apply_env, local_rendezvous, worker_env


@pytest.mark.timeout(30)
def test_worker_env_leaves_the_launchers_environment_alone(monkeypatch):
    monkeypatch.delenv(STORE_ENV, raising=False)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")            # the user's own: kept, not overridden
    before = dict(os.environ)
    with local_rendezvous() as rendezvous:
        env = worker_env(rendezvous, threads=2)
        assert STORE_ENV not in os.environ
    assert env == {**before, STORE_ENV: rendezvous["rdzv_endpoint"], "PYTHONUNBUFFERED": "1",
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert env["OMP_NUM_THREADS"] == "7"
    before.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)   # read by torch's agent, in-process
    after = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    assert after == before
    monkeypatch.delenv("OMP_NUM_THREADS")
    with local_rendezvous() as rendezvous:
        assert worker_env(rendezvous, threads=2)["OMP_NUM_THREADS"] == "2"


@pytest.mark.timeout(30)
def test_apply_env_sets_the_workers_environment(monkeypatch):
    monkeypatch.delenv("TRAINMESH_TEST_ONLY", raising=False)
    apply_env({"TRAINMESH_TEST_ONLY": "1"})
    assert os.environ["TRAINMESH_TEST_ONLY"] == "1"
    monkeypatch.delenv("TRAINMESH_TEST_ONLY")


@pytest.mark.timeout(30)
def test_a_forked_worker_takes_the_launchers_environment_and_keeps_the_agents(monkeypatch):
    """A worker forked by a server that started with another environment: what the server had
    and the launcher has not is gone, what the launcher has is there, and what the elastic agent
    set for this worker (its rank) stays."""
    import sys
    import types

    from trainmesh.run.launch import WORKER_IMAGE
    saved = dict(os.environ)
    server = {"PATH": "/server", "STALE": "1"}
    monkeypatch.setitem(sys.modules, WORKER_IMAGE, types.SimpleNamespace(STARTED_WITH=server))
    try:
        os.environ.clear()
        os.environ.update({**server, "RANK": "3"})          # the server's, and the agent's
        apply_env({"PATH": "/launcher", "FRESH": "1"})
        seen = dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert seen == {"PATH": "/launcher", "FRESH": "1", "RANK": "3"}


def _what_the_worker_sees() -> tuple[bool, str | None]:
    import sys

    from trainmesh.run.launch import WORKER_IMAGE
    return WORKER_IMAGE in sys.modules, os.environ.get("TRAINMESH_TEST_ONLY")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_fork_from_the_worker_image_and_see_the_current_environment(monkeypatch):
    """Workers start from the fork server's imports (where the platform has one), and see the
    launching process's environment as it is at each launch, not as it was when the server
    started."""
    import multiprocessing

    from trainmesh.testing import run_distributed
    forked = "forkserver" in multiprocessing.get_all_start_methods()
    for value in ("first", "second"):
        monkeypatch.setenv("TRAINMESH_TEST_ONLY", value)
        assert run_distributed(_what_the_worker_sees, 2) == {0: (forked, value), 1: (forked, value)}


HUB_WORKERS = """
import sys
import transformers  # noqa: F401 - the caller has imported transformers
from trainmesh.testing import run_distributed
from trainmesh.run.launch import HF_PRELOAD
def seen():
    import sys
    return HF_PRELOAD in sys.modules
if __name__ == "__main__":
    print(sorted(run_distributed(seen, 2).items()))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hub_workers_start_with_transformers_imported(tmp_path):
    """A --model-dir run's fork server (and run_distributed's, where its caller imported
    transformers) imports transformers' model base once: its workers start with it."""
    import subprocess
    import sys
    pytest.importorskip("transformers")
    script = tmp_path / "hub_workers.py"     # a file: the workers unpickle its function
    script.write_text(HUB_WORKERS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[(0, True), (1, True)]", out.stdout
