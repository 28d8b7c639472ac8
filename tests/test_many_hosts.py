"""Many hosts for real, on simulated hosts (network namespaces with their own addresses and
hostnames, whose names resolve to their LAN addresses): a local run listens on loopback only;
srun's environment alone makes one job across hosts, and so does torchrun, each equal to a local
``--dp 2`` run; a lost host ends the others in bounded time with one line naming the rank, its
host and the cause. Skipped (one line) where namespaces cannot be made."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import SMALL, steps, trainmesh_process
from simhosts import SimHost, SimHosts

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces")]
TRAIN = [sys.executable, "-m", "trainmesh", "train"]
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "TORCHELASTIC_", "GLOO_", "NCCL_", "TP_SOCKET"))
         and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT", "TRAINMESH_LAUNCHER_STORE")} | {"OMP_NUM_THREADS": "1"}
"""A clean environment; one thread per rank on every launcher (the same sums in the same order)."""
LONG = [a if a != "20" else "400" for a in SMALL]   # SMALL, 400 steps: still running when a host goes
WAIT_S = 150


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _same_run(local: list[dict], other: list[dict]) -> None:
    """Per step the same loss and gradient norm (dp 2 either way: the same sums in the same order)."""
    a, b = steps(local), steps(other)
    assert len(a) == len(b) == 20, (len(a), len(b))
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]


def _watch(procs, hosts: list[SimHost], timeout: float = WAIT_S) -> set[tuple[str, str, int]]:
    """Wait for ``procs``; meanwhile record every listening socket in the hosts' namespaces as
    (host name, address, port)."""
    seen: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for h in hosts:
            seen |= {(h.name, a, port) for a, port in h.listening()}
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return seen


def srun_env(host: int, hosts: list[SimHost], job: int) -> dict[str, str]:
    """What srun gives task ``host`` of a step with one task on each of ``hosts``."""
    n = len(hosts)
    return {**CLEAN, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(host),
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(host), "SLURM_NTASKS": str(n),
            "SLURM_STEP_NUM_TASKS": str(n), "SLURM_STEP_NUM_NODES": str(n),
            "SLURM_STEP_NODELIST": f"tmh[0-{n - 1}]", "SLURM_NODELIST": f"tmh[0-{n - 1}]",
            "SLURM_STEP_TASKS_PER_NODE": f"1(x{n})", "SLURM_NTASKS_PER_NODE": "1"}


@pytest.fixture(scope="module")
def local_dp2(tmp_path_factory):
    """A local ``trainmesh train --dp 2`` on a simulated host whose hostname resolves to its LAN
    address: (its metrics records, every socket listening in the host's namespace meanwhile)."""
    out = tmp_path_factory.mktemp("local") / "m.jsonl"
    with SimHosts(1) as hosts:
        h = hosts[0]
        resolved = h.run(["getent", "hosts", h.name], capture_output=True, text=True).stdout
        assert h.addr in resolved, resolved        # the premise: the hostname is the LAN address
        proc = h.popen([*TRAIN, *SMALL, "--dp", "2", "--metrics-out", str(out)], env=CLEAN,
                       stdout=open(os.devnull, "w"), stderr=open(out.with_suffix(".err"), "w"))
        sockets = _watch([proc], hosts)
    assert proc.returncode == 0, out.with_suffix(".err").read_text()[-3000:]
    return _records(out), sockets


def test_a_local_run_on_a_lan_named_host_listens_on_loopback_only(local_dp2):
    records, sockets = local_dp2
    assert len(steps(records)) == 20
    assert sockets, "no listening socket seen while the run ran"
    exposed = sorted((a, p) for _, a, p in sockets if not ipaddress.ip_address(a).is_loopback)
    assert not exposed, f"a local run listens beyond loopback: {exposed}"


@pytest.fixture(scope="module")
def slurm_jobs(tmp_path_factory):
    """Slurm on two simulated hosts (None where slurm-wlm is not installed): ``srun -N2
    --ntasks-per-node=1 trainmesh train`` watched as :func:`srun_by_hand` watches its tasks, then
    the script of ``trainmesh launch slurm --nodes 2`` submitted with ``sbatch --wait``."""
    from simslurm import SLURM_PORTS, SimSlurm, missing_slurm
    if missing_slurm():
        return None
    tmp = tmp_path_factory.mktemp("slurm")
    with SimHosts(2) as hosts, SimSlurm(hosts) as slurm:
        out = tmp / "srun.jsonl"
        proc = slurm.popen(0, ["srun", "-N2", "--ntasks-per-node=1", *TRAIN, *SMALL, "--metrics-out",
                               str(out)], env=CLEAN, cwd=str(tmp), stdout=open(os.devnull, "w"),
                           stderr=open(tmp / "srun.err", "w"))
        sockets = {s for s in _watch([proc], hosts) if s[2] not in SLURM_PORTS}   # trainmesh's
        srun = {"codes": [proc.returncode], "errors": [(tmp / "srun.err").read_text()[-3000:]],
                "records": _records(out), "sockets": sockets,
                "addr": {h.name: h.addr for h in hosts}}
        script = tmp / "job.sbatch"
        made = trainmesh_process(["launch", "slurm", "--nodes", "2", "--", *SMALL, "--metrics-out",
                                  str(tmp / "sbatch.jsonl")], tmp, env=CLEAN, timeout=60)
        ran = None
        if made.returncode == 0:
            script.write_text(made.stdout)
            ran = slurm.run(0, ["sbatch", "--wait", "-o", str(tmp / "job.out"), str(script)],
                            env=CLEAN, cwd=str(tmp), timeout=WAIT_S)
        job_out = (tmp / "job.out").read_text()[-3000:] if (tmp / "job.out").exists() else ""
    return {"srun": srun, "made": made, "sbatch": ran, "job_out": job_out,
            "sbatch_records": _records(tmp / "sbatch.jsonl")}


def srun_by_hand(tmp_path: Path) -> dict:
    """Two hosts, one ``trainmesh train`` each with srun's variables written here (no srun):
    exit codes, stderr tails, the metrics records, every socket listening in the hosts meanwhile
    and each host's address."""
    out = tmp_path / "m.jsonl"
    with SimHosts(2) as hosts:
        job = int(uuid.uuid4().int % 100000)
        procs = [h.popen([*TRAIN, *SMALL, "--metrics-out", str(out)], env=srun_env(i, hosts, job),
                         stdout=open(os.devnull, "w"), stderr=open(tmp_path / f"{i}.err", "w"))
                 for i, h in enumerate(hosts)]
        sockets = _watch(procs, hosts)
        addr = {h.name: h.addr for h in hosts}
    return {"codes": [p.returncode for p in procs],
            "errors": [(tmp_path / f"{i}.err").read_text()[-2000:] for i in range(2)],
            "records": _records(out), "sockets": sockets, "addr": addr}


def test_srun_environment_across_hosts_is_one_job(local_dp2, slurm_jobs, tmp_path):
    """Two hosts, one task each, nothing but srun's variables (no MASTER_ADDR): one job of world
    2, equal to the local dp 2 run; trainmesh's sockets listen on each host's LAN address only.
    The tasks are those of a real ``srun`` where Slurm is installed (the job of
    :func:`slurm_jobs`, which the Slurm test checks too), else started here with srun's
    variables written by hand."""
    run = slurm_jobs["srun"] if slurm_jobs else srun_by_hand(tmp_path)
    assert run["codes"] == [0] * len(run["codes"]), run["errors"]
    records, addr = run["records"], run["addr"]
    assert records[-1]["event"] == "summary" and records[-1]["world_size"] == 2
    assert len(steps(records)) == 20, "two jobs wrote into one metrics file"
    _same_run(local_dp2[0], records)
    assert run["sockets"], "no listening socket seen while the job ran"
    elsewhere = sorted((n, a, p) for n, a, p in run["sockets"] if a != addr[n])
    assert not elsewhere, f"listening beyond the interface that reaches the master: {elsewhere}"


def test_torchrun_across_hosts_equals_the_local_run(local_dp2, tmp_path):
    """One torchrun agent per host, c10d rendezvous on the first: one job, equal to local dp 2."""
    out = tmp_path / "m.jsonl"
    with SimHosts(2) as hosts:
        endpoint, run_id = f"{hosts[0].addr}:29400", uuid.uuid4().hex[:8]
        procs = [h.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                          "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          endpoint, "--rdzv-id", run_id,
                          "--node-rank", str(i), "-m", "trainmesh", "train", *SMALL,
                          "--metrics-out", str(out)], env=CLEAN, stdout=open(os.devnull, "w"),
                         stderr=open(tmp_path / f"{i}.err", "w"))
                 for i, h in enumerate(hosts)]
        _watch(procs, hosts)
    errors = [(tmp_path / f"{i}.err").read_text()[-2000:] for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], errors
    _same_run(local_dp2[0], _records(out))


def _lose_host_1(procs, hosts: list[SimHost], out: Path) -> float:
    """Kill every process of host 1 once the run is under way; seconds the others then take."""
    deadline = time.monotonic() + WAIT_S
    while len(steps(_records(out))) < 3:
        assert all(p.poll() is None for p in procs), "the run ended before a host was lost"
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.2)
    hosts[1].kill_all()
    lost = time.monotonic()
    _watch(procs[:1], hosts[:1], timeout=90)
    return time.monotonic() - lost


def _one_line(err: str, *, host: str) -> None:
    """trainmesh's report: exactly one line, naming rank 1 on ``host`` as the cause; no
    traceback of trainmesh's."""
    ours = [line for line in err.splitlines() if line.startswith("trainmesh train:")]
    assert len(ours) == 1, err[-3000:]
    assert re.search(rf"rank 1 on {host}\b.*stopped answering", ours[0]), ours[0]
    assert "rank 0 on tmh0" in ours[0], ours[0]
    assert "/trainmesh/" not in err, f"a traceback of trainmesh's reached the console: {err[-3000:]}"


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_a_lost_host_ends_the_job_with_one_line(launcher, tmp_path):
    out = tmp_path / "m.jsonl"
    with SimHosts(2) as hosts:
        if launcher == "srun":
            job = int(uuid.uuid4().int % 100000)
            argv = [[*TRAIN, *LONG, "--metrics-out", str(out)]] * 2
            envs = [srun_env(i, hosts, job) for i in range(2)]
        else:
            run_id = uuid.uuid4().hex[:8]
            argv = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                     "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].addr}:29400",
                     "--rdzv-id", run_id, "--node-rank", str(i), "-m", "trainmesh", "train", *LONG,
                     "--metrics-out", str(out)] for i in range(2)]
            envs = [CLEAN, CLEAN]
        procs = [h.popen(argv[i], env=envs[i], stdout=open(os.devnull, "w"),
                         stderr=open(tmp_path / f"{i}.err", "w")) for i, h in enumerate(hosts)]
        took = _lose_host_1(procs, hosts, out)
        left = hosts[0].pids()
    assert procs[0].returncode not in (0, None), procs[0].returncode
    assert took < 60, f"host 0 took {took:.0f} s to end after host 1 was lost"
    assert not left, f"processes left on host 0: {left}"
    _one_line((tmp_path / "0.err").read_text(), host="tmh1")


def test_a_real_slurm_runs_srun_and_the_launch_script_as_one_job(local_dp2, slurm_jobs):
    """Slurm on two simulated hosts (skipped where slurm-wlm is not installed): `srun -N2
    --ntasks-per-node=1 trainmesh train` and the script of `trainmesh launch slurm --nodes 2`,
    submitted with sbatch to a cluster without GPUs, each train one job of world 2 equal to the
    local dp 2 run."""
    from simslurm import missing_slurm
    if slurm_jobs is None:
        pytest.skip(missing_slurm())
    srun = slurm_jobs["srun"]
    assert srun["codes"] == [0], srun["errors"]
    assert srun["records"][-1]["world_size"] == 2
    _same_run(local_dp2[0], srun["records"])
    made, ran = slurm_jobs["made"], slurm_jobs["sbatch"]
    assert made.returncode == 0, made.stderr
    assert ran.returncode == 0, (ran.stderr, slurm_jobs["job_out"])
    records = slurm_jobs["sbatch_records"]
    assert records[-1]["world_size"] == 2
    _same_run(local_dp2[0], records)
