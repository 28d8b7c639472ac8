"""Device choice (``--device``, docs/CLI.md): CUDA only when every local rank gets its own GPU.

No GPU is needed: the GPU count is monkeypatched, and so is ``torch.cuda.set_device`` where a
worker would call it. The real CUDA path runs on GPU machines only.
"""
from __future__ import annotations

import logging

import pytest
import torch

from trainmesh.cli import main
from trainmesh.core.distributed import choose_device, init_distributed, pick_device
from trainmesh.core.errors import ConfigError


@pytest.mark.parametrize("device, ranks, gpus, want", [
    ("auto", 2, 0, "cpu"), ("auto", 2, 1, "cpu"), ("auto", 2, 2, "cuda"), ("auto", 1, 1, "cuda"),
    ("auto", 4, 8, "cuda"), ("cpu", 1, 8, "cpu"), ("cuda", 2, 2, "cuda"), ("cuda", 1, 4, "cuda"),
])
def test_choose_device(device, ranks, gpus, want):
    kind, reason = choose_device(device, local_ranks=ranks, gpus=gpus)
    assert kind == want
    # a reason exactly when auto falls back although some GPU is there
    assert (reason is not None) == (device == "auto" and kind == "cpu" and gpus > 0), reason
    if reason:
        assert f"{ranks} local ranks" in reason and f"{gpus} GPU" in reason


@pytest.mark.parametrize("ranks, gpus", [(2, 1), (4, 2), (1, 0)])
def test_cuda_with_too_few_gpus_names_both_counts(ranks, gpus):
    with pytest.raises(ConfigError) as err:
        choose_device("cuda", local_ranks=ranks, gpus=gpus)
    assert err.value.field == "device"
    assert "--device" in str(err.value) and f"{ranks} local ranks" in str(err.value)
    assert f"{gpus} GPU" in str(err.value)


def _gpus(monkeypatch, n: int) -> list[int]:
    """Pretend ``n`` GPUs are visible; return the list of set_device calls."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def test_pick_device_one_gpu_two_ranks_is_cpu_with_one_line(monkeypatch, caplog):
    calls = _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        with caplog.at_level(logging.WARNING, logger="trainmesh"):
            assert pick_device("auto") == torch.device("cpu")
    assert calls == []                                  # no set_device(1) on a 1-GPU machine
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "2 local ranks" in lines[0] and "1 GPU" in lines[0], lines


def test_pick_device_one_gpu_per_rank(monkeypatch):
    calls = _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device("auto") == torch.device("cuda", 1)
    assert calls == [1]


def test_python_api_refuses_cuda_before_joining(monkeypatch):
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 local ranks"):
        init_distributed(device="cuda")


@pytest.mark.timeout(60)
def test_cli_cuda_with_too_few_gpus_exits_2_before_workers(monkeypatch, capsys):
    _gpus(monkeypatch, 1)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    launched = []
    monkeypatch.setattr("trainmesh.run.launch.launch_local", lambda *a, **k: launched.append(a) or 0)
    assert main(["train", "--device", "cuda", "--dp", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device" in err[0] and "2 local ranks" in err[0] and "1 GPU" in err[0], err
    assert launched == []
