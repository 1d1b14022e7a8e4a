"""docs/ stays true to the code: docs/api.md has a section for every public name with the parameters the code
has, and the integration guide's example runs and its CUDA-graph path matches an eager step and dense
attention."""

from __future__ import annotations

import enum
import importlib
import inspect
import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
MODULES = ("pagedmla", "pagedmla.engine", "pagedmla.model")
HEADING = re.compile(r"^#{3,4} `([\w.]+)(?:\((.*)\))?`$", re.M)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _documented() -> dict[str, str | None]:
    return {name: params for name, params in HEADING.findall((DOCS / "api.md").read_text())}


def _param_names(params: str) -> list[str]:
    """Names in a documented parameter list ("a, b=1, *, c=None, **kw"), defaults dropped."""
    names = []
    for part in re.split(r",\s*(?![^()\[\]]*[)\]])", params):
        name = part.split("=")[0].strip().lstrip("*")
        if name:
            names.append(name)
    return names


def test_every_public_name_has_a_section():
    documented = _documented()
    for module in MODULES:
        for name in importlib.import_module(module).__all__:
            assert f"{module}.{name}" in documented, f"docs/api.md lacks a section for {module}.{name}"


def test_every_section_names_something_real_with_its_parameters():
    for dotted, params in _documented().items():
        obj = _resolve(dotted)
        if isinstance(obj, type) and issubclass(obj, (enum.Enum, BaseException)) or isinstance(obj, str):
            assert not params, dotted
            continue
        actual = [p.name for p in inspect.signature(obj).parameters.values() if p.name != "self"]
        assert _param_names(params) == actual, f"{dotted}: docs/api.md lists {_param_names(params)}, code {actual}"


def test_integration_guide_example_runs_and_the_graph_path_matches(capsys):
    guide = (DOCS / "integration.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "docs/integration.md", "exec"), scope)
    assert "graph replay vs eager decode" in capsys.readouterr().out
    assert scope["max_diff"] <= 1e-6
    # Both paths attend over what the cache holds: check the eager output against dense attention.
    cfg, cache, table = scope["cfg"], scope["cache"], scope["table"]
    for i, (slot, n) in enumerate(zip(scope["slots"], scope["lens"])):
        rows = cache.gather(0, table.token_slots(slot, 0, n)).double()
        scores = torch.einsum("hd,nd->hn", scope["q"][i].double(), rows) * cfg.softmax_scale
        ref = torch.einsum("hn,nd->hd", scores.softmax(-1), rows[:, : cfg.kv_lora_rank])
        got = scope["eager"][i].double().view(cfg.num_local_heads, cfg.kv_lora_rank)
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    # Every backend method the guide names exists.
    backend_type = type(scope["backend"])
    for name in set(re.findall(r"backend\.(\w+)\(", guide)):
        assert callable(getattr(backend_type, name, None)), name
