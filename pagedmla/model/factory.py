"""One entry point for models: the built-in ``tiny`` random model or a checkpoint directory."""

from __future__ import annotations

import os

import torch

from pagedmla.config import resolve_dtype
from pagedmla.model.build import build_empty
from pagedmla.model.config import DeepseekConfig, tiny_config
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.loader import load_checkpoint, load_mtp_checkpoint
from pagedmla.model.mtp import DeepseekMTP, build_empty_mtp
from pagedmla.model.random_weights import init_random_
from pagedmla.parallel import SINGLE, Group

TINY = "tiny"


def default_dtype(device: torch.device, checkpoint_dtype: str | None = None) -> torch.dtype:
    """The checkpoint's dtype when it names one, else bfloat16 on CUDA and float32 elsewhere."""
    if checkpoint_dtype:
        return resolve_dtype(checkpoint_dtype, "dtype")
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(model: str | os.PathLike = TINY, *, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = None, seed: int = 0, tp: Group = SINGLE) -> DeepseekForCausalLM:
    """``"tiny"`` (random weights from ``seed``) or a Hugging Face checkpoint directory, on ``device``; under
    ``tp`` (a ``pagedmla.parallel.Group``) this rank's tensor-parallel slices of it.

    dtype: bfloat16 / float16 / float32 (or their names); None picks default_dtype()."""
    device = torch.device(device)
    if isinstance(model, str) and model == TINY:
        dt = resolve_dtype(dtype, "dtype") if dtype is not None else default_dtype(device)
        return init_random_(build_empty(tiny_config(), device, dt, tp), seed)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model: expected 'tiny' or a checkpoint directory, got {type(model).__name__}")
    if not os.path.isdir(model):
        raise ValueError(f"model: {os.fspath(model)!r} is neither 'tiny' nor a checkpoint directory")
    if dtype is None:
        dt = default_dtype(device, DeepseekConfig.from_file(model).dtype)
    else:
        dt = resolve_dtype(dtype, "dtype")
    return load_checkpoint(model, device=device, dtype=dt, tp=tp)


def load_mtp(target: DeepseekForCausalLM, model: str | os.PathLike = TINY, *, seed: int = 0) -> DeepseekMTP:
    """The MTP layers (the draft model of MTP speculative decoding) of ``model``, the "tiny" model (random
    weights from ``seed``) or the checkpoint directory that ``target`` was loaded from, on the target's
    device in its dtype, sharing its embedding and LM head (CheckpointError when the checkpoint has none)."""
    if not isinstance(target, DeepseekForCausalLM):
        raise TypeError(f"target: expected a DeepseekForCausalLM, got {type(target).__name__}")
    if target.tp.size > 1:
        raise ValueError(f"target: MTP layers are built whole, for a single-rank target; this one is split over "
                         f"{target.tp.size} tensor-parallel ranks")
    weight = target.model.embed_tokens.weight
    if isinstance(model, str) and model == TINY:
        mtp = build_empty_mtp(target.config, weight.device, weight.dtype)
        mtp.share_with(target)
        return init_random_(mtp, seed)
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is neither 'tiny' nor a checkpoint directory")
    return load_mtp_checkpoint(model, target, device=weight.device, dtype=weight.dtype)
