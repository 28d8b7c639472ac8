"""Two "nodes" on this machine: two of torchrun's elastic agents, configured from torchrun's
flags, meet through a c10d rendezvous on loopback and train one dp=2 job that matches the
single-process run. The agents fork from the test zygote and their workers from a server of
each agent's own (tests/elastic_run.py); torchrun's own command, its workers fresh
interpreters, runs in tests/test_first_hour.py and across simulated hosts in
tests/test_many_hosts.py."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid

import pytest
from elastic_run import kill_tree, start_agent
from helpers import SMALL, assert_equivalent, one_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_agents_rendezvous_and_train(metrics_path, reference_run, tmp_path):
    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = "1"   # one intra-op thread per worker: two share this machine's cores
    go = tmp_path / "go"
    go.touch()
    nodes = [start_agent(
        ["--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
         "--node-rank", str(i), "--local-addr", "127.0.0.1",
         "-m", "trainmesh", "train", *SMALL, "--dp", "2", "--metrics-out", str(metrics_path)],
        go, tmp_path / f"node{i}", env) for i in range(2)]
    try:
        codes = [p.wait(timeout=200) for p in nodes]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in nodes]
    finally:
        for p in nodes:
            kill_tree(p)
    for i, code in enumerate(codes):
        assert code == 0, (tmp_path / f"node{i}.err").read_text()[-3000:]
    multi = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert_equivalent(reference_run(one_process("adamw")), multi)
    summary = multi[-1]
    assert summary["world_size"] == 2
