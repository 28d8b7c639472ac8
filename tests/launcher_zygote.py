"""``trainmesh ARGS`` as a process forked from one that has imported trainmesh already.

The suite runs ``trainmesh train`` a few hundred times; a fresh interpreter spends about
4 CPU-seconds importing torch and trainmesh before it parses a flag. Each pytest process keeps
one zygote: a process that imported the command line once and then forks a child per run. The
child is a launcher like any other (``trainmesh.cli.main``): it parses, validates, starts its
workers, writes its output into the run's files and exits with the command's code. The workers
come from one fork server the zygote started (the workers' image imported once, not once per
run): the launcher hands them its environment and its output (``trainmesh.run.launch.worker_env``,
``Stdio``), as to any fork server started before it. What is shared is interpreters' start-up;
the zygote holds no threads, sockets or process groups when it forks.

``TRAINMESH_TEST_ZYGOTE=0`` starts every run as a fresh process instead.

Protocol (one run at a time; a second caller while one runs starts a plain process instead):
the client writes one JSON line ``{"argv", "env", "cwd", "stdout", "stderr"}``; the zygote
answers ``{"pid"}`` once forked and ``{"code"}`` once the child ended."""
from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
from multiprocessing import forkserver
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PRELOADED = ("torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing.errors",
             "trainmesh.cli.train", "trainmesh.cli.report", "trainmesh.cli.checkpoint",
             "trainmesh.cli.plan", "trainmesh.run.launch", "trainmesh.run.trainer")


def serve() -> None:
    """The zygote's loop (its stdin: requests, its stdout: answers)."""
    import importlib
    import importlib.util

    from trainmesh.cli import main
    from trainmesh.run.launch import kill_with_parent, run_exit_handlers
    from trainmesh.run.launch import HF_PRELOAD, WORKER_IMAGE
    for module in PRELOADED:                   # what the children run, imported once here
        importlib.import_module(module)
    kill_with_parent()                     # ends with the pytest process that started it
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                          # nothing but answers on the pipe
    hub = [HF_PRELOAD] if importlib.util.find_spec("transformers") is not None else []
    for module in hub:                     # a --model-dir launcher reads the model's config
        importlib.import_module(module)
    multiprocessing.set_forkserver_preload([WORKER_IMAGE, *hub])   # workers: see worker_start_method
    forkserver.ensure_running()            # the workers' fork server, shared by the children
    umask = os.umask(0o022)                # the fork server's (it keeps what it started with)
    os.umask(umask)
    for line in sys.stdin:
        request = json.loads(line)
        forkserver.ensure_running()        # again if a child killed it (a stopped --fault-tolerant
        pid = os.fork()                    # launcher kills its fork server: core.compat)
        if pid == 0:
            _share_fork_server(request.get("umask") not in (None, umask)
                               or request.get("own_fork_server", False))
            _child(request, main, run_exit_handlers)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")


def _share_fork_server(own: bool) -> None:
    """A child's launcher forks its workers from the zygote's fork server (already running:
    not its own child, so not to be waited for), a fault-tolerant run's replicas' agents too,
    except where ``own`` (a run with another file mode creation mask than the fork server's,
    whose workers inherit the launcher's mask; a run whose process tree must be a fresh
    launcher's, signalled or killed by a test), which starts its own as any launcher does."""
    if own:
        server = forkserver._forkserver
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
    else:
        forkserver._forkserver.ensure_running = forkserver.ensure_running = lambda: None


def _child(request: dict, main, run_exit_handlers) -> None:
    code = 1
    try:
        os.setpgrp()                                 # its group: a timeout ends all it started
        os.chdir(request["cwd"])
        if request.get("umask") is not None:
            os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(os.devnull) as null:
            os.dup2(null.fileno(), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            with open(path, "w") as out:
                os.dup2(out.fileno(), fd)
        sys.argv = ["trainmesh", *request["argv"]]
        try:
            code = main(request["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        run_exit_handlers()
    except BaseException:   # noqa: BLE001 - a crash of the command is its own output
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


STARTUP_S = 300.0
"""How long the answer to a request may take to come: the first one comes once the zygote has
imported torch and trainmesh and started its fork server (over 30 s on a loaded 2-core machine);
later ones at once."""


class Zygote:
    """The client side, one per pytest process."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
             "import launcher_zygote; launcher_zygote.serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.lock = threading.Lock()
        self.pending = b""
        self.served = False
        """Whether it answered once (its first answer waits for its imports and fork server)."""

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path,
            timeout: float, umask: int | None = None) -> int | None:
        """The exit code of ``trainmesh ARGV`` (with file mode creation mask ``umask`` where one
        is given); None where the zygote is busy or gone."""
        child = self.start(argv, env, cwd, stdout, stderr, umask=umask)
        if child is None:
            return None
        try:
            return child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)
            raise

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path,
              umask: int | None = None, own_fork_server: bool = False) -> Child | None:
        """``trainmesh ARGV`` started (``own_fork_server``: its workers forked by a fork server
        of its own, its process tree a fresh launcher's); None where the zygote is busy or gone.
        The zygote serves no one else until the child's exit code was read (``Child.wait``)."""
        if (os.environ.get("TRAINMESH_TEST_ZYGOTE") == "0" or self.proc.poll() is not None
                or not self.lock.acquire(blocking=False)):
            return None
        try:
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd),
                                              "stdout": str(stdout), "stderr": str(stderr),
                                              "umask": umask, "own_fork_server": own_fork_server})
                                  + "\n")
            try:
                pid = self._answer(30 if self.served else STARTUP_S)["pid"]   # the first: it starts too
            except TimeoutError:
                self.proc.kill()   # hung: its late answers would be taken for a later run's
                raise
            self.served = True
            return Child(self, pid, argv)
        except BaseException:
            self.lock.release()
            raise

    def _answer(self, timeout: float) -> dict:
        """The next line of answer (read from the pipe unbuffered, so select sees all of it)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the launcher zygote ended")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


class Child:
    """A ``trainmesh`` process the zygote forked (its own process group: ``pid``)."""

    def __init__(self, zygote: Zygote, pid: int, argv: list[str]) -> None:
        self.zygote, self.pid, self.argv = zygote, pid, argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code, None while it runs."""
        if self.returncode is None:
            try:
                self.wait(0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Its exit code, once it ended within ``timeout`` seconds (else TimeoutExpired)."""
        if self.returncode is None:
            try:
                self.returncode = self.zygote._answer(timeout)["code"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(["trainmesh", *self.argv], timeout) from None
            self.zygote.lock.release()
        return self.returncode


_ZYGOTE: dict[int, Zygote] = {}


def zygote() -> Zygote:
    """This process's zygote (started on first use; from the main thread: the zygote dies with
    the thread that started it, by the parent-death signal)."""
    if os.getpid() not in _ZYGOTE:
        _ZYGOTE[os.getpid()] = Zygote()
    return _ZYGOTE[os.getpid()]
