"""A real Slurm cluster on simulated hosts (:mod:`simhosts`), for multi-host tests.

    with SimHosts(2) as hosts, SimSlurm(hosts) as slurm:   # pytest.skip where Slurm is missing
        slurm.run(0, ["srun", "-N2", "--ntasks-per-node=1", "hostname"])
        slurm.run(0, ["sbatch", "--wait", "job.sbatch"])

One ``munged`` (its socket a file, which every namespace reaches), ``slurmctld`` on host 0 and a
``slurmd`` on every host, each under the host's name; CPU-only nodes, no accounting. Their
configuration, keys, state and logs live in one fresh directory; on exit every daemon started
here (and each job step it forked, found in the hosts' namespaces) is killed and the directory
removed. Slurm 22.05's slurmd wants a cgroup hierarchy even with ``proctrack/linuxproc``: each
slurmd gets a private tmpfs one (``ip netns exec`` gives every command its own mount
namespace). ``MinJobAge=4``: ``sbatch --wait`` polls the job every 2 s (with Slurm's default of
300 its polls back off to 2, 10 and 42 s after submission, most of a short job's wait idle).
Install with ``apt-get install slurm-wlm munge``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from simhosts import SimHost

SLURM_PORTS = frozenset({6817, 6818, *range(61000, 61201)})
"""Every port Slurm listens on here (slurmctld's, slurmd's and srun's range, as configured
below): apart from the kernel's ephemeral ports (32768-60999) and trainmesh's derived ones
(20000-29999), so what listens elsewhere is not Slurm's."""
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
CGROUP = ("mount -t tmpfs cgfs /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/systemd && "
          "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd")
CONF = """ClusterName=tmsim
SlurmctldHost={ctl}({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=4
SlurmctldPort=6817
SlurmdPort=6818
SrunPortRange=61000-61200
{nodes}
PartitionName=sim Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


def missing_slurm() -> str | None:
    """Why a Slurm cluster cannot be started here (None: it can)."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    return f"Slurm is not installed ({', '.join(absent)} missing: apt-get install slurm-wlm munge)" \
        if absent else None


class SimSlurm:
    """Slurm on ``hosts`` (module docstring); ``cpus`` per node."""

    def __init__(self, hosts: list[SimHost], cpus: int = 2) -> None:
        self.hosts = hosts
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="tmslurm-"))
        self.conf = self.dir / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client command (srun, sbatch) on these hosts."""
        keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**keep, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SimSlurm:
        why = missing_slurm()
        if why:
            shutil.rmtree(self.dir, ignore_errors=True)
            pytest.skip(why)
        try:
            self._start()
        except Exception:
            self.close()
            raise
        return self

    def _daemon(self, host: SimHost, script: str, name: str) -> None:
        log = open(self.dir / f"{name}.out", "w")
        self.daemons.append(host.popen(["sh", "-c", script], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, env=self.env))
        log.close()

    def _start(self) -> None:
        ctl = self.hosts[0]
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} NodeHostname={h.name} "
                          f"CPUs={self.cpus} State=UNKNOWN" for h in self.hosts)
        self.conf.write_text(CONF.format(ctl=ctl.name, ctl_addr=ctl.addr, dir=self.dir, nodes=nodes,
                                         names=",".join(h.name for h in self.hosts)))
        (self.dir / "ctld").mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.dir.chmod(0o700)
        d = self.dir
        self._daemon(ctl, f"exec munged -F --force --key-file={key} --socket={d}/munge.socket "
                          f"--pid-file={d}/munged.pid --seed-file={d}/munge.seed "
                          f"--log-file={d}/munged.log", "munged")
        self._wait(lambda: (d / "munge.socket").exists(), "munged's socket")
        self._daemon(ctl, f"exec slurmctld -D -f {self.conf}", "slurmctld")
        for h in self.hosts:
            self._daemon(h, f"{CGROUP} && exec slurmd -D -N {h.name} -f {self.conf}", f"slurmd-{h.name}")
        self._wait(self._all_idle, "every node idle in sinfo")

    def _all_idle(self) -> bool:
        out = self.run(0, ["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(h.name) == "idle" for h in self.hosts)

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (subprocess.TimeoutExpired, ValueError):
                pass
            for p in self.daemons:
                if p.poll() is not None:
                    break
            time.sleep(0.5)
        logs = "; ".join(f"{p.name}: {p.read_text()[-400:]}" for p in self.dir.glob("*.out"))
        raise RuntimeError(f"Slurm did not come up ({what}): {logs}")

    def run(self, host: int, argv: list[str], *, timeout: float = 120,
            env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command on host ``host`` (output captured as text)."""
        return self.hosts[host].run(argv, env={**self.env, **(env or {})}, timeout=timeout,
                                    capture_output=True, text=True, cwd=cwd)

    def popen(self, host: int, argv: list[str], *, env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """A Slurm client command started on host ``host``."""
        return self.hosts[host].popen(argv, env={**self.env, **(env or {})}, **kwargs)

    def close(self) -> None:
        """Stop every daemon started here, then each job step they forked (still in the hosts'
        namespaces), then remove the directory."""
        for p in reversed(self.daemons):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.daemons:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for h in self.hosts:
            h.kill_all()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()
