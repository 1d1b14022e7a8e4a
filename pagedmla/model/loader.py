"""Load a Hugging Face DeepSeek-V2/V3 checkpoint directory: config.json + safetensors shards.

Accepted layouts: one or more ``*.safetensors`` files with or without ``model.safetensors.index.json``;
routed experts either per expert (``mlp.experts.N.{gate,up,down}_proj.weight``, the hub checkpoints and
what transformers' ``save_pretrained`` writes) or stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I], transformers' in-memory layout). Tensors in bf16/fp16/fp32 are cast
to the model dtype (routers stay float32). Multi-token-prediction layers (indices >= num_hidden_layers)
are skipped by ``load_checkpoint`` and loaded by ``load_mtp_checkpoint``. A missing, mis-shaped,
unexpected or non-float tensor raises ValueError naming it.

A tensor-parallel rank (``tp``) reads only its slices of the sharded tensors (``Shard``: safetensors'
``get_slice`` maps just those bytes), whole the tensors every rank holds.

Hostile or broken directories fail in one line (CheckpointError, a ValueError) naming the file: every
shard name in the index must be a relative path inside the checkpoint directory (no absolute names, no
``..`` components); the name is what is judged, so symlinked shards load wherever they point (the
Hugging Face cache links a snapshot's files to blobs outside it). An unreadable, truncated or corrupt
shard, or a directory where a shard should be, names the shard. The config is checked field by field
(``DeepseekConfig.from_file``) and the weights' size against the device's memory before anything is
built.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from pagedmla.model.build import build_empty
from pagedmla.model.config import CheckpointError, DeepseekConfig, one_line
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.memory import check_fits
from pagedmla.model.mtp import SHARED_TENSORS, DeepseekMTP, build_empty_mtp, mtp_weight_bytes
from pagedmla.model.parallel import Shard, shard_specs
from pagedmla.parallel import SINGLE, Group

_INDEX = "model.safetensors.index.json"
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class _Checkpoint:
    """Name -> shard lookup over the safetensors files of one directory, opened lazily."""

    def __init__(self, path: str, stack: ExitStack):
        self.path = path
        self._stack = stack
        self._handles: dict[str, object] = {}
        index = os.path.join(path, _INDEX)
        if os.path.isfile(index):
            self.files = {name: self._shard_path(shard, index) for name, shard in _weight_map(index).items()}
            for shard in sorted(set(self.files.values())):
                if not os.path.exists(shard):
                    raise CheckpointError(f"path: shard {os.path.relpath(shard, path)} named in {index} is missing")
                if not os.path.isfile(shard):
                    raise CheckpointError(f"path: shard {shard} named in {index} is not a file")
        else:
            shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"path: no *.safetensors files in {path}")
            self.files = {}
            for shard in shards:
                full = os.path.join(path, shard)
                if not os.path.isfile(full):
                    raise CheckpointError(f"path: {full} is not a file")
                for name in self._open(full).keys():
                    self.files[name] = full
        self.used: set[str] = set()

    def _shard_path(self, shard: object, index: str) -> str:
        """The file a shard name of the index names: a relative path that stays inside the checkpoint
        directory by its components (symlinks are followed later, wherever they lead)."""
        parts = shard.replace("\\", "/").split("/") if isinstance(shard, str) else []
        if not parts or not shard or os.path.isabs(shard) or "\0" in shard or ".." in parts:
            raise CheckpointError(f"path: {index} names shard {shard!r}; shard names must be relative paths "
                                  "inside the checkpoint directory (no absolute path, no '..')")
        return os.path.join(self.path, *parts)

    def _open(self, file: str):
        if file not in self._handles:
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise _unreadable(file, exc) from None
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...], shard: Shard | None = None) -> torch.Tensor:
        """The tensor ``name`` after checking it exists, has ``shape`` and a float dtype; with ``shard``, only
        that slice of it is read."""
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.path}: missing tensor {name!r} (expected shape {list(shape)})")
        file = self.files[name]
        handle = self._open(file)
        try:
            view = handle.get_slice(name)
            actual = tuple(view.get_shape())
            if actual != tuple(shape):
                raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} has shape {list(actual)}, "
                                      f"the model expects {list(shape)}")
            if shard is None:
                tensor = handle.get_tensor(name)
            else:
                def read(start: int, end: int) -> torch.Tensor:
                    index = [slice(None)] * len(shape)
                    index[shard.dim] = slice(start, end)
                    return view[tuple(index)]

                tensor = shard.assemble(read)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise _unreadable(file, exc, name) from None
        if tensor.dtype not in _FLOAT:
            raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} has dtype {tensor.dtype}; "
                                  "expected bfloat16, float16 or float32")
        self.used.add(name)
        return tensor


def _weight_map(index: str) -> dict[str, str]:
    """The tensor name -> shard name map of an index file (CheckpointError naming the file otherwise)."""
    try:
        with open(index, "rb") as f:
            weight_map = json.load(f).get("weight_map")
    except OSError as exc:
        raise _unreadable(index, exc) from None
    except (ValueError, AttributeError) as exc:  # not JSON, or not a JSON object
        raise CheckpointError(f"path: {index} is not a JSON object with a weight_map: {one_line(exc)}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise CheckpointError(f"path: {index} has no weight_map of tensor names to shard names")
    return weight_map


def _unreadable(file: str, exc: BaseException, tensor: str | None = None) -> CheckpointError:
    """One line naming ``file`` (and ``tensor``) for an OS or safetensors error reading it."""
    what = f"tensor {tensor!r} of " if tensor else ""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
    verdict = "; it is not a complete safetensors file" if isinstance(exc, SafetensorError) else ""
    return CheckpointError(f"path: cannot read {what}{file}: {reason} ({type(exc).__name__}){verdict}")


def load_checkpoint(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, tp: Group = SINGLE) -> DeepseekForCausalLM:
    """Build the model described by ``path/config.json`` and fill it from the directory's safetensors;
    under ``tp`` this rank's slices of it, read alone.

    CheckpointError (one line naming the field or file) for a broken or hostile directory, and for a model
    whose weights would not fit in the device's available memory (naming the field that makes them so
    large); ValueError naming the field ``tp`` cannot split."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"path: {path!r} is not a checkpoint directory")
    cfg = DeepseekConfig.from_file(path)
    device = torch.device(device)
    field = cfg.largest_size_field(dtype.itemsize)
    what = f"the model's weights in {str(dtype).replace('torch.', '')}"
    cfg.check_tensor_parallel(tp.size)
    check_fits(cfg.weight_bytes(dtype.itemsize, tp.size), field, getattr(cfg, field), device, what,
               f" (in {os.path.join(path, 'config.json')})", error=CheckpointError)
    model = build_empty(cfg, device, dtype, tp)
    slices = shard_specs(model) if tp.size > 1 else {}
    with ExitStack() as stack, torch.no_grad():
        ckpt = _Checkpoint(path, stack)
        shards = len(set(ckpt.files.values()))
        # Shown on a terminal only, and only once loading has taken a second (the hub checkpoints take minutes).
        tensors = tqdm(model.state_dict().items(), desc=f"loading {shards} shard(s)", unit="tensor", delay=1.0,
                       disable=None)
        for name, target in tensors:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                ckpt.used.add(name)
                continue
            _fill(ckpt, name, target, slices.get(name))
        _check_unexpected(ckpt, cfg)
    model.absorb_weights()
    return model


def _fill(ckpt: _Checkpoint, name: str, target: torch.Tensor, shard: Shard | None = None) -> None:
    """Copy the checkpoint's tensor ``name`` (this rank's slice of it under ``shard``) into ``target``
    (stacked experts from per-expert tensors when the checkpoint has those)."""
    stacked = _STACKED.match(name)
    if stacked and name not in ckpt:
        _load_per_expert(ckpt, stacked.group(1), stacked.group(2), target, shard)
    else:
        shape = tuple(target.shape) if shard is None else shard.full_shape(target.shape)
        target.copy_(ckpt.get(name, shape, shard))


def load_mtp_checkpoint(path: str | os.PathLike, target: DeepseekForCausalLM, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> DeepseekMTP:
    """The MTP layers of the checkpoint at ``path`` (``num_nextn_predict_layers`` in its config.json), for
    ``target``, the model ``load_checkpoint`` loaded from it. Embedding and head are the target's where the
    checkpoint has none for a layer or has equal ones (DeepSeek-V3 stores copies), the checkpoint's own
    otherwise. CheckpointError naming the field or tensor for a config without MTP layers, a missing,
    mis-shaped or unexpected tensor of those layers, or layers too large for the device."""
    path = os.fspath(path)
    cfg = DeepseekConfig.from_file(path)
    if cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(f"num_nextn_predict_layers: {os.path.join(path, 'config.json')} declares no MTP "
                              "layers, so this checkpoint has no draft model for speculative decoding")
    device = torch.device(device)
    check_fits(mtp_weight_bytes(cfg, dtype.itemsize), "num_nextn_predict_layers", cfg.num_nextn_predict_layers,
               device, f"the MTP layers' weights in {str(dtype).replace('torch.', '')}",
               f" (in {os.path.join(path, 'config.json')})", error=CheckpointError)
    mtp = build_empty_mtp(cfg, device, dtype)
    with ExitStack() as stack, torch.no_grad():
        ckpt = _Checkpoint(path, stack)
        for name, tensor in mtp.state_dict().items():
            if not name.endswith(SHARED_TENSORS):
                _fill(ckpt, mtp.checkpoint_name(name), tensor)
        for i, layer in enumerate(mtp.layers):
            own_embedding = _own_copy(ckpt, mtp.checkpoint_name(f"layers.{i}.{SHARED_TENSORS[0]}"),
                                      target.model.embed_tokens.weight)
            own_head = _own_copy(ckpt, mtp.checkpoint_name(f"layers.{i}.{SHARED_TENSORS[1]}"), target.lm_head.weight)
            # The checkpoint's own tensors become the layer's weights as they are (no second copy).
            layer.embed_tokens = target.model.embed_tokens if own_embedding is None else \
                nn.Embedding.from_pretrained(own_embedding)
            layer.shared_head.head = target.lm_head if own_head is None else _linear(own_head)
        prefixes = tuple(f"model.layers.{cfg.num_hidden_layers + i}." for i in range(len(mtp.layers)))
        extra = sorted(n for n in ckpt.files if n.startswith(prefixes) and n not in ckpt.used
                       and not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise CheckpointError(f"checkpoint {ckpt.path}: unexpected tensor(s) {', '.join(map(repr, extra[:5]))} "
                                  "in the MTP layers")
    mtp.absorb_weights()
    return mtp


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free linear layer whose weight is ``weight`` [out, in] (not copied)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def _own_copy(ckpt: _Checkpoint, name: str, shared: torch.Tensor) -> torch.Tensor | None:
    """The checkpoint's tensor ``name`` where it has one that differs from the target's ``shared`` tensor;
    None where the target's serves (absent, or equal after the cast to the model's dtype)."""
    if name not in ckpt:
        return None
    own = ckpt.get(name, tuple(shared.shape)).to(shared.device, shared.dtype)
    return None if torch.equal(own, shared) else own


def _load_per_expert(ckpt: _Checkpoint, prefix: str, kind: str, target: torch.Tensor, shard: Shard | None) -> None:
    """Fill a stacked expert tensor (this rank's slice of it under ``shard``) from
    ``prefix.N.{gate,up,down}_proj.weight``."""
    num_experts, rows, cols = target.shape
    for e in range(num_experts):
        if kind == "down_proj":
            piece = None if shard is None else Shard(1, shard.full, shard.rank, shard.size)
            full = (rows, cols) if shard is None else (rows, shard.full)
            target[e].copy_(ckpt.get(f"{prefix}.{e}.down_proj.weight", full, piece))
        else:
            inter = rows // 2
            piece = None if shard is None else Shard(0, shard.full, shard.rank, shard.size)
            full = (inter, cols) if shard is None else (shard.full, cols)
            target[e, :inter].copy_(ckpt.get(f"{prefix}.{e}.gate_proj.weight", full, piece))
            target[e, inter:].copy_(ckpt.get(f"{prefix}.{e}.up_proj.weight", full, piece))


def _check_unexpected(ckpt: _Checkpoint, cfg: DeepseekConfig) -> None:
    extra = []
    for name in ckpt.files:
        if name in ckpt.used or name.endswith("rotary_emb.inv_freq"):
            continue
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
            continue  # multi-token-prediction modules ride after the last layer
        extra.append(name)
    if extra:
        shown = ", ".join(repr(n) for n in sorted(extra)[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(f"checkpoint {ckpt.path}: unexpected tensor(s) {shown}{more} for a "
                              f"{cfg.model_type} config with {cfg.num_hidden_layers} layers")
