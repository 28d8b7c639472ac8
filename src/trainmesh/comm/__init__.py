"""Communication: one layer (:class:`Comm`) through which every byte goes, and its ledger.

Imports core only.
"""
from .ledger import Ledger, OpStats
from .ops import Comm, Handle, ReduceOp, nbytes

__all__ = ["Comm", "Handle", "Ledger", "OpStats", "ReduceOp", "nbytes"]
