"""What a new user meets after ``pip install .`` without extras, in a fresh virtualenv: text in and text out on a
checkpoint that has only a tokenizer.json, ids through --prompt-ids, and a one-line error (not a traceback)
where an extra is missing.

torch, triton and numpy (and what they need) come from this test environment through a .pth file: a fresh
download of them costs about two minutes. pip installs everything else the package declares, so a core
dependency missing from pyproject.toml fails here, as does any import of transformers or matplotlib on the
paths a plain install runs.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from tiny_checkpoint import write_checkpoint

from pagedmla.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BORROWED = ("torch", "triton", "numpy")
EXTRAS = ("transformers", "matplotlib")


def _closure(names: tuple[str, ...]) -> set[str]:
    """Installed distributions ``names`` need at run time, themselves included."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _borrow(target: Path) -> None:
    """Symlink the files of BORROWED and their dependencies (packages and dist-info) into ``target``."""
    target.mkdir()
    for name in _closure(BORROWED):
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)


def _run(args: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONHOME")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(venv bin directory, work directory with a checkpoint ``ckpt`` holding only tokenizer.json as tokenizer)."""
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    borrowed = root / "borrowed"
    _borrow(borrowed)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (purelib / "borrowed.pth").write_text(f"{borrowed}\n")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "pagedmla", src / "pagedmla", ignore=shutil.ignore_patterns("__pycache__"))
    proc = _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", src], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for extra in EXTRAS:
        probe = _run([venv / "bin" / "python", "-c", f"import {extra}"], root)
        assert probe.returncode != 0, f"{extra} is importable in the fresh environment"
    write_checkpoint(root / "ckpt")
    return venv / "bin", root


def _expected(ckpt: Path, prompt) -> tuple[list[int], str | None]:
    llm = LLM(ckpt, device="cpu", page_size=16, max_context_len=64, provider="torch")
    out = llm.generate(prompt, SamplingParams(max_tokens=6))[0]
    return out.token_ids, out.text


GENERATE = ["generate", "--model", "ckpt", "--max-new-tokens", "6", "--device", "cpu", "--page-size", "16",
            "--max-context-len", "64"]


def test_text_prompt_gives_text(fresh):
    bin_dir, work = fresh
    assert not list((work / "ckpt").glob("tokenizer_config.json")) and (work / "ckpt" / "tokenizer.json").exists()
    proc = _run([bin_dir / "pagedmla", *GENERATE, "--prompt", "Hello world"], work)
    assert proc.returncode == 0, proc.stderr
    ids, text = _expected(work / "ckpt", "Hello world")
    assert f"[0] generated ids: {' '.join(map(str, ids))} (" in proc.stdout
    assert f"[0] text: {text!r}" in proc.stdout
    assert proc.stdout.startswith(text)  # streamed to the terminal before the summary


def test_prompt_ids_give_ids(fresh):
    bin_dir, work = fresh
    proc = _run([bin_dir / "pagedmla", *GENERATE, "--prompt-ids", "5 6 7", "--no-stream"], work)
    assert proc.returncode == 0, proc.stderr
    ids, _ = _expected(work / "ckpt", [5, 6, 7])
    assert "[0] prompt ids: 5 6 7\n" in proc.stdout
    assert f"[0] generated ids: {' '.join(map(str, ids))} (" in proc.stdout


def test_version_and_info(fresh):
    bin_dir, work = fresh
    import pagedmla

    proc = _run([bin_dir / "pagedmla", "--version"], work)
    assert proc.returncode == 0 and proc.stdout.strip() == f"pagedmla {pagedmla.__version__}"
    proc = _run([bin_dir / "pagedmla", "info"], work)
    assert proc.returncode == 0, proc.stderr
    assert f"torch {torch.__version__}" in proc.stdout and "providers for paged_decode: torch" in proc.stdout
    assert "transformers not installed" in proc.stdout


def test_missing_extras_are_one_line_errors(fresh):
    bin_dir, work = fresh
    proc = _run([bin_dir / "pagedmla", "bench", "decode", "--quick"], work)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["pagedmla bench decode: error: --plot: writing the PNG needs matplotlib: "
                                        "pip install 'pagedmla[bench]' (or pass --no-plot)"]
    proc = _run([bin_dir / "pagedmla", *GENERATE, "--prompt", "Hello", "--chat"], work)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("pagedmla generate: error: --chat: chat templates need transformers")
