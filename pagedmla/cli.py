"""`pagedmla` command line: ``pagedmla generate --model tiny|PATH --prompt ... [options]``."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from pagedmla.engine import LLM, EngineStats, SamplingParams
from pagedmla.model import CheckpointError

# Python argument names that errors start with, where the flag is not simply "--" + the name with dashes.
_FLAG_NAMES = {"max_tokens": "--max-new-tokens", "enable_cuda_graph": "--cuda-graph", "prompts": "--prompt"}


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt: {text!r} is not a list of token ids, and this model has no tokenizer") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmla", description="pagedmla: MLA attention serving tools")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate tokens with a DeepSeek-V2/V3 model")
    gen.add_argument("--model", default="tiny", help="'tiny' (built-in random model) or a checkpoint directory")
    gen.add_argument("--prompt", action="append", required=True,
                     help="prompt text (with a tokenizer) or space-separated token ids; repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: the checkpoint's)")
    gen.add_argument("--provider", default=None, help="attention provider: torch, triton, ... (default: best)")
    gen.add_argument("--page-size", type=int, default=64)
    gen.add_argument("--max-batch-size", type=int, default=32)
    gen.add_argument("--max-context-len", type=int, default=None, help="default: the model's max positions")
    gen.add_argument("--max-num-batched-tokens", type=int, default=8192,
                     help="tokens per step at most (longer prompts are prefilled in chunks)")
    gen.add_argument("--mixed-batching", action="store_true", help="prefill chunks share steps with decodes")
    gen.add_argument("--enable-prefix-caching", action="store_true", help="share cached prompt-prefix pages")
    gen.add_argument("--num-speculative-tokens", type=int, default=0,
                     help="n-gram speculative decoding with this many draft tokens (0 = off)")
    gen.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                     help="CUDA graphs for decode / verify steps (auto: on for CUDA)")
    gen.add_argument("--profile-attention", action="store_true", help="count and time attention calls per step")
    return parser


def _summary(stats: EngineStats, num_layers: int) -> list[str]:
    lines = [f"prefill: {stats.prefill_tokens} tokens in {stats.prefill_seconds * 1e3:.1f} ms "
             f"({stats.prefill_tokens_per_s:.1f} tokens/s, {stats.prefill_steps} steps)",
             f"decode:  {stats.decode_tokens} tokens in {stats.decode_seconds * 1e3:.1f} ms "
             f"({stats.decode_tokens_per_s:.1f} tokens/s, {stats.decode_steps} steps)"]
    # Attention is counted per forward mode, and EngineStats.decode_steps includes the verify steps.
    steps = {"extend": stats.prefill_steps, "decode": stats.decode_steps - stats.verify_steps,
             "target_verify": stats.verify_steps, "mixed": stats.mixed_steps}
    if stats.mixed_steps:
        lines.append(f"mixed:   {stats.mixed_tokens} tokens in {stats.mixed_seconds * 1e3:.1f} ms "
                     f"({stats.mixed_steps} steps)")
    if stats.draft_tokens:
        lines.append(f"speculative: {stats.accepted_draft_tokens}/{stats.draft_tokens} draft tokens accepted "
                     f"({stats.acceptance_rate:.0%}) in {stats.verify_steps} verify steps")
    if stats.cached_prefix_tokens or stats.preemptions:
        lines.append(f"prefix cache: {stats.cached_prefix_tokens} prompt tokens reused "
                     f"({stats.prefix_cache_hits}/{stats.prefix_cache_queries} admissions hit, "
                     f"{stats.prefix_cache_hit_rate:.0%}); preemptions: {stats.preemptions}")
    for kind, calls in stats.attention_calls.items():
        n = max(1, steps.get(kind, 1))
        lines.append(f"attention ({kind}): {calls / n:.0f} calls/step ({num_layers} layers), "
                     f"{stats.attention_seconds[kind] / n * 1e3:.3f} ms/step")
    return lines


def generate(args: argparse.Namespace) -> int:
    """Run the ``generate`` command; prints each request's ids (and text) and the throughput summary."""
    llm = LLM(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size, provider=args.provider,
              max_batch_size=args.max_batch_size, max_context_len=args.max_context_len,
              max_num_batched_tokens=args.max_num_batched_tokens, mixed_batching=args.mixed_batching,
              enable_prefix_caching=args.enable_prefix_caching, num_speculative_tokens=args.num_speculative_tokens,
              enable_cuda_graph={"auto": None, "on": True, "off": False}[args.cuda_graph],
              profile_attention=args.profile_attention)
    prompts = args.prompt if llm.tokenizer is not None else [_parse_ids(p) for p in args.prompt]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for i, out in enumerate(outputs):
        print(f"[{i}] prompt ids: {' '.join(map(str, out.prompt_token_ids))}")
        print(f"[{i}] generated ids: {' '.join(map(str, out.token_ids))} ({out.finish_reason})")
        if out.text is not None:
            print(f"[{i}] text: {out.text!r}")
    print(f"device {llm.device}, dtype {str(llm.runner.dtype).replace('torch.', '')}, "
          f"provider {llm.runner.backend.provider}, page size {llm.runner.mla_config.page_size}")
    for line in _summary(llm.stats, llm.model.config.num_hidden_layers):
        print(line)
    return 0


def _flag_message(message: str, args: argparse.Namespace) -> str:
    """An engine error (``"name: ..."``, naming a Python argument) rephrased to name the flag that set it."""
    match = re.match(r"(\w+): ", message)
    if match is None:
        return message
    name = match.group(1)
    flag = _FLAG_NAMES.get(name) or ("--" + name.replace("_", "-") if name in vars(args) else None)
    return message if flag is None else flag + message[len(name):]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pagedmla`` console script; bad arguments exit with status 2 and a message
    naming the flag at fault."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return generate(args)
    except CheckpointError as exc:  # names a config field or a file, never a flag
        parser.exit(2, f"pagedmla {args.command}: error: {exc}\n")
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"pagedmla {args.command}: error: {_flag_message(str(exc), args)}\n")


if __name__ == "__main__":
    sys.exit(main())
