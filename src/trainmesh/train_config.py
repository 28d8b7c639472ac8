"""TrainConfig: everything ``trainmesh train`` needs, from a TOML file and flags (flags win).

Field names are the flag names with dashes as underscores (``--global-batch`` ->
``global_batch``). A TOML file may set them at top level or in tables (``[parallel]``,
``[model]``, ``[train]``: tables are only for grouping). Unknown keys are an error.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .config import ParallelConfig
from .errors import ConfigError
from .models.gpt import PRESETS, GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OPTIMIZERS = ("adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_LR = {"adamw": 3e-3, "sgd": 0.3}


@dataclass
class TrainConfig:
    """One training run: layout, model, data, optimizer, schedule, outputs."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: str = "tiny"
    """Preset name of the built-in GPT."""
    layers: int | None = None
    d_model: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    data: str = "synthetic"
    """'synthetic', or a text file (bytes) / token file (.npy, .bin uint16)."""
    global_batch: int = 16
    """Sequences per optimizer step over all DP ranks and microbatches."""
    optimizer: str = "adamw"
    lr: float | None = None
    """Peak learning rate (default: 3e-3 for adamw, 0.3 for sgd)."""
    warmup_steps: int = 20
    steps: int = 200
    seed: int = 0
    metrics_out: str | None = None
    save_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    exit_after: int | None = None
    max_restarts: int = 0
    timeline_out: str | None = None
    device: str = "auto"
    on_nonfinite: str = "stop"
    """A non-finite loss or gradient norm: stop (exit 1) or skip the step (stop after a bound)."""

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ConfigError("model", f"must be one of {', '.join(PRESETS)}; got {self.model!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError("on-nonfinite", f"must be one of stop, skip; got {self.on_nonfinite!r}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"must be one of {', '.join(DEVICES)}; got {self.device!r}")
        for name in ("global_batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name.replace("_", "-"), f"must be a positive integer; got {value!r}")
        for name in ("warmup_steps", "save_every", "max_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(name.replace("_", "-"), f"must be >= 0; got {getattr(self, name)}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError("lr", f"must be > 0; got {self.lr}")
        if self.exit_after is not None and not 1 <= self.exit_after <= self.steps:
            raise ConfigError("exit-after", f"must be a step in 1..--steps ({self.steps}); got {self.exit_after}")
        p = self.parallel
        per = p.dp * p.microbatches
        if self.global_batch % per:
            raise ConfigError("global-batch", f"must be divisible by dp x microbatches = {p.dp} x "
                              f"{p.microbatches} = {per}; got {self.global_batch}")
        gpt = self.gpt_config()  # validates the shape
        if p.pp * p.virtual_stages > gpt.n_layers:
            raise ConfigError("pp", f"pp x virtual-stages = {p.pp * p.virtual_stages} exceeds the "
                              f"model's {gpt.n_layers} layers")
        from .tensor_parallel.plan import validate_gpt
        validate_gpt(gpt, p.tp, sequence_parallel=p.sequence_parallel)

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    def gpt_config(self) -> GPTConfig:
        base = PRESETS[self.model]
        return GPTConfig(
            vocab_size=self.vocab_size or base.vocab_size,
            seq_len=self.seq_len or base.seq_len,
            d_model=self.d_model or base.d_model,
            n_layers=self.layers or base.n_layers,
            n_heads=self.heads or base.n_heads,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PARALLEL_FIELDS = ParallelConfig.field_names()
TRAIN_FIELDS = {f.name for f in fields(TrainConfig)} - {"parallel"}


def read_toml(path: str) -> dict[str, Any]:
    """A config file flattened to {field: value}; tables only group keys."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("config", f"no such file {path!r}") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("config", f"cannot read {path!r}: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            name = k.replace("-", "_")
            if name not in PARALLEL_FIELDS | TRAIN_FIELDS:
                raise ConfigError("config", f"unknown key {k!r} in {path}")
            flat[name] = v
    return flat


def build_train_config(values: dict[str, Any]) -> TrainConfig:
    """{field: value} (from TOML and flags) -> a validated TrainConfig."""
    par = {k: v for k, v in values.items() if k in PARALLEL_FIELDS}
    rest = {k: v for k, v in values.items() if k in TRAIN_FIELDS}
    par.setdefault("grad_clip", 1.0)  # CONTRACT.md: --grad-clip defaults to 1.0
    try:
        return TrainConfig(parallel=ParallelConfig(**par), **rest)
    except TypeError as exc:  # a wrongly typed TOML value
        raise ConfigError("config", str(exc)) from None
