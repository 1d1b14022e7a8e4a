"""The README's API example runs as written, and its promised outputs hold."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert scope["out"].shape == (2, 1, 16, 512) and scope["lse"].shape == (2, 16, 1)
    assert scope["out2"].shape == (6, 16, 512)
    assert torch.isfinite(scope["out"]).all() and torch.isfinite(scope["merged"]).all()
    # Merging a state with itself leaves the values and adds ln 2 to the LSE.
    assert torch.allclose(scope["merged"], scope["o"], atol=1e-6)
    assert torch.allclose(scope["merged_lse"], scope["lse_hq"].T + torch.log(torch.tensor(2.0)), atol=1e-6)


def test_readme_engine_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "README lost its engine example"
    scope: dict = {}
    exec(compile(blocks[1], "README.md", "exec"), scope)
    assert len(scope["llm"].generate([[4, 5]], scope["SamplingParams"](max_tokens=3))[0].token_ids) == 3


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
