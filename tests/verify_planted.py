"""A tensor-parallel layer with a planted bug, for tests/test_verify.py only.

Importing this module replaces the backward of tensor parallelism's f operator (forward
identity, backward all-reduce over tp: what enters every column-parallel layer) by the identity,
so each TP rank keeps only its own partial input gradient: the gradients of everything before a
column-parallel layer (embeddings, norms) are wrong under --tp > 1, the forward (and so step 1's
loss) unchanged. One process never calls it (a group of one is the identity).

A run gets it by importing this module before its workers' fork server starts: the test zygote
imports a request's ``call`` module first (:func:`main` runs ``trainmesh``); a fresh interpreter
adds it to the fork server's preloaded modules (:func:`preload`), with tests/ on PYTHONPATH.
"""
from __future__ import annotations

import multiprocessing
import sys

from trainmesh.tensor_parallel import mappings


def _partial_gradient(ctx, grad):   # the bug: no all-reduce of the partial input gradients
    return grad, None, None


mappings._CopyToRegion.backward = staticmethod(_partial_gradient)


def preload() -> None:
    """Workers forked by a fork server started later import this module first."""
    set_preload = multiprocessing.set_forkserver_preload

    def with_this(modules: list[str]) -> None:
        set_preload([*modules, __name__])

    multiprocessing.set_forkserver_preload = with_this


def main(argv: list[str]) -> int:
    """``trainmesh ARGV`` with the bug planted in this process and its workers."""
    from trainmesh.cli import main as trainmesh
    preload()
    return trainmesh(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
