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

Protocol (runs may overlap): the client writes one JSON line per run, ``{"argv", "env", "cwd",
"stdout", "stderr", "umask", "own_fork_server", "call", "hostname"}`` (``call``: a test's function
to run in place of ``trainmesh``, tests/elastic_run.py's agents; ``hostname``: the run, its fork
server and workers in a UTS namespace of their own under that name, tests/test_network.py's host
whose name resolves to a network address); the zygote answers ``{"pid"}`` once forked
(requests are answered in order) and ``{"pid", "code"}`` once that child ended. It waits on
its children without a thread: SIGCHLD wakes its loop (``signal.set_wakeup_fd``). Overlapping
runs share the fork server unless they ask for their own; a test that stops a fault-tolerant
launcher by a signal (which kills its fork server) gives it its own. An own fork server is the
launcher's child as a fresh launcher's is, forked from the run's process just before it becomes
the launcher (a fraction of a CPU-second, against about 5 for an interpreter importing the
worker image)."""
from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PRELOADED = ("torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing.errors",
             "trainmesh.cli.train", "trainmesh.cli.report", "trainmesh.cli.checkpoint",
             "trainmesh.cli.plan", "trainmesh.run.launch", "trainmesh.run.trainer", "trainmesh.testing")
"""What the children run, and what the worker image imports (own fork servers fork from here)."""


def serve() -> None:
    """The zygote's loop (its stdin: requests, its stdout: answers)."""
    import importlib.util

    from trainmesh.cli import main
    from trainmesh.core.compat import load_lazy_imports
    from trainmesh.run.launch import HF_PRELOAD, WORKER_IMAGE, run_exit_handlers
    for module in PRELOADED:                   # what the children run, imported once here
        importlib.import_module(module)
    load_lazy_imports()                        # as the worker image does (no thread starts)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                          # nothing but answers on the pipe
    hub = [HF_PRELOAD] if importlib.util.find_spec("transformers") is not None else []
    for module in hub:                     # a --model-dir launcher reads the model's config
        importlib.import_module(module)
    multiprocessing.set_forkserver_preload([WORKER_IMAGE, *hub])   # workers: see worker_start_method
    forkserver.ensure_running()            # the workers' fork server, shared by the children
    umask = os.umask(0o022)                # the fork server's (it keeps what it started with)
    os.umask(umask)
    woken, wake = os.pipe()                # SIGCHLD wakes the loop (no thread waits on children)
    for fd in (woken, wake):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: list[int] = []
    pending = b""
    while True:
        ready, _, _ = select.select([0, woken], [], [])
        if woken in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(woken, 4096):
                    pass
        for pid in list(running):          # the children that ended, in the order they started
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.remove(pid)
                answers.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:                      # the pytest process that started it is gone
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            forkserver.ensure_running()    # again if a child killed it (a stopped --fault-tolerant
            pid = os.fork()                # launcher kills its fork server: core.compat)
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(woken)
                os.close(wake)
                own = request.get("umask") not in (None, umask) or request.get("own_fork_server", False)
                _share_fork_server(own)
                _child(request, main, run_exit_handlers, own)
            running.append(pid)
            answers.write(json.dumps({"pid": pid}) + "\n")


def _share_fork_server(own: bool) -> None:
    """A child's launcher forks its workers from the zygote's fork server (already running:
    not its own child, so not to be waited for), a fault-tolerant run's replicas' agents too,
    except where ``own`` (a run with another file mode creation mask than the fork server's,
    whose workers inherit the launcher's mask; a run whose process tree must be a fresh
    launcher's, signalled or killed by a test), which gets its own (:func:`_fork_own_fork_server`)."""
    if own:
        server = forkserver._forkserver
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        tracker = resource_tracker._resource_tracker   # and a resource tracker of its own: what
        if tracker._fd is not None:                     # its processes leave is cleaned up (and
            os.close(tracker._fd)                       # said) on its stderr, not the zygote's
        tracker._fd = tracker._pid = None
    else:
        forkserver._forkserver.ensure_running = forkserver.ensure_running = lambda: None


def _fork_own_fork_server() -> None:
    """Start this run's own fork server now, as its launcher would (its child, in its process
    group, with its environment, file mask and output, importing the same modules, dying with
    it), but forked from this process instead of started as a fresh interpreter: torch and
    trainmesh are imported here already, and this process has no threads yet (it is not yet
    the launcher). The launcher then finds the server running and forks its workers from it."""
    from multiprocessing import util

    def fork_instead(path: str, args: list[str], passfds: tuple[int, ...]) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:                  # what spawnv_passfds' exec would leave: stdio and the passed fds
            keep = {0, 1, 2, *passfds}
            for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
                if fd not in keep:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            Path("/proc/self/comm").write_text("forkserver")   # as trainmesh.testing finds it
            exec(args[-1], {"__name__": "__mp_forkserver__"})   # python -c CMD's command
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException:   # noqa: BLE001 - as the interpreter would print it
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)

    spawn, util.spawnv_passfds = util.spawnv_passfds, fork_instead
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn


def _rename_host(name: str) -> None:
    """This process (and all it starts) in a UTS namespace of its own, its hostname ``name``."""
    import ctypes
    import socket
    if ctypes.CDLL(None, use_errno=True).unshare(0x04000000) != 0:   # CLONE_NEWUTS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS) failed")
    socket.sethostname(name)


def _child(request: dict, main, run_exit_handlers, own_fork_server: bool) -> None:
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
        if request.get("hostname"):                  # before its fork server: workers share it
            _rename_host(request["hostname"])
        if request.get("call"):                      # a test's function, "module:name"
            module, name = request["call"].split(":")
            main = getattr(importlib.import_module(module), name)   # imported before the fork server
        if own_fork_server:
            _fork_own_fork_server()
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
    """The client side, one per pytest process; its runs may overlap (one thread each)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
             "import launcher_zygote; launcher_zygote.serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.starting = threading.Lock()      # one request at a time: its answer is the next pid
        self.answered = threading.Condition()
        self.forked: list[int] = []           # pids answered, not yet taken by their request
        self.codes: dict[int, int] = {}       # exit codes of children that ended
        self.ended = False
        self.served = False
        """Whether it answered once (its first answer waits for its imports and fork server)."""
        threading.Thread(target=self._read, daemon=True, name="launcher-zygote-answers").start()

    def _read(self) -> None:
        """Every answer, as it comes: a pid (forked) for the request waiting, or a child's code."""
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.answered:
                if "code" in answer:
                    self.codes[answer["pid"]] = answer["code"]
                else:
                    self.forked.append(answer["pid"])
                self.answered.notify_all()
        with self.answered:
            self.ended = True
            self.answered.notify_all()

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path,
            timeout: float, umask: int | None = None) -> int | None:
        """The exit code of ``trainmesh ARGV`` (with file mode creation mask ``umask`` where one
        is given); None where the zygote is off or gone."""
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
              umask: int | None = None, own_fork_server: bool = False,
              call: str | None = None, hostname: str | None = None) -> Child | None:
        """``trainmesh ARGV`` started (``own_fork_server``: its workers forked by a fork server
        of its own, its process tree a fresh launcher's); with ``call`` ("module:function", a
        module of tests/), that function run with ARGV (its exit code: what it returns) in
        place of trainmesh's command line; with ``hostname``, run under that hostname (its UTS
        namespace: root only). None where the zygote is off or gone."""
        if os.environ.get("TRAINMESH_TEST_ZYGOTE") == "0" or self.proc.poll() is not None:
            return None
        with self.starting:
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd),
                                              "stdout": str(stdout), "stderr": str(stderr),
                                              "umask": umask, "own_fork_server": own_fork_server,
                                              "call": call, "hostname": hostname})
                                  + "\n")
            self.proc.stdin.flush()
            with self.answered:   # the first answer comes once the zygote has started too
                if not self.answered.wait_for(lambda: self.forked or self.ended,
                                              30 if self.served else STARTUP_S):
                    self.proc.kill()   # hung: its late answers would be taken for a later run's
                    raise TimeoutError("the launcher zygote did not answer")
                if not self.forked:
                    raise RuntimeError("the launcher zygote ended")
                pid = self.forked.pop(0)
            self.served = True
            return Child(self, pid, argv)

    def _code(self, pid: int, timeout: float) -> int:
        """Child ``pid``'s exit code, once it ended within ``timeout`` s (else TimeoutError)."""
        with self.answered:
            if not self.answered.wait_for(lambda: pid in self.codes or self.ended, timeout):
                raise TimeoutError
            if pid not in self.codes:
                raise RuntimeError("the launcher zygote ended")
            return self.codes.pop(pid)


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
                self.returncode = self.zygote._code(self.pid, timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(["trainmesh", *self.argv], timeout) from None
        return self.returncode


_ZYGOTE: dict[int, Zygote] = {}


def zygote() -> Zygote:
    """This process's zygote (started on first use, from any thread: it ends when this process
    does, its requests' pipe closed; not by a parent-death signal, which would end it with the
    thread that started it)."""
    if os.getpid() not in _ZYGOTE:
        _ZYGOTE[os.getpid()] = Zygote()
    return _ZYGOTE[os.getpid()]
