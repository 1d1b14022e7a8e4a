"""The loader under hostile and broken checkpoint directories: shard names that leave the directory, sizes
that cannot fit, fields of the wrong type, corrupt shards. Each gives one line naming the field or the
file (ValueError; ``pagedmla generate`` exits with status 2), before anything large is built; symlinked
shards, as the Hugging Face cache lays them out, still load."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from pagedmla.cli import main
from pagedmla.engine import LLM
from pagedmla.model import DeepseekConfig, load_checkpoint, load_model
from pagedmla.model.config import TINY_CONFIG

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def weights(tiny, tmp_path_factory):
    """The tiny model saved as one safetensors file (shared, read-only, by every case)."""
    path = tmp_path_factory.mktemp("weights") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, path)
    return path


def _checkpoint(root, weights, config=None, shards=None, index=None):
    """A checkpoint directory under ``root``: ``config`` (default the tiny model's), ``shards`` (file name ->
    bytes, or None for a directory; default a symlink to ``weights``) and an optional ``index`` (a dict
    dumped as JSON, or raw bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(dict(TINY_CONFIG, dtype="float32") if config is None else config))
    if shards is None:
        os.symlink(weights, root / "model.safetensors")
    for name, blob in (shards or {}).items():
        if blob is None:
            (root / name).mkdir()
        else:
            (root / name).write_bytes(blob)
    if index is not None:
        (root / INDEX).write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    return root


def _cli_error(capsys, path) -> str:
    """``pagedmla generate --model path``: must exit with status 2 and one line; returns the line."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(path), "--prompt", "1 2 3", "--max-new-tokens", "2", "--device", "cpu"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("pagedmla generate: error: ")
    return lines[0].removeprefix("pagedmla generate: error: ")


def _state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------------------- shard names
def test_hub_cache_layout_with_symlinked_shards_loads(tiny, tmp_path):
    """A Hugging Face cache snapshot: every file of snapshots/<rev>/ is a symlink to a blob outside it
    (../../blobs/<hash>), the index included; the names in the index are plain file names."""
    state = {k: v.contiguous() for k, v in tiny.state_dict().items()}
    names = sorted(state)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for i, part in enumerate(shards.values()):
        save_file({n: state[n] for n in part}, blobs / f"blob{i}")
    (blobs / "index").write_text(json.dumps({"weight_map": {n: s for s, part in shards.items() for n in part}}))
    (blobs / "config").write_text(json.dumps(dict(TINY_CONFIG, dtype="float32")))
    snapshot = tmp_path / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    links = {"config.json": "config", INDEX: "index", **{s: f"blob{i}" for i, s in enumerate(shards)}}
    for name, blob in links.items():
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    assert _state_equal(load_checkpoint(snapshot), tiny)
    os.remove(snapshot / INDEX)  # the same shards found by listing the directory
    assert _state_equal(load_checkpoint(snapshot), tiny)


@pytest.mark.parametrize("shard", [
    "../outside/evil.safetensors", "ABSOLUTE", "sub/../../outside/evil.safetensors", "..\\outside\\evil.safetensors",
    "", 17, "evil\0.safetensors",
], ids=["dotdot", "absolute", "inner_dotdot", "backslash_dotdot", "empty", "not_a_string", "nul"])
def test_shard_names_outside_the_directory_are_refused(weights, tmp_path, capsys, shard):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(weights, outside / "evil.safetensors")  # a loadable file: only the name check stops it
    if shard == "ABSOLUTE":
        shard = str(outside / "evil.safetensors")
    names = list(load_model("tiny").state_dict())
    ckpt = _checkpoint(tmp_path / "ckpt", weights, shards={}, index={"weight_map": {n: shard for n in names}})
    with pytest.raises(ValueError, match=r"^path: .*model\.safetensors\.index\.json names shard .* relative paths"):
        load_checkpoint(ckpt)
    assert str(ckpt / INDEX) in _cli_error(capsys, ckpt)


def test_a_symlinked_shard_named_plainly_may_point_anywhere(tiny, weights, tmp_path):
    """The name is judged, not where a symlink leads: the index names model.safetensors, a link to a file
    outside the directory."""
    names = list(tiny.state_dict())
    ckpt = _checkpoint(tmp_path / "ckpt", weights, index={"weight_map": {n: "model.safetensors" for n in names}})
    assert os.path.islink(ckpt / "model.safetensors")
    assert _state_equal(load_checkpoint(ckpt), tiny)


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(("field", "value"), [
    ("num_hidden_layers", 10 ** 9), ("vocab_size", 10 ** 12), ("n_routed_experts", 10 ** 7),
    ("hidden_size", 10 ** 8), ("moe_intermediate_size", 10 ** 10),
])
def test_weights_that_cannot_fit_name_the_field(weights, tmp_path, capsys, field, value):
    """Refused from the config alone, in closed form (10**9 layers used to hang building the model)."""
    ckpt = _checkpoint(tmp_path, weights, config=dict(TINY_CONFIG, dtype="float32", **{field: value}))
    message = _cli_error(capsys, ckpt)
    assert message.startswith(f"{field}: the model's weights in float32 need about ")
    assert f"{field}={value}" in message and message.endswith(f"(in {ckpt / 'config.json'})")


def test_a_context_that_cannot_fit_names_the_field(tiny, weights, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, weights, config=dict(TINY_CONFIG, dtype="float32", max_position_embeddings=10 ** 12))
    message = _cli_error(capsys, ckpt)
    assert message.startswith("max_position_embeddings: the KV cache and its page tables need about ")
    assert "set max_context_len" in message
    for kwargs, field in ((dict(num_pages=10 ** 12), "num_pages"), (dict(max_context_len=10 ** 13), "max_context_len")):
        with pytest.raises(ValueError, match=f"^{field}: the KV cache and its page tables need about "):
            LLM(tiny, page_size=16, provider="torch", **kwargs)


def test_the_weight_estimate_counts_the_layers_built(tiny):
    """weight_bytes is the exact size of the built model (absorbed copies included), and its closed-form
    count of MoE layers agrees with is_moe_layer for random layouts."""
    built = sum(t.numel() * t.element_size() for t in tiny.state_dict().values())
    built += sum(b.numel() * b.element_size() for n, b in tiny.named_buffers() if n.endswith(("w_uk", "w_uv")))
    assert tiny.config.weight_bytes(4) == built
    rng = random.Random(0)
    for _ in range(200):
        cfg = DeepseekConfig.from_dict(dict(TINY_CONFIG, num_hidden_layers=rng.randint(1, 40),
                                            first_k_dense_replace=rng.randint(0, 10), moe_layer_freq=rng.randint(1, 5)))
        assert cfg.num_moe_layers == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


# ---------------------------------------------------------------------------------------------- types
@pytest.mark.parametrize(("edit", "field"), [
    ({"hidden_size": "abc"}, "hidden_size"),
    ({"num_attention_heads": [4]}, "num_attention_heads"),
    ({"vocab_size": 512.5}, "vocab_size"),
    ({"vocab_size": True}, "vocab_size"),
    ({"num_hidden_layers": -3}, "num_hidden_layers"),
    ({"max_position_embeddings": 2 ** 70}, "max_position_embeddings"),
    ({"q_lora_rank": {"a": 1}}, "q_lora_rank"),
    ({"quantization_config": "fp8"}, "quantization_config"),
    ({"attention_bias": "false"}, "attention_bias"),
    ({"rms_norm_eps": "abc"}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id"),
    ({"bos_token_id": 1.5}, "bos_token_id"),
    ({"n_shared_experts": "1"}, "n_shared_experts"),
    ({"topk_method": 3}, "topk_method"),
    ({"hidden_act": ["silu"]}, "hidden_act"),
    ({"rope_parameters": "yarn"}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 0}}, "factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4, "beta_fast": "fast"}}, "beta_fast"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4, "truncate": 1}}, "truncate"),
    ({"rope_interleave": "yes"}, "rope_interleave"),
    ({"dtype": 7}, "dtype"),
    ({"dtype": "float64"}, "dtype"),
    ({"dtype": None, "torch_dtype": "int8"}, "torch_dtype"),
])
def test_config_fields_of_the_wrong_type_or_range_name_field_and_file(weights, tmp_path, capsys, edit, field):
    ckpt = _checkpoint(tmp_path, weights, config={**TINY_CONFIG, "dtype": "float32", **edit})
    with pytest.raises(ValueError, match=f"^{field}: ") as exc:
        DeepseekConfig.from_file(ckpt)
    assert str(exc.value).endswith(f"(in {ckpt / 'config.json'})") and "\n" not in str(exc.value)
    assert _cli_error(capsys, ckpt) == str(exc.value)


@pytest.mark.parametrize(("text", "pattern"), [
    ("{not json", "is not valid JSON"), ("[1, 2]", "expected a mapping"), ("\xff\xfe", "is not valid JSON"),
])
def test_a_config_that_is_not_a_json_object_names_the_file(weights, tmp_path, capsys, text, pattern):
    ckpt = _checkpoint(tmp_path, weights)
    (ckpt / "config.json").write_bytes(text.encode("latin-1"))
    message = _cli_error(capsys, ckpt)
    assert message.startswith("config: ") and pattern in message and str(ckpt / "config.json") in message


# ---------------------------------------------------------------------------------------------- corrupt shards
def _corrupt(weights) -> dict[str, bytes | None]:
    data = weights.read_bytes()
    return {
        "truncated": data[: len(data) // 2],
        "header_only": data[: 8 + struct.unpack("<Q", data[:8])[0]],
        "garbage": random.Random(0).randbytes(4096),
        "header_length_2_62": struct.pack("<Q", 1 << 62) + b"{}",
        "empty": b"",
        "bad_header_json": struct.pack("<Q", 5) + b"{abc}",
        "directory": None,
    }


@pytest.mark.parametrize("indexed", [False, True], ids=["listed", "indexed"])
@pytest.mark.parametrize("kind", ["truncated", "header_only", "garbage", "header_length_2_62", "empty",
                                  "bad_header_json", "directory"])
def test_corrupt_shards_name_the_file(tiny, weights, tmp_path, capsys, kind, indexed):
    blob = _corrupt(weights)[kind]
    index = {"weight_map": {n: "model.safetensors" for n in tiny.state_dict()}} if indexed else None
    ckpt = _checkpoint(tmp_path, weights, shards={"model.safetensors": blob}, index=index)
    with pytest.raises(ValueError, match="^path: ") as exc:
        load_checkpoint(ckpt)
    assert str(ckpt / "model.safetensors") in str(exc.value) and "\n" not in str(exc.value)
    # The command line names the checkpoint path by its flag.
    assert _cli_error(capsys, ckpt) == "--model: " + str(exc.value).removeprefix("path: ")


@pytest.mark.parametrize(("index", "pattern"), [
    (b"{not json", "is not a JSON object with a weight_map"),
    (b"[1]", "is not a JSON object with a weight_map"),
    (b'{"weight_map": ["a"]}', "has no weight_map"),
    (b'{"weight_map": {"model.norm.weight": "missing.safetensors"}}', "missing.safetensors named in .* is missing"),
])
def test_a_broken_index_names_the_file(weights, tmp_path, capsys, index, pattern):
    ckpt = _checkpoint(tmp_path, weights, index=index)
    message = _cli_error(capsys, ckpt)
    assert message.startswith("--model: ") and str(ckpt / INDEX) in message
    assert re.search(pattern, message), message
