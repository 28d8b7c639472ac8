"""Two "nodes" on this machine: two torchrun elastic agents meet through a c10d rendezvous on
loopback and train one dp=2 job that matches the single-process run."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest
from helpers import SMALL, assert_equivalent, one_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_agents_rendezvous_and_train(metrics_path, reference_run):
    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = "1"   # one intra-op thread per worker: two share this machine's cores
    metrics = metrics_path
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
         "--node-rank", str(i), "--local-addr", "127.0.0.1",
         "-m", "trainmesh", "train", *SMALL, "--dp", "2", "--metrics-out", str(metrics)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=200) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    import json
    multi = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert_equivalent(reference_run(one_process("adamw")), multi)
    summary = multi[-1]
    assert summary["world_size"] == 2
