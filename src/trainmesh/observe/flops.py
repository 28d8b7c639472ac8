"""Model FLOPs utilisation (MFU): the model's FLOPs per token and the device's peak.

MFU = achieved model FLOP/s / peak FLOP/s of the devices (PaLM, appendix B):

    mfu = tokens_per_s * flops_per_token / (world_size * peak_flops_per_device)

``flops_per_token`` counts one forward and one backward of the model, never recomputation
(that would be hardware FLOPs). For a decoder the count is ``6N + 12·L·s·d``: 6 FLOPs per
parameter and token (2 forward, 4 backward) plus attention's score and value products
(``2·2·s·d`` per layer and token forward, doubled backward). The built-in GPT reports it through
``flops_per_token()``; another model passes its own number to the Engine.

Packed documents (``--documents packed``): a token attends only its own document, so the
attention term is counted over the documents, not the whole sequence: ``s`` becomes the keys
a token spans on average, ``Σ L² / Σ L`` over the documents (and pieces) of the step's global
batch (:func:`document_len`; a whole sequence is one document, ``s``). The per-step MFU of a
packed run uses the step's own batch (:func:`packed_flops_per_token`).

The peak comes from ``--peak-tflops``, else the ``--gpu`` row of the accelerator table
(:data:`trainmesh.core.gpus.GPUS`: dense data-sheet figures per precision; fp32 is the plain
rate, trainmesh leaves TF32 matmuls off), else the row of the detected CUDA device. CPUs have no
row: their MFU is null unless a peak is given.
"""
from __future__ import annotations

from typing import Any


def transformer_flops_per_token(n_params: int, n_layers: int, seq_len: float, d_model: int) -> float:
    """Training FLOPs per token of a decoder: ``6N + 12·L·s·d`` (forward + backward); ``s``:
    the keys a token attends (:func:`document_len` for packed documents)."""
    return 6.0 * n_params + 12.0 * n_layers * seq_len * d_model


def document_len(position_ids: Any) -> float:
    """``Σ L² / Σ L`` over the documents of a (rows, s) ``position_ids`` batch (positions
    restarting at 0 at each document): the mean length of a token's document, the keys its
    attention spans (``s`` for rows of one document each)."""
    import torch
    starts = (position_ids == 0).reshape(-1)
    lengths = torch.diff(torch.nonzero(starts).flatten(), append=torch.tensor([starts.numel()]))
    # a row always starts with a document, so the run from one start to the next is one document
    return float((lengths.double() ** 2).sum() / starts.numel())


def packed_flops_per_token(flops_per_token: float | None, *, n_layers: int, seq_len: int,
                           d_model: int, attended: float | None) -> float | None:
    """A ``6N + 12·L·s·d`` count with its attention term moved from the whole sequence
    (``seq_len``) to the ``attended`` keys of a packed step (:func:`document_len`; None: the
    count unchanged)."""
    if flops_per_token is None or attended is None:
        return flops_per_token
    return flops_per_token - 12.0 * n_layers * d_model * (seq_len - attended)


def model_flops_per_token(model: Any, given: float | None = None) -> float | None:
    """``given``, else the model's own ``flops_per_token()``, else None (MFU unknown)."""
    if given is not None:
        return float(given)
    own = getattr(model, "flops_per_token", None)
    return float(own()) if callable(own) else None


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Dense peak TFLOP/s of one device named ``device_name`` (``torch.cuda.get_device_name``)
    in ``precision``; None when unknown (CPUs, unlisted GPUs or precisions)."""
    from trainmesh.core.gpus import detect
    row = detect(device_name)
    return row.peak(precision) if row is not None else None


def device_peak_tflops(device: Any, precision: str, given: float | None = None,
                       gpu: str | None = None) -> float | None:
    """The peak of one device for MFU: ``given`` (``--peak-tflops``), else the ``gpu`` row
    (``--gpu``), else the table's row for this CUDA device, else None (CPU)."""
    if given is not None:
        return given
    if gpu is not None:
        from trainmesh.core.gpus import gpu as gpu_row
        return gpu_row(gpu).peak(precision)
    if getattr(device, "type", None) != "cuda":
        return None
    import torch
    return peak_tflops(torch.cuda.get_device_name(device), precision)


def mfu(tokens_per_s: float, flops_per_token: float | None, peak_tflops_per_device: float | None,
        world_size: int) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None when the FLOPs or the peak are unknown)."""
    if flops_per_token is None or not peak_tflops_per_device:
        return None
    return tokens_per_s * flops_per_token / (world_size * peak_tflops_per_device * 1e12)
