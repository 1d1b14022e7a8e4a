"""How often do greedy streams of the random-weight ``tiny`` model differ between numerically valid runs?

Generates 32 greedy tokens for five prompts (lengths 1, 8, 40, 100, 257) in bf16 with the torch and the
Triton provider, each with the prompts batched together and one by one, and in float32 with the torch
provider; prints, per run, how many streams equal the batched bf16 torch run (and where the others first
differ) and how many equal the float32 run. A random model's next-token logits have near-ties, so any
rounding difference (provider, batch composition, dtype) can flip a token; a trained model does not
(tests/test_engine_gpu.py). Needs CUDA.

    python3 benchmarks/greedy_consistency.py
"""

from __future__ import annotations

import sys

import torch

from pagedmla.engine import LLM, SamplingParams
from pagedmla.model import load_model

PROMPT_LENS = (1, 8, 40, 100, 257)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("greedy_consistency: needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=32, ignore_eos=True)

    def run(model, provider: str, batched: bool) -> list[list[int]]:
        llm = LLM(model, page_size=64, max_batch_size=8, max_context_len=1024, provider=provider,
                  enable_cuda_graph=False)
        if batched:
            return [o.token_ids for o in llm.generate(prompts, params)]
        return [llm.generate([p], params)[0].token_ids for p in prompts]

    bf16 = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    runs = {f"bf16 {p} {'batched' if b else 'one by one'}": run(bf16, p, b)
            for p in ("torch", "triton") for b in (True, False)}
    fp32 = run(load_model("tiny", device="cuda", dtype=torch.float32), "torch", True)
    base = runs["bf16 torch batched"]
    print("| run | streams equal to bf16 torch batched | first differences | streams equal to float32 torch |")
    print("|---|---|---|---|")
    for name, streams in runs.items():
        same = sum(a == b for a, b in zip(streams, base))
        firsts = [first_difference(a, b) for a, b in zip(streams, base)]
        as_fp32 = sum(a == b for a, b in zip(streams, fp32))
        print(f"| {name} | {same}/{len(prompts)} | {firsts} | {as_fp32}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
