"""The engine on FP8 caches: ``LLM(kv_cache_dtype=...)`` / ``pagedmla generate --kv-cache-dtype``, and the page
budget they buy (the same ``cache_bytes`` holds twice the pages of a bf16 cache in fp8_e4m3)."""

from __future__ import annotations

import re

import pytest

from pagedmla.cli import main
from pagedmla.engine import LLM, SamplingParams

# The tiny model: 3 layers of 576-wide latent rows; pages of 16 tokens.
LAYERS, PAGE = 3, 16
BUDGET = 40 * PAGE * 1152 * LAYERS  # 40 bf16 pages


def _llm(kv_cache_dtype: str, **kw) -> LLM:
    return LLM("tiny", device="cpu", page_size=PAGE, max_context_len=128, cache_bytes=BUDGET,
               enable_cuda_graph=False, kv_cache_dtype=kv_cache_dtype, **kw)


def test_page_budget_follows_the_row_size():
    pages = {fmt: _llm(fmt).runner.cache.num_pages for fmt in ("bf16", "fp8_e4m3", "fp8_ds_mla")}
    # num_pages counts the reserved page 0 on top of what the budget holds.
    assert pages["bf16"] - 1 == 40
    assert pages["fp8_e4m3"] - 1 == 80  # 576-byte rows: twice the pages
    assert pages["fp8_ds_mla"] - 1 == BUDGET // (PAGE * 656 * LAYERS) == 70
    for fmt in ("fp8_e4m3", "fp8_ds_mla"):
        cache = _llm(fmt).runner.cache
        held = sum(b.numel() * b.element_size() for b in cache.buffers)
        assert cache.kv_format == fmt and held == cache.num_pages * PAGE * LAYERS * (576 if fmt == "fp8_e4m3" else 656)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_ds_mla"])
def test_generate_with_an_fp8_cache(fmt):
    """Greedy generation over an FP8 cache: prompts prefilled in 16-token chunks (the later chunks in the
    chunked-prefix form, which dequantises the gathered prefix rows), a shared prefix, then decode steps."""
    llm = _llm(fmt, max_num_batched_tokens=16, enable_prefix_caching=True, extend_prefix_mode="chunked")
    prompts = [[3, 4, 5, 6] * 6, [3, 4, 5, 6] * 4 + [9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    vocab = llm.model.config.vocab_size
    assert all(0 <= t < vocab for o in outs for t in o.token_ids)
    assert llm.runner.cache.kv_format == fmt and llm.runner.backend.config.kv_format == fmt


def test_cli_kv_cache_dtype(capsys):
    rc = main(["generate", "--model", "tiny", "--prompt", "1 2 3 4 5 6 7 8", "--max-new-tokens", "4", "--page-size",
               "16", "--max-context-len", "64", "--device", "cpu", "--kv-cache-dtype", "fp8_ds_mla"])
    assert rc == 0 and re.search(r"generated ids: (?:\d+ ?){4}", capsys.readouterr().out)


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="^kv_cache_dtype"):
        _llm("int8")
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "1 2 3", "--device", "cpu", "--kv-cache-dtype", "fp8_e5m2"])
