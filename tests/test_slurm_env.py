"""srun's environment alone describes the job (rank, size, local ranks, where to meet); the
backends' interfaces; the process group's orderly end at exit."""
from __future__ import annotations

import subprocess
import sys

import pytest

from trainmesh.core.distributed import is_local, launcher_job
from trainmesh.core.interfaces import backend_interface, bind_backends, interface_of, loopback_interface
from trainmesh.core.slurm import derived_port, expand_counts, expand_hostlist, slurm_task

TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NODELIST": "gpu[07-08],cpu[1,3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),3,1"}
"""Task 5 of an 8-task step on four nodes (2, 2, 3 and 1 tasks), the second on its node."""


@pytest.mark.parametrize("spec, hosts", [
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("a1,b[01-02]", ["a1", "b01", "b02"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("r[1-2]n[1-2],login", ["r1n1", "r1n2", "r2n1", "r2n2", "login"]),
    ("tmh0", ["tmh0"]),
])
def test_hostlists_expand_as_scontrol_does(spec, hosts):
    assert expand_hostlist(spec) == hosts


def test_bad_hostlists_and_counts_raise():
    for spec in ("a[1-2", "a1-2]", "a[3-1]"):
        with pytest.raises(ValueError):
            expand_hostlist(spec)
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        expand_counts("2(3)")


def test_an_srun_task_is_a_rank_of_the_step_meeting_on_its_first_host():
    task = slurm_task(TASK)
    assert (task.rank, task.world, task.local_rank, task.local_world) == (5, 8, 1, 3)
    assert task.master_addr == "gpu07"
    job = launcher_job(TASK)
    assert (job.rank, job.world, job.local_rank, job.local_world) == (5, 8, 1, 3)
    assert job.master == ("gpu07", derived_port(4242, 3))
    for other in range(8):   # every task of the step computes the same address
        assert launcher_job({**TASK, "SLURM_PROCID": str(other)}).master == job.master
    assert not is_local(job)


def test_a_step_on_part_of_the_allocation_meets_on_the_steps_first_node():
    """``srun -w`` or ``--relative``: the step runs on gpu08 and cpu1 of a four-node job; its
    tasks meet on gpu08 (the step's first node), not on gpu07 where no task of the step runs."""
    part = {**TASK, "SLURM_JOB_NODELIST": "gpu[07-08],cpu[1,3]", "SLURM_NODELIST": "gpu[07-08],cpu[1,3]",
            "SLURM_STEP_NODELIST": "gpu08,cpu1", "SLURM_STEP_TASKS_PER_NODE": "2,1",
            "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_NODEID": "1",
            "SLURM_LOCALID": "0"}
    task = slurm_task(part)
    assert task.nodes == ("gpu08", "cpu1")
    assert (task.rank, task.world, task.local_rank, task.local_world) == (2, 3, 0, 1)
    assert launcher_job(part).master == ("gpu08", derived_port(4242, 3))


def test_ports_differ_between_steps_and_jobs_and_avoid_the_ephemeral_range():
    ports = {derived_port(job, step) for job in range(1000, 1200) for step in range(4)}
    assert len(ports) == 800
    assert all(1024 < p < 32768 for p in ports)


def test_given_master_address_and_port_win():
    job = launcher_job({**TASK, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"})
    assert job.master == ("10.0.0.9", 1234)


def test_a_batch_script_or_salloc_shell_is_no_task():
    """sbatch's script has SLURM_PROCID=0 but no step: a `trainmesh train` there launches locally."""
    batch = {k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP")}
    assert slurm_task(batch) is None and launcher_job(batch) is None
    assert launcher_job({**TASK, "SLURM_STEP_ID": "batch"}) is None


def test_one_node_steps_are_local_and_torchrun_comes_first():
    one = {**TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
           "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "n1"}
    assert is_local(launcher_job(one))
    torchrun = launcher_job({**TASK, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                             "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (torchrun.rank, torchrun.world, torchrun.master) == (0, 2, ("h", 5))


def test_the_backends_listen_on_loopback_locally_and_towards_the_master_otherwise():
    lo = loopback_interface()
    assert lo is not None
    assert backend_interface(local=True, master="192.0.2.1") == lo
    assert backend_interface(local=False, master="127.0.0.1") == lo   # agents on one machine
    assert interface_of("127.0.0.1") == lo
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert bind_backends("eth7", env) == {"GLOO_SOCKET_IFNAME": "eth7", "TP_SOCKET_IFNAME": "eth7"}
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"   # the user's choice stays


EXIT_ORDER = """
import atexit, sys
import torch, torch.distributed as dist
import trainmesh as tm
atexit.register(lambda: print("at exit, group alive:", dist.is_initialized(), flush=True))
tm.init_distributed(device="cpu")          # registered after the line above: runs before it
t = torch.ones(4)
dist.all_reduce(t, async_op=True).wait()
if sys.argv[1] == "raise":
    raise SystemExit("failed")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_process_group_is_shut_down_in_order_at_exit():
    """A script that never calls tm.shutdown(): by the time later exit handlers and the
    interpreter's teardown run, the group is gone (gloo's threads joined while Python is whole)."""
    for how in ("end", "raise"):
        run = subprocess.run([sys.executable, "-c", EXIT_ORDER, how], capture_output=True, text=True,
                             timeout=100)
        assert "at exit, group alive: False" in run.stdout, (how, run.stdout, run.stderr[-2000:])
        assert run.returncode == (0 if how == "end" else 1), (how, run.stderr[-2000:])
