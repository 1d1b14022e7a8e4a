"""The public scheduling calls of paged decode: FlashMLA's ``get_mla_metadata`` and its into-buffers form.

``pagedmla/split_plan.py`` documents the plan and the metadata layout; these calls check their arguments
and fill the metadata on the device: on CUDA by one Triton launch (``kernels/triton/metadata.py``) except
while a CUDA graph is being captured, elsewhere (and then) with the plan's tensor ops.
"""

from __future__ import annotations

import torch

from pagedmla.kv_format import is_fp8, resolve_format
from pagedmla.split_plan import METADATA_WIDTH, num_sm_parts_for, overhead_blocks, plan_into


def get_mla_metadata(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
    *,
    num_sm_parts: int | None = None,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's scheduling call: returns (tile_scheduler_metadata, num_splits), both int32 on the device.

    cache_seqlens: int32 [bs] KV lengths (this step's tokens included);
    num_q_tokens_per_head_k: q_len * num_heads_q // num_heads_k; num_heads_k: KV heads (1 for MLA);
    num_sm_parts: see below; kv_format: the format of the cache the schedule is for (a name of
    ``pagedmla.kv_format.resolve_format``; None, "bf16" and "fp16" plan alike), so that the part count
    follows the kernel that format runs: on sm_90 an fp8_e4m3 cache's requests of up to 16 query rows get
    two parts per SM (the portable kernel), every other request of up to 32 rows one (``split_plan``'s
    ``tile_plan``). Any schedule serves any call with these lengths; a mismatched one only runs slower.
    The default cuts the work into ``num_sm_parts_for`` parts, each at least ``min_part_units`` long (a small
    batch leaves the last parts idle); ``num_sm_parts`` cuts it into exactly that many equal parts instead
    (FlashMLA's rule; tests use it to force splits on small problems). No host synchronisation: safe to
    call while capturing a CUDA graph (during a capture the tensor-op version runs, so that a first call
    never has to compile and load the Triton kernel inside it).
    """
    if torch.compiler.is_dynamo_compiling():
        # The custom op ops/library.py registers (by name: that module imports this one).
        return torch.ops.pagedmla.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_sm_parts,
                                                   kv_format)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"cache_seqlens: expected an int32 1-D tensor, got {cache_seqlens.dtype} "
                         f"shape {tuple(cache_seqlens.shape)}")
    for name, value in (("num_q_tokens_per_head_k", num_q_tokens_per_head_k), ("num_heads_k", num_heads_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    dev = cache_seqlens.device
    fmt = plan_format(kv_format)
    default_plan = num_sm_parts is None
    parts = num_sm_parts_for(dev, num_q_tokens_per_head_k, num_heads_k, fmt) if default_plan else num_sm_parts
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"num_sm_parts: expected a positive int, got {parts!r}")
    bs = cache_seqlens.shape[0]
    metadata = torch.empty(parts, METADATA_WIDTH, dtype=torch.int32, device=dev)
    num_splits = torch.empty(bs + 1, dtype=torch.int32, device=dev)
    _fill(cache_seqlens, metadata, num_splits, overhead_blocks(num_q_tokens_per_head_k), default_plan)
    return metadata, num_splits


def schedule_into(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor,
                  num_q_tokens_per_head_k: int, default_plan: bool = False) -> None:
    """``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, 1, num_sm_parts=metadata.shape[0])`` into
    given buffers (CUDA-graph state): int32 ``cache_seqlens`` [bs], ``metadata`` int32 [parts,
    METADATA_WIDTH] and ``num_splits`` int32 [bs + 1], all on one device, the buffers contiguous;
    ``default_plan`` gives the default plan's parts instead, at least ``min_part_units`` long (with
    ``metadata.shape[0]`` from ``num_sm_parts_for``, the default ``get_mla_metadata``). No host
    synchronisation."""
    if isinstance(num_q_tokens_per_head_k, bool) or not isinstance(num_q_tokens_per_head_k, int) \
            or num_q_tokens_per_head_k < 1:
        raise ValueError(f"num_q_tokens_per_head_k: expected a positive int, got {num_q_tokens_per_head_k!r}")
    for name, x in (("cache_seqlens", cache_seqlens), ("metadata", metadata), ("num_splits", num_splits)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.device != cache_seqlens.device:
            raise ValueError(f"{name}: expected an int32 tensor on {cache_seqlens.device}")
    bs = cache_seqlens.shape[0] if cache_seqlens.dim() == 1 else -1
    if bs < 0:
        raise ValueError(f"cache_seqlens: expected a 1-D tensor, got shape {tuple(cache_seqlens.shape)}")
    if metadata.dim() != 2 or metadata.shape[1] != METADATA_WIDTH or metadata.shape[0] < 1 \
            or not metadata.is_contiguous():
        raise ValueError(f"metadata: expected a contiguous [parts >= 1, {METADATA_WIDTH}] tensor, "
                         f"got shape {tuple(metadata.shape)}")
    if num_splits.shape != (bs + 1,) or not num_splits.is_contiguous():
        raise ValueError(f"num_splits: expected a contiguous [{bs + 1}] tensor, got shape {tuple(num_splits.shape)}")
    _fill(cache_seqlens, metadata, num_splits, overhead_blocks(num_q_tokens_per_head_k), bool(default_plan))


def _fill(cache_seqlens: torch.Tensor, metadata: torch.Tensor, num_splits: torch.Tensor, overhead: int,
          default_plan: bool) -> None:
    """The plan into checked buffers: one Triton launch on CUDA outside a capture (during one the tensor-op
    version runs, so that a first call never compiles and loads the kernel inside it), else the tensor ops."""
    if cache_seqlens.shape[0] and cache_seqlens.is_cuda and not torch.cuda.is_current_stream_capturing():
        # Imported on the first CUDA call: Triton's import (~0.3 s) is not paid by CPU-only processes.
        from pagedmla.kernels.triton.metadata import schedule_into as launch

        launch(cache_seqlens.contiguous(), metadata, num_splits, overhead, default_plan)
        return
    plan_into(cache_seqlens, metadata, num_splits, overhead, default_plan)


def plan_format(kv_format) -> str | None:
    """The FP8 format a schedule plans for: ``kv_format`` resolved (``pagedmla.kv_format.resolve_format``,
    ValueError naming ``kv_format`` for an unknown one), None for a 16-bit cache or None."""
    if kv_format is None:
        return None
    fmt = resolve_format(kv_format)
    return fmt if is_fp8(fmt) else None
