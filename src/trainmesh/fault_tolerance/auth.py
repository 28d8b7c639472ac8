"""The per-job secret of a ``--fault-tolerant`` run and the authenticator of its records.

Anyone who reaches the coordinator's store can write into it (a c10d ``TCPStore`` has no access
control), so every record the coordinator and the replicas write carries an HMAC-SHA256 of the
key it is written under and its payload (:func:`authenticator`), from a secret only the job's
members hold: ``TRAINMESH_FT_SECRET`` in their environment, or a file of mode 0600 given with
``--secret-file``. A run on one host makes its own (:func:`new_secret`) and hands it to its
coordinator and workers through their environment.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainmesh.core.errors import ConfigError

PROTOCOL_VERSION = 2
"""The version of the records (their envelope and their fields); a member of another version
is refused, naming both. The authenticator is computed alike in every version."""
COORDINATOR_ID = -1
"""The ``by`` of the coordinator's records."""
MAX_INT = 2**53
SECRET_ENV = "TRAINMESH_FT_SECRET"
"""The environment variable holding the job's secret (coordinator and every replica)."""
MIN_SECRET = 16
"""The shortest secret taken, in characters (a random 32-byte hex string has 64)."""
HOW = (f"give the job's secret as {SECRET_ENV} in the environment (the same on the coordinator "
       "and every replica; e.g. `export TRAINMESH_FT_SECRET=$(python -c 'import secrets; "
       "print(secrets.token_hex(32))')`) or --secret-file PATH (a file of mode 0600)")


def new_secret() -> str:
    """A fresh random secret (a run on one host makes its own)."""
    return secrets.token_hex(32)


def load_secret(secret_file: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The job's secret: the file's content (stripped) when one is given, else
    ``TRAINMESH_FT_SECRET``; :class:`ConfigError` naming what is wrong (none given, a file
    readable by group or others, unreadable, too short)."""
    env = os.environ if env is None else env
    if secret_file is not None:
        path = Path(secret_file)
        try:
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError("--secret-file", f"{path} is open to group or others (mode "
                                  f"{stat.S_IMODE(mode):04o}); make it 0600: chmod 600 {path}")
            value = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--secret-file", f"cannot read {path}: {exc}") from None
        return _checked(value, "--secret-file")
    value = env.get(SECRET_ENV, "").strip()
    if not value:
        raise ConfigError(SECRET_ENV, f"a fault-tolerant run across hosts needs a secret: {HOW}")
    return _checked(value, SECRET_ENV)


def _checked(value: str, where: str) -> str:
    if len(value) < MIN_SECRET:
        raise ConfigError(where, f"the secret must be at least {MIN_SECRET} characters (a random "
                          f"one: python -c 'import secrets; print(secrets.token_hex(32))'); got "
                          f"{len(value)}")
    return value


def authenticator(secret: str, key: str, payload: bytes) -> str:
    """HMAC-SHA256 (hex) of ``key`` and ``payload``: a record copied under another key fails."""
    message = key.encode() + b"\0" + payload
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def authentic(secret: str, key: str, payload: bytes, mac: str) -> bool:
    """Whether ``mac`` is the authenticator of ``payload`` under ``key`` (in constant time)."""
    return hmac.compare_digest(authenticator(secret, key, payload), mac)


class Rejected(ValueError):
    """A record that is not to be believed: ``reason`` says why, ``writer`` is the replica id it
    claims (-1: the coordinator; None: none readable); ``authentic``: sealed by a member of this
    job (its fields were wrong)."""

    def __init__(self, reason: str, writer: int | None = None, *, authentic: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.writer, self.authentic = reason, writer, authentic


class VersionMismatch(Rejected):
    """An authentic record of another protocol version."""


# ---------------------------------------------------------------- sealing
class Codec:
    """Seals and opens the records of one job (its ``secret``) as seen by ``writer`` (a replica
    id, or :data:`COORDINATOR_ID`) talking to the coordinator of ``epoch``; ``replicas`` and
    ``last`` (once known) bound the ids and steps a record may name."""

    def __init__(self, secret: str, *, writer: int, replicas: int, epoch: str = "",
                 last: int | None = None) -> None:
        self.secret, self.writer, self.replicas = secret, writer, replicas
        self.epoch, self.last = epoch, last

    def seal(self, k: str, record: Any, *, epoch: str | None = None) -> bytes:
        """``record`` (a dataclass) sealed for key ``k``."""
        body = asdict(record)
        payload = json.dumps({"v": PROTOCOL_VERSION, "epoch": self.epoch if epoch is None else epoch,
                              "by": self.writer, "body": body}, separators=(",", ":")).encode()
        return authenticator(self.secret, k, payload).encode() + b"." + payload

    def open(self, k: str, raw: bytes, typed: Callable[[Any], Any], *, by: int | None,
             any_epoch: bool = False) -> Any:
        """``typed(body)`` of the record at ``k`` written by ``by`` (None: any member), or
        :class:`Rejected`: not sealed by this job's secret under ``k``, of another version,
        of another coordinator's epoch (stale), by another writer, or refused by ``typed``."""
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > (1 << 26):
            raise Rejected("not a record")
        mac, dot, payload = bytes(raw).partition(b".")
        if not dot or len(mac) != 64:
            raise Rejected("no authenticator", _claimed(bytes(raw)))
        writer = _claimed(payload)
        try:
            if not authentic(self.secret, k, payload, mac.decode("ascii")):
                raise Rejected("wrong authenticator (not written by a member of this job, or "
                               "under another key)", writer)
        except UnicodeDecodeError:
            raise Rejected("no authenticator", writer) from None
        try:   # authentic: written by a member's json.dumps (else the member's bug)
            head = json.loads(payload)
        except (ValueError, RecursionError):
            head = None
        if not isinstance(head, dict):
            raise Rejected("an authentic payload that is no JSON object", writer, authentic=True)
        if head.get("v") != PROTOCOL_VERSION:
            raise VersionMismatch(f"written by protocol version {head.get('v')}, this one speaks "
                                  f"version {PROTOCOL_VERSION}", writer)
        if not any_epoch and head.get("epoch") != self.epoch:
            raise Rejected(f"stale: written for coordinator epoch {str(head.get('epoch'))[:12]}, "
                           f"not this one ({self.epoch[:12]})", writer)
        if by is not None and writer != by:
            raise Rejected(f"written by {writer}, where only {by} writes", writer)
        try:
            return typed(head.get("body"))
        except Rejected as exc:
            raise Rejected(exc.reason, writer, authentic=True) from None


def _claimed(payload: bytes) -> int | None:
    """The writer an unauthenticated payload claims, for the log (None: unreadable)."""
    try:
        by = json.loads(payload).get("by")
    except (ValueError, AttributeError, RecursionError):
        return None
    return by if type(by) is int and -1 <= by < MAX_INT else None
