"""The local launcher gives its workers their environment (its store, OpenMP threads,
unbuffered output) through the elastic launcher's entry-point arguments, never by writing its
own os.environ."""
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
    assert env == {STORE_ENV: rendezvous["rdzv_endpoint"], "PYTHONUNBUFFERED": "1"}
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
