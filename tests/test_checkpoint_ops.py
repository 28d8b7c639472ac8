"""Checkpoint operations that never destroy or guess: consolidate refuses to overwrite and never
writes inside the checkpoint; --resume falls back to the newest intact checkpoint; --keep-last
prunes; a cut metrics line is dropped; another --data is refused; manifests stay inside their
directory; outputs get the usual mode; no lock file stays; a corrupt --model-dir weights file is
refused before any worker starts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from helpers import SMALL, steps, trainmesh_process
from tolerances import LOSS_ABS

from trainmesh.checkpoint.sharded import MANIFEST, newest_intact
from trainmesh.cli import main

LAUNCHED = 99
UMASK = 0o022


def _train(args: list[str], tmp: Path, name: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp / f"{name}.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = trainmesh_process(["train", *args, "--metrics-out", str(out)], tmp, env=env, timeout=240,
                             name=name, umask=UMASK)
    return proc, _records(out) if proc.returncode == 0 else []


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 6-step run saving every 2 steps, keeping the last 2: (tmp, records)."""
    tmp = tmp_path_factory.mktemp("ops")
    proc, records = _train([*SMALL, "--save-dir", str(tmp / "ck"), "--save-every", "2", "--keep-last", "2",
                            "--exit-after", "6"], tmp, "first")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, records


@pytest.fixture
def no_launch(monkeypatch):
    """Validation only: no worker ever starts; the process is a launcher, not a worker."""
    import trainmesh.run.launch
    monkeypatch.setattr(trainmesh.run.launch, "launch_local", lambda *a, **k: LAUNCHED)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def _one_error(capsys, flag: str, words: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: {flag}:" in err[0] and words in err[0], err


def _flip(piece: Path) -> None:
    data = bytearray(piece.read_bytes())
    data[-10] ^= 0xFF
    piece.write_bytes(bytes(data))


@pytest.mark.slow   # the module's one training run (multi-process)
@pytest.mark.timeout(300)
def test_keep_last_modes_and_no_lock_file(run):
    tmp, _ = run
    ck = tmp / "ck"
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000004", "step-00000006"]
    assert not list(ck.glob(".*")), "a lock or temporary file stayed after a clean exit"
    for f in ck.glob("step-*/*"):
        assert f.stat().st_mode & 0o777 == 0o666 & ~UMASK, (f, oct(f.stat().st_mode))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_skips_a_corrupt_newest_and_a_cut_metrics_line(run, tmp_path):
    tmp, first = run
    ck = tmp_path / "ck"
    shutil.copytree(tmp / "ck", ck)
    _flip(sorted((ck / "step-00000006").glob("*.distcp"))[0])
    metrics = tmp_path / "again.jsonl"
    metrics.write_text((tmp / "first.jsonl").read_text() + '{"event": "step", "st')   # a crash cut it
    proc, records = _train([*SMALL, "--save-dir", str(ck), "--resume", "--exit-after", "6"], tmp_path, "again")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    skipped = [line for line in out.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1 and "step-00000006" in skipped[0] and "corrupt" in skipped[0], out
    assert sum("dropped the partial last line" in line for line in out.splitlines()) == 1, out
    assert "resumed from step 4" in out, out
    got, want = steps(records), steps(first)
    assert [r["step"] for r in got] == list(range(1, 7))
    for a, b in zip(want, got):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ABS, (a, b)


@pytest.mark.slow   # the module's one training run (multi-process)
@pytest.mark.timeout(300)
def test_resume_refuses_no_intact_checkpoint_and_other_data(run, tmp_path, no_launch, capsys):
    tmp, _ = run
    ck = tmp_path / "ck"
    shutil.copytree(tmp / "ck", ck)
    base = ["train", *SMALL, "--save-dir", str(ck), "--resume"]
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"".join(i.to_bytes(2, "little") for i in range(64)) * 100)   # uint16 ids < 64
    assert main([*base, "--data", str(tokens)]) == 2
    _one_error(capsys, "--data", "--force")
    assert main([*base, "--data", str(tokens), "--force"]) == LAUNCHED
    assert main(base) == LAUNCHED
    for piece in ck.glob("step-*/*.distcp"):
        _flip(piece)
    assert main(base) == 2
    _one_error(capsys, "--resume", "no intact checkpoint")


@pytest.mark.slow   # the module's one training run (multi-process)
@pytest.mark.timeout(300)
def test_consolidate_never_destroys(run, tmp_path, capsys):
    tmp, _ = run
    ck = tmp / "ck"
    piece = sorted((ck / "step-00000006").glob("*.distcp"))[0]
    before = piece.read_bytes()
    out = tmp_path / "full.safetensors"
    old = os.umask(UMASK)
    try:
        assert main(["checkpoint", "consolidate", str(ck), str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o666 & ~UMASK
    capsys.readouterr()
    assert main(["checkpoint", "consolidate", str(ck), str(out)]) == 2
    _one_error(capsys, "OUT", "--force")
    assert main(["checkpoint", "consolidate", str(ck), str(out), "--force"]) == 0
    for inside in (piece.with_name("full.safetensors"), ck / "new.safetensors"):
        for force in ([], ["--force"]):
            assert main(["checkpoint", "consolidate", str(ck), str(inside), *force]) == 2
            _one_error(capsys, "OUT", "inside DIR")
        assert not inside.exists()
    assert piece.read_bytes() == before


@pytest.mark.slow   # the module's one training run (multi-process)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["../outside.safetensors", "/abs", "link.safetensors"])
def test_manifest_cannot_name_files_outside_its_directory(run, tmp_path, name):
    tmp, _ = run
    ck = tmp_path / "ck"
    shutil.copytree(tmp / "ck", ck)
    newest = ck / "step-00000006"
    piece = sorted(newest.glob("*.distcp"))[0]
    outside = ck / "outside.safetensors"    # the piece itself, its checksum right, but outside
    shutil.copy(piece, outside)
    if name == "link.safetensors":
        (newest / name).symlink_to(outside)
    elif name == "/abs":
        name = str(outside)
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"] = {name if f == piece.name else f: h for f, h in manifest["files"].items()}
    (newest / MANIFEST).write_text(json.dumps(manifest))
    chosen, skipped = newest_intact(ck)
    assert chosen == ck / "step-00000004"
    assert [s[0] for s in skipped] == [newest] and name in skipped[0][1], skipped
    assert "refus" in skipped[0][1], skipped
    assert main(["checkpoint", "consolidate", str(newest), str(tmp_path / "x.safetensors")]) == 2


@pytest.mark.timeout(60)
def test_corrupt_model_dir_weights_exit_2_before_workers(tmp_path, no_launch, capsys):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 16}))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    try:
        code = main(["train", "--model-dir", str(d), "--seq-len", "16", "--global-batch", "8", "--steps", "2"])
    except Exception as exc:   # noqa: BLE001 - a traceback is the failure this test is for
        code = f"raised {exc!r}"
    assert code == 2
    _one_error(capsys, "--model-dir", "model.safetensors")


class _Planted(RuntimeError):
    """A save dying at a phase."""


def test_a_save_dying_at_any_phase_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """In process, world 1: step 2's save fails at each phase in turn (after planning, after
    the write, after .metadata, after the manifest, before the rename); each time step 1 stays
    the newest intact checkpoint and loads back its own state."""
    import torch

    import trainmesh as tm
    from trainmesh import ParallelMesh
    from trainmesh.checkpoint import sharded
    from trainmesh.models.gpt import GPT, GPTConfig
    engine = tm.Engine(GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2), seed=0),
                       lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda m, b: m(**b),
                       tm.ParallelConfig(), mesh=ParallelMesh(local=True))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.train_step({"input_ids": ids, "labels": ids})
    engine.save(str(tmp_path))
    step1 = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.train_step({"input_ids": ids, "labels": ids})
    for phase in sharded.PHASES:
        def fail(name: str, phase: str = phase) -> None:
            if name == phase:
                raise _Planted(phase)
        monkeypatch.setattr(sharded, "_phase", fail)
        with pytest.raises(_Planted):
            engine.save(str(tmp_path))
        newest, skipped = newest_intact(tmp_path)
        assert newest == tmp_path / "step-00000001" and skipped == [], (phase, newest, skipped)
    monkeypatch.setattr(sharded, "_phase", lambda name: None)
    assert engine.load(str(tmp_path))["step"] == 1
    for name, value in engine.module.state_dict().items():
        assert torch.equal(value, step1[name]), name


class _OneRank:
    """The communication layer of a single process, as a save uses it."""

    class mesh:
        rank = 0

    @staticmethod
    def all_gather_object(obj: object) -> list[object]:
        return [obj]


def test_a_save_stages_one_chunk_at_a_time_through_a_buffer_of_half_its_writes(tmp_path, monkeypatch):
    """In one process, two tensors held as views into one flat buffer (as ZeRO's shards give
    them; 2048 and 512 bytes): the save copies them through one buffer of half the bytes it
    writes (1280), the larger cut into runs of rows that fit, with never more than the chunk
    being written alive; they read back equal. Planted: DCP's own writer, keeping every copy
    until its file ends, fails with "assert 2 == 1"."""
    import weakref

    import torch
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from trainmesh.checkpoint import dcp_io
    from trainmesh.checkpoint.chunks import Chunks
    flat = torch.arange(80 * 8, dtype=torch.float32)
    whole = {"model.a": flat[:512].view(64, 8), "model.b": flat[512:].view(16, 8)}
    state = {}
    for key, view in whole.items():
        state[key] = Chunks(view.shape, view.dtype)
        state[key].add((0, 0), view)
    alive: weakref.WeakSet = weakref.WeakSet()
    most = []
    real = dcp_io._write_item

    def counting(transforms, stream, data, *rest):
        if isinstance(data, torch.Tensor):
            alive.add(data)
            most.append(len(alive))
        return real(transforms, stream, data, *rest)
    monkeypatch.setattr(dcp_io, "_write_item", counting)
    monkeypatch.setattr(dcp_fs, "_write_item", counting)
    planned = dcp_io.PlannedSave(state, tmp_path, _OneRank())
    results, _ = planned.write()
    planned.finish([results])
    assert max(most) == 1
    assert planned.writer.staged_bytes == 1280
    sizes = sorted(tuple(r.index.offset) for r in results)
    assert sizes == [(0, 0), (0, 0), (40, 0)], sizes          # a: rows 0-39 and 40-63; b whole
    back = {key: torch.zeros_like(view) for key, view in whole.items()}
    dcp_io.read_into(back, tmp_path)
    for key, view in whole.items():
        assert torch.equal(back[key], view), key


def _save_memory(records: list[dict]) -> list[dict]:
    return [m for r in records if r["event"] == "save" for m in r["memory"]]


SAVE_MEMORY_LAYOUTS = {
    # layout: (its flags at dp 2 and dp 4, the model's)
    "zero3": (["--zero", "3"], ["--layers", "2", "--d-model", "512"]),
    "zero1": (["--zero", "1"], ["--layers", "2", "--d-model", "512"]),
    "hsdp": (["--zero", "3", "--dp-shard", "2"], ["--layers", "2", "--d-model", "512"]),
    "tp2-pp2": (["--zero", "1", "--tp", "2", "--pp", "2"], ["--layers", "2", "--d-model", "1280"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(SAVE_MEMORY_LAYOUTS))
def test_a_save_adds_at_most_its_own_shards_and_less_at_higher_dp(tmp_path, layout):
    """The memory a save adds on a rank (its RSS high-water mark over what it held before, on
    the first save of the run) is at most 1.1x its own model and optimizer state plus its
    staging buffer, and the most any rank adds at dp 4 is at most 0.6x the most at dp 2.

    What a save adds is its staging buffer, half of what the rank writes (ZeRO-3 and ZeRO-1:
    its shard, halved from dp 2 to dp 4; HSDP with 2 shards: the same shard at both, but at
    dp 4 its 2 replicas write half each), plus the plans, about 1 to 2.5 MiB whatever the model
    (rank 0's grows with the ranks). With S the staging buffer at dp 2 and F the plans, the
    ratio (S/2 + F) / (S + F) is at most 0.6 when S >= 4F: the models here give S = 19.6 MiB
    (2 layers of 512 at dp 2) and 29 MiB (tp 2 x pp 2, 2 layers of 1280, 8 ranks); at 256 the
    plans dominate and the ratio fails. Staging the largest chunk instead of a share (planted:
    ``staging_parts=None``) or a whole tensor per chunk (the first format's gather) fails the
    ratio."""
    flags, model = SAVE_MEMORY_LAYOUTS[layout]
    added = {}
    for dp in (2, 4):
        proc, records = _train([*model, "--global-batch", "4", "--steps", "1", *flags, "--dp", str(dp),
                                "--save-dir", str(tmp_path / f"ck{dp}")], tmp_path, f"dp{dp}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        memory = _save_memory(records)
        assert len(memory) == dp * (4 if layout == "tp2-pp2" else 1), memory
        for m in memory:
            assert m["peak_added_bytes"] <= 1.1 * m["held_bytes"] + m["staging_bytes"], (dp, m)
        added[dp] = max(m["peak_added_bytes"] for m in memory)
    assert added[4] <= 0.6 * added[2], (layout, added)


def test_resume_from_needs_a_dcp_directory_and_not_resume(tmp_path, no_launch, capsys):
    assert main(["train", *SMALL, "--resume-from", str(tmp_path)]) == 2
    _one_error(capsys, "--resume-from", "no .metadata")
    (tmp_path / ".metadata").write_bytes(b"")
    assert main(["train", *SMALL, "--resume-from", str(tmp_path), "--save-dir", str(tmp_path / "ck"),
                 "--resume"]) == 2
    _one_error(capsys, "--resume-from", "--resume")
    assert main(["train", *SMALL, "--resume-from", str(tmp_path)]) == 2
    _one_error(capsys, "--resume-from", "cannot read")


def test_resume_from_a_checkpoint_of_another_model_exits_2_before_any_worker(tmp_path, no_launch, capsys):
    """Plain PyTorch's dcp.save of the built-in GPT of SMALL's flags: those flags launch; another
    --d-model or --layers exits 2 naming the first parameter that differs or is missing, read
    from the checkpoint's metadata alone (planted: the check skipped launches the run)."""
    import torch.distributed.checkpoint as dcp

    from trainmesh.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4), seed=0)
    with warnings.catch_warnings():   # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    assert main(["train", *SMALL, "--resume-from", str(tmp_path)]) == LAUNCHED
    capsys.readouterr()
    wider = [*SMALL, "--d-model", "64"]
    assert main(["train", *wider, "--resume-from", str(tmp_path)]) == 2
    _one_error(capsys, "--resume-from", "of shape")
    deeper = [*SMALL, "--layers", "3"]
    assert main(["train", *deeper, "--resume-from", str(tmp_path)]) == 2
    _one_error(capsys, "--resume-from", "holds no tensor model.blocks.2.")


def test_resume_from_a_checkpoint_of_another_hub_model_exits_2_before_any_worker(tmp_path, no_launch, capsys):
    """The same for a --model-dir model: plain PyTorch's dcp.save of a tiny Llama's state dict
    resumes that model's directory (launches) and exits 2 for a wider one, naming the parameter
    and both shapes, before any worker (planted: the check skipped for --model-dir launches)."""
    transformers = pytest.importorskip("transformers")
    import contextlib
    import io

    import torch.distributed.checkpoint as dcp

    def llama(hidden: int) -> str:
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64)
        path = tmp_path / f"llama{hidden}"
        model = transformers.LlamaForCausalLM(config)
        with contextlib.redirect_stderr(io.StringIO()):
            model.save_pretrained(str(path))
        return str(path), model

    saved, model = llama(32)
    wider, _ = llama(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    flags = ["--steps", "1", "--seq-len", "16", "--global-batch", "2", "--resume-from",
             str(tmp_path / "ck")]
    assert main(["train", "--model-dir", saved, *flags]) == LAUNCHED
    capsys.readouterr()
    assert main(["train", "--model-dir", wider, *flags]) == 2
    _one_error(capsys, "--resume-from", "of shape")
