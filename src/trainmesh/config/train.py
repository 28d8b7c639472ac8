"""TrainConfig: everything ``trainmesh train`` needs, from a TOML file and flags (flags win).

Fields are declared once with their flag, help text and valid range
(:func:`~trainmesh.config.validation.setting`); :data:`FLAGS` (flag -> field) generates the command
line of ``train`` and ``plan`` and is the list of TOML keys. A TOML key is a flag name without
the dashes (``global-batch`` or ``global_batch``, ``timeout``), at top level or in tables
(``[parallel]``, ``[model]``, ``[train]``: tables only group keys). Unknown keys are an error.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from trainmesh.config.parallel import GRAD_CLIP, ParallelConfig
from trainmesh.config.validation import INT64_MAX, Flag, check_fields, flags_of, setting
from trainmesh.core.axes import Facts
from trainmesh.core.errors import ConfigError
from trainmesh.models.gpt import PRESETS, GPTConfig
from trainmesh.strategies import table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OPTIMIZERS = ("adamw", "sgd", "muon")
DEVICES = ("auto", "cpu", "cuda")
DOCUMENTS = ("stream", "packed")
"""--documents' choices (docs/DATA.md)."""
DEFAULT_LR = {"adamw": 3e-3, "sgd": 0.3, "muon": 0.01}
SHAPE = {"layers": "n_layers", "d_model": "d_model", "heads": "n_heads", "seq_len": "seq_len",
         "vocab_size": "vocab_size", "experts": "n_experts", "top_k": "top_k",
         "moe_every": "moe_every", "moe_hidden": "moe_hidden", "moe_aux_loss": "moe_aux_loss"}
"""Model-shape overrides: TrainConfig field -> GPTConfig field."""


@dataclass
class TrainConfig:
    """One training run: layout, model, data, optimizer, schedule, outputs."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: str = setting("tiny", f"built-in GPT preset: {', '.join(PRESETS)}", choices=tuple(PRESETS),
                         group="model")
    layers: int | None = setting(None, "override the preset's layer count", ge=1, group="model")
    d_model: int | None = setting(None, "override the preset's hidden size", ge=1, group="model")
    heads: int | None = setting(None, "override the preset's attention heads", ge=1, group="model")
    seq_len: int | None = setting(None, "override the preset's sequence length", ge=1, group="model")
    vocab_size: int | None = setting(None, "override the preset's vocabulary size", ge=1, group="model")
    experts: int | None = setting(None, "mixture of experts in the built-in GPT: experts per MoE "
                                        "layer (default 0: dense)", ge=0, group="model")
    top_k: int | None = setting(None, "MoE: experts each token is routed to (default 2)", ge=1,
                                group="model")
    moe_every: int | None = setting(None, "MoE: every N-th block's MLP is a mixture of experts "
                                          "(default 1)", ge=1, group="model")
    moe_hidden: int | None = setting(None, "MoE: hidden size of one expert (default "
                                           "4 d-model / top-k)", ge=1, group="model")
    moe_aux_loss: float | None = setting(None, "MoE: coefficient of the load-balancing loss, "
                                               "computed per sequence (default 0.01)", ge=0,
                                         group="model")
    data: str = setting("synthetic", "'synthetic', a text file, a JSON-lines (.jsonl) or Parquet "
                                     "file of documents, a directory saved by the datasets "
                                     "library, or a token file (.npy, .bin uint16)", path=True,
                        group="data")
    tokenizer: str | None = setting(None, "text --data as 'bytes' (vocab 256), 'bpe:VOCAB' (a "
                                          "byte-level BPE trained on it, cached beside it; sets "
                                          "--vocab-size) or 'model' (the --model-dir's own "
                                          "tokenizer; the default with --model-dir when it has "
                                          "one, else bytes)", group="data")
    text_field: str = setting("text", "the field holding each document's text in JSON-lines, "
                                      "Parquet or saved-datasets --data", group="data")
    documents: str = setting("stream", "stream: documents joined into one stream, sequences cut "
                                       "from it; packed: each sequence holds whole documents and "
                                       "pieces of long ones, attention and loss never cross a "
                                       "document, positions restart at each (docs/DATA.md)",
                             choices=DOCUMENTS, group="data")
    global_batch: int = setting(16, "sequences per optimizer step over all DP ranks and "
                                    "microbatches", ge=1, group="optimisation")
    optimizer: str = setting("adamw", "adamw, sgd or muon (Muon on hidden weight matrices, "
                                        "AdamW on the rest: docs/TRAINING.md)",
                             choices=OPTIMIZERS, group="optimisation")
    lr: float | None = setting(None, "peak learning rate (default " + ", ".join(
        f"{v:g} for {k}" for k, v in DEFAULT_LR.items()) + ")", gt=0, group="optimisation")
    warmup_steps: int = setting(20, "linear warm-up steps before cosine decay", ge=0, group="optimisation")
    steps: int = setting(200, "total optimizer steps", ge=1, group="optimisation")
    seed: int = setting(0, "seed of weights and data", ge=0, group="data")
    init_from: str | None = setting(None, "start from pretrained weights: a safetensors file with "
                                          "the GPT's parameter names and shapes (e.g. `trainmesh "
                                          "checkpoint consolidate` output)", path=True, group="checkpoints")
    model_dir: str | None = setting(None, "train the Hugging Face causal LM (GPT-2, Llama, Mixtral, ...) of "
                                          "this directory instead of the built-in GPT: config.json "
                                          "+ model.safetensors (or its shards), as save_pretrained writes (needs "
                                          "transformers); every axis its plans allow", path=True, group="model")
    tp_plan: str | None = setting(None, "--model-dir's tensor-parallel plan from this JSON file (module "
                                        "pattern -> style, as config.base_model_tp_plan), over the "
                                        "declared or inferred one (docs/BRING_YOUR_OWN_MODEL.md)",
                                  path=True, group="model")
    pp_plan: str | None = setting(None, "--model-dir's pipeline plan from this JSON file (the base "
                                        "model's modules -> [inputs, outputs], its decoder layer list "
                                        "among them, as config.base_model_pp_plan)", path=True,
                                  group="model")
    ep_plan: str | None = setting(None, "--model-dir's expert-parallel plan from this JSON file "
                                        "(pattern -> grouped_gemm / ep_dispatch_experts, as "
                                        "config.base_model_ep_plan)", path=True, group="model")
    metrics_out: str | None = setting(None, "JSON-lines metrics file", path=True, group="observability")
    save_dir: str | None = setting(None, "checkpoint directory", path=True, group="checkpoints")
    save_every: int = setting(0, "save every N steps (0: only at the end)", ge=0, group="checkpoints")
    keep_last: int = setting(0, "after each save keep only the newest N checkpoints (0: all)", ge=0,
                             group="checkpoints")
    resume: bool = setting(False, "continue from the newest intact checkpoint in --save-dir",
                           group="checkpoints")
    resume_from: str | None = setting(None, "start from a torch.distributed.checkpoint directory "
                                            "of the same model (e.g. written by plain PyTorch with "
                                            "get_state_dict): its weights and optimizer states, "
                                            "then this run's steps from 1 and its LR schedule",
                                      path=True, group="checkpoints")
    async_save: bool = setting(False, "save in the background: snapshot the state to host memory "
                                      "at each save, write it on a thread while training goes on",
                               group="checkpoints")
    exit_after: int | None = setting(None, "stop cleanly after this step (planned preemption)", ge=1,
                                     group="checkpoints")
    max_restarts: int | None = setting(None, "restarts of failed workers by their elastic agent "
                                             "(local runs): default 0; with --fault-tolerant 3, "
                                             "per replica (a restarted replica copies the live "
                                             "state, the others go on)", ge=0, group="launch")
    coordinator: str | None = setting(None, "--fault-tolerant across hosts: HOST:PORT of the "
                                            "`trainmesh coordinator` (several, comma-separated, "
                                            "or @FILE listing them: tried in turn when it is "
                                            "lost); this host runs replica --replica-id",
                                      group="launch")
    replica_id: int | None = setting(None, "with --coordinator: the replica this host runs, "
                                           "0 .. --replicas - 1", ge=0, group="launch")
    replicas: int | None = setting(None, "with --coordinator: the run's replicas (--dp defaults "
                                         "to replicas x the dp indices of one replica)", ge=1,
                                   group="launch")
    secret_file: str | None = setting(None, "with --coordinator: a file (mode 0600) holding the "
                                            "job's secret, the coordinator's too (default: "
                                            "TRAINMESH_FT_SECRET)", group="launch")
    timeline_out: str | None = setting(None, "SVG/PNG of the measured per-rank timeline "
                                             "(pipeline runs)", path=True, group="observability")
    eval_every: int | None = setting(None, "validation loss on the held-out split (the last 5 percent "
                                           "of --data, or a disjoint synthetic stream) every N "
                                           "steps", ge=1, group="observability")
    eval_batches: int = setting(4, "global batches per evaluation (--eval-every)", ge=1,
                                group="observability")
    trace_out: str | None = setting(None, "Chrome/Perfetto trace JSON of the last --trace-steps "
                                          "steps, every rank in one file", path=True, group="observability")
    trace_steps: int = setting(2, "steps in the --trace-out trace (the run's last)", ge=1,
                               group="observability")
    tensorboard: str | None = setting(None, "directory for TensorBoard event files (needs the "
                                            "tensorboard package)", path=True, group="observability")
    device: str = setting("auto", "auto, cpu or cuda", choices=DEVICES, group="launch")
    on_nonfinite: str = setting("stop", "a non-finite loss or gradient norm: stop (exit 1, nothing "
                                        "non-finite saved) or skip the step (stop after a bound)",
                                choices=("stop", "skip"), group="optimisation")
    peak_tflops: float | None = setting(None, "one device's peak TFLOP/s for MFU (default: a table "
                                              "of known GPUs; none on CPU)", gt=0, group="observability")
    gpu: str | None = setting(None, "the accelerator, for MFU's peak: a name of `trainmesh plan "
                                    "--list-gpus` (default: the detected CUDA device; none on "
                                    "CPU)", group="observability")
    force: bool = setting(False, "start even when the planner predicts the run will not fit "
                                 "this machine, or --resume with another --data than the "
                                 "checkpoint's", group="launch")

    @property
    def restart_limit(self) -> int:
        """--max-restarts, or its default: 0, or 3 per replica with --fault-tolerant."""
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.parallel.fault_tolerant else 0

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError("TrainConfig.parallel must be a ParallelConfig")
        check_fields(self)
        self._check_data()
        if self.exit_after is not None and self.exit_after > self.steps:
            raise ConfigError("--exit-after", f"must be a step in 1..--steps ({self.steps}); "
                              f"got {self.exit_after}")
        if self.async_save and not self.save_dir:
            raise ConfigError("--async-save", "writes checkpoints in the background; needs --save-dir")
        if self.gpu is not None:
            from trainmesh.core.gpus import gpu
            self.gpu = gpu(self.gpu).name
        if self.resume and not self.save_dir:
            raise ConfigError("--resume", "needs --save-dir (where the checkpoints are)")
        self._check_resume_from()
        if self.timeline_out is not None:
            if self.parallel.pp == 1:
                raise ConfigError("--timeline-out", "draws pipeline runs; needs --pp > 1")
            if not self.timeline_out.endswith((".svg", ".png")):
                raise ConfigError("--timeline-out", f"must end in .svg or .png; got {self.timeline_out!r}")
        p = self.parallel
        table.check_facts(p, Facts(run=self))   # the strategies' rules on the run's flags
        per = p.dp * p.microbatches
        if self.global_batch % per and not p.fault_tolerant:   # fault-tolerant: split unevenly
            raise ConfigError("--global-batch", f"must be divisible by dp x microbatches = {p.dp} x "
                              f"{p.microbatches} = {per}; got {self.global_batch}")
        gpt = self.gpt_config()  # the shape's own rules (heads divide d-model)
        for flag, given in (("--tp-plan", self.tp_plan), ("--pp-plan", self.pp_plan),
                            ("--ep-plan", self.ep_plan)):
            if given is not None and self.model_dir is None:
                raise ConfigError(flag, "is a plan for a Hugging Face model; needs --model-dir "
                                  "(the built-in GPT has its own plans)")
        if self.model_dir is not None:   # its config.json sets the shape: other rules
            from trainmesh.config.model_dir import check_model_config
            self.vocab_size = check_model_config(self)
            return
        # the table's rules with the built-in GPT's facts (its experts and blocks; its head is
        # untied) and the run's
        table.check(p, self.facts(experts=gpt.n_experts, layers=gpt.n_layers, ties=False,
                                  ties_on_one_rank=False, hub=False))
        from trainmesh.models.gpt import validate_gpt
        validate_gpt(gpt, p.tp, sequence_parallel=p.sequence_parallel)
        self._check_cp_ep(gpt)

    def _check_cp_ep(self, gpt: GPTConfig) -> None:
        """Context and expert parallelism against the model's shape."""
        p = self.parallel
        if gpt.seq_len % (2 * p.cp):
            raise ConfigError("--seq-len", f"must be divisible by 2 x --cp = {2 * p.cp} (each "
                              f"rank holds 2 of 2cp chunks of a sequence); got {gpt.seq_len}")
        if p.cp > 1 and p.sequence_parallel and (gpt.seq_len // p.cp) % p.tp:
            raise ConfigError("--seq-len", f"with --cp {p.cp} and --sequence-parallel, seq-len / cp "
                              f"= {gpt.seq_len // p.cp} must be divisible by --tp {p.tp}")
        if gpt.n_experts and gpt.moe_every > gpt.n_layers:
            raise ConfigError("--moe-every", f"must be at most --layers {gpt.n_layers} (no block "
                              f"would be a mixture of experts); got {gpt.moe_every}")

    def facts(self, **model: Any) -> Facts:
        """The facts of this run the table's rules read (:class:`~trainmesh.core.axes.Facts`):
        ``model``'s (experts, layers, ties, hub) and whether it saves checkpoints."""
        return Facts(saves=self.save_dir is not None, **model)

    def _check_resume_from(self) -> None:
        """--resume-from names a DCP checkpoint directory, and is not combined with --resume."""
        if self.resume_from is None:
            return
        if self.resume:
            raise ConfigError("--resume-from", "starts a new run from a checkpoint; --resume "
                              "continues one in --save-dir: give one of them")
        if not (Path(self.resume_from) / ".metadata").is_file():
            raise ConfigError("--resume-from", f"{self.resume_from!r} is not a "
                              "torch.distributed.checkpoint directory (no .metadata in it); valid: "
                              "a directory dcp.save wrote, or a step-NNNNNNNN of a --save-dir")

    def _check_data(self) -> None:
        """--tokenizer (resolved: model with a --model-dir that has a tokenizer and text data,
        else bytes) and --text-field against the kind of --data."""
        from trainmesh.data.documents import JSONL_SUFFIXES
        from trainmesh.data.tokenizer import bpe_vocab
        suffix = Path(self.data).suffix.lower()
        text = self.data != "synthetic" and suffix not in (".npy", ".bin")
        if self.tokenizer is None:
            from trainmesh.data.model_tokenizer import has_tokenizer
            model = text and self.model_dir is not None and has_tokenizer(self.model_dir)
            self.tokenizer = "model" if model else "bytes"
        bpe = bpe_vocab(self.tokenizer)
        if self.tokenizer != "bytes" and self.data == "synthetic":
            raise ConfigError("--tokenizer", f"{self.tokenizer} tokenises text --data; the "
                              "synthetic corpus has its own vocabulary (valid with it: bytes)")
        if self.tokenizer == "model" and self.model_dir is None:
            raise ConfigError("--tokenizer", "model tokenises with the --model-dir's tokenizer; "
                              "needs --model-dir (valid without it: bytes or bpe:VOCAB)")
        if bpe is not None and self.vocab_size is None:
            self.vocab_size = bpe
        if self.documents == "packed" and not text and self.model_dir is None:
            what = ("the synthetic language has no documents" if self.data == "synthetic" else
                    "a token file is split into documents at the EOS id of --model-dir's "
                    "tokenizer, and there is no --model-dir")
            raise ConfigError("--documents", f"packed needs documents: {what}; valid: stream, or "
                              "packed with text, JSON-lines, Parquet or datasets --data (a token "
                              "file with --model-dir)")
        if not self.text_field:
            raise ConfigError("--text-field", "must name a field; got an empty string")
        records = suffix in (*JSONL_SUFFIXES, ".parquet") or Path(self.data).is_dir()
        if self.text_field != "text" and not records:
            raise ConfigError("--text-field", "selects the text of JSON-lines, Parquet or saved-"
                              f"datasets --data; {self.data!r} has no fields (leave it out)")

    def data_options(self) -> dict[str, Any]:
        """How text --data becomes tokens: the keywords of
        :func:`~trainmesh.data.corpus.make_datasets` beside the data and its shape."""
        return {"tokenizer": self.tokenizer, "text_field": self.text_field,
                "model_dir": self.model_dir, "documents": self.documents}

    def plan_files(self) -> Any:
        """--tp-plan, --pp-plan, --ep-plan as :class:`~trainmesh.models.hf_plans.PlanFiles`."""
        from trainmesh.models.hf_plans import PlanFiles
        return PlanFiles(tp=self.tp_plan, pp=self.pp_plan, ep=self.ep_plan)

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    def gpt_config(self) -> GPTConfig:
        """The preset with the shape flags given (``--layers`` ...) applied."""
        base = asdict(PRESETS[self.model])
        base.update({gpt: getattr(self, mine) for mine, gpt in SHAPE.items()
                     if getattr(self, mine) is not None})
        base["d_ff"] = 0  # 4 x d_model of the final width
        return GPTConfig(**base)

    def num_params(self) -> int:
        """Logical parameter count of the model trained (tied weights once); a model directory's
        model built (wholly on meta) once per config and directory, not at every call."""
        if self.model_dir is not None:
            known = self.__dict__.get("_hub_params")
            if known is None or known[0] != self.model_dir:
                from trainmesh.models.hf import count_params
                known = self.__dict__["_hub_params"] = (self.model_dir, count_params(self.model_dir))
            return known[1]
        return self.gpt_config().num_params()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FLAGS: dict[str, Flag] = {**flags_of(ParallelConfig, group="layout"), **flags_of(TrainConfig)}
"""Every ``trainmesh train`` flag -> its config field (the flags of ``train`` and ``plan``, and
the TOML keys)."""
TRAIN_DEFAULTS: dict[str, Any] = {"grad_clip": GRAD_CLIP}
"""ParallelConfig fields whose ``trainmesh train`` default differs from the Python API's."""
PARALLEL_FIELDS = ParallelConfig.field_names()
TRAIN_FIELDS = {f.name for f in fields(TrainConfig)} - {"parallel"}


def field_of_key(key: str) -> str | None:
    """The field a flag or TOML key sets (``global-batch``, ``global_batch``, ``--timeout``), or None."""
    flag = FLAGS.get("--" + key.lstrip("-").replace("_", "-"))
    return flag.field if flag is not None else None


def read_toml(path: str) -> dict[str, Any]:
    """A config file flattened to {field: value}. Tables (``[train]``, ``[parallel]``, any name)
    only group keys, one level deep; a key set twice (in two tables, or in one and at the top)
    is refused naming both places, so no table silently overrides another."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("--config", f"no such file {path!r}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--config", f"cannot read {path!r}: {exc}") from None
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        place = f"table [{key}]" if isinstance(value, dict) else "the top level"
        for k, v in items:
            if isinstance(v, dict):
                raise ConfigError("--config", f"table [{key}.{k}] in {path}: tables group keys one "
                                  f"level deep; valid: the flag names as keys at the top level or "
                                  f"in a table such as [{key}] (e.g. steps = 3)")
            name = field_of_key(k)
            if name is None:
                raise ConfigError("--config", f"unknown key {k!r} in {place} of {path}; keys are "
                                  "the flag names without '--' (e.g. global-batch, timeout)")
            if name in where:
                raise ConfigError("--config", f"{k!r} is set twice in {path}: in {where[name]} and "
                                  f"in {place}; valid: each flag once")
            flat[name], where[name] = v, place
    return flat


def build_train_config(values: dict[str, Any]) -> TrainConfig:
    """{field: value} (from TOML and flags) -> a validated TrainConfig."""
    par = {k: v for k, v in values.items() if k in PARALLEL_FIELDS}
    rest = {k: v for k, v in values.items() if k in TRAIN_FIELDS}
    replicas = rest.get("replicas")
    if (type(replicas) is int and 1 <= replicas <= INT64_MAX   # else its own check names it
            and "dp" not in par):   # a replica across hosts: dp from R
        shard = par.get("dp_shard") if par.get("zero", 0) else None
        par["dp"] = replicas * (shard if type(shard) is int and 1 <= shard <= INT64_MAX else 1)
    for name, value in TRAIN_DEFAULTS.items():   # trainmesh train's own defaults (docs/CLI.md)
        par.setdefault(name, value)
    return TrainConfig(parallel=ParallelConfig(**par), **rest)
