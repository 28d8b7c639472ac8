"""``trainmesh coordinator --bind HOST:PORT --replicas R``: the quorum service of a
``--fault-tolerant`` run across hosts, on its own (docs/FAULT_TOLERANCE.md).

It listens on the ``--bind`` address only, decides every step's quorum and commit for the
replicas that ``trainmesh train --fault-tolerant --coordinator HOST:PORT --replica-id I
--replicas R`` starts on each host, and ends (exit 0) once the last step is committed and the
replicas have left. It keeps nothing on disk: started again after a crash (on the same address,
or another one the replicas list), it rebuilds its state from the replicas and the run goes on.
It hears only the job's members: records sealed with the job's secret (``TRAINMESH_FT_SECRET``
or ``--secret-file``, the same as every replica's).
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, NoReturn

from trainmesh.core.errors import ConfigError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``coordinator`` sub-command."""
    from . import add_version
    parser = subparsers.add_parser(
        "coordinator", help="the quorum service of a fault-tolerant run across hosts",
        description="The quorum service of a --fault-tolerant run across hosts. It listens on "
                    "the --bind address only, decides every step's quorum and commit for the "
                    "replicas that `trainmesh train --fault-tolerant --coordinator HOST:PORT "
                    "--replica-id I --replicas R` starts on each host, and ends (exit 0) once the "
                    "last step is committed and the replicas have left. It keeps nothing on disk: "
                    "started again after a crash (on the same address, or another one the "
                    "replicas list), it rebuilds its state from the replicas and the run goes on. "
                    "It hears only the job's members: records sealed with the job's secret "
                    "(TRAINMESH_FT_SECRET or --secret-file, the same as every replica's).")
    parser.add_argument("--bind", required=True, metavar="HOST:PORT",
                        help="the address to listen on (this host's address the replicas reach; "
                             "port 0: one the kernel picks, printed)")
    parser.add_argument("--replicas", required=True, type=int, metavar="R",
                        help="the run's replicas (the --replicas of every `trainmesh train`)")
    parser.add_argument("--secret-file", metavar="PATH", default=None,
                        help="a file (mode 0600) holding the job's secret, the replicas' too "
                             "(default: the TRAINMESH_FT_SECRET environment variable; one of "
                             "the two is needed)")
    add_version(parser)
    parser.set_defaults(run=run)
    return parser


def _address(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError("--bind", f"must be HOST:PORT (e.g. 10.0.0.1:29400); got {bind!r}")
    return host.strip("[]"), int(port)


def run(args: argparse.Namespace) -> int:
    host, port = _address(args.bind)
    if args.replicas < 2:
        raise ConfigError("--replicas", f"needs at least 2 replicas that can stand in for each "
                          f"other; got {args.replicas}")
    from trainmesh.fault_tolerance.auth import load_secret
    from trainmesh.fault_tolerance.coordinator import Coordinator
    secret = load_secret(args.secret_file)   # none: exit 2 saying how to give one

    def stop(signum: int, _frame: Any) -> NoReturn:
        sys.stderr.write(f"trainmesh coordinator: stopped by {signal.Signals(signum).name}\n")
        raise SystemExit(128 + signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        coordinator = Coordinator(replicas=args.replicas, secret=secret, host=host, port=port,
                                  notify=lambda line: print(line, file=sys.stderr, flush=True))
    except (RuntimeError, OSError) as exc:
        raise ConfigError("--bind", f"cannot listen on {args.bind}: {exc}") from None
    print(f"trainmesh coordinator: serving {coordinator.address} for {args.replicas} replicas",
          flush=True)
    coordinator.serve()
    if coordinator.error:
        sys.stderr.write(f"trainmesh coordinator: {coordinator.error}\n")
        return 1
    coordinator.linger()
    print(f"trainmesh coordinator: the run reached its last step ({coordinator.committed})",
          flush=True)
    return 0
