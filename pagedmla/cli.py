"""`pagedmla` command line: ``generate`` (text or token ids through a DeepSeek model), ``bench {decode,prefill,
engine}`` (the benchmark grids with a plot), ``info`` (what this installation can run), ``--version``.

Every error is one line naming the flag, file or checkpoint config field at fault, exit status 2 (``--debug``:
the traceback).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

import pagedmla
from pagedmla.bench import options
from pagedmla.engine import LLM, EngineStats, SamplingParams
from pagedmla.engine.llm import SPECULATIVE_METHODS, parse_device
from pagedmla.engine.mtp_drafter import DRAFT_GRAPH_MODES
from pagedmla.engine.tokenizer import missing_tokenizer_hint, resolve_tokenizer
from pagedmla.model import CheckpointError
from pagedmla.model.config import DeepseekConfig, tiny_config
from pagedmla.model.factory import TINY

# Python argument names that errors start with, where the flag is not simply "--" + the name with dashes.
_FLAG_NAMES = {"max_tokens": "--max-new-tokens", "enable_cuda_graph": "--cuda-graph", "prompts": "--prompt"}
# Models whose hidden size is below this run on one CPU thread by default: their ops are too small for torch's
# intra-op threads to pay, and on a busy machine the threads' spin-waits cost more than the work (the tiny
# model on 2 cores with both busy: 5 prefill / 5 decode tokens/s with 2 threads, 330 / 30 with one).
_SMALL_MODEL_HIDDEN = 1024
# (import name, distribution names) of the packages ``info`` reports.
_OPTIONAL = (("tokenizers", ("tokenizers",)), ("transformers", ("transformers",)), ("matplotlib", ("matplotlib",)),
             ("flash_mla", ("sgl-flash-mla", "flash-mla", "flash_mla")), ("flashinfer", ("flashinfer-python",)))
_BENCH_PLOTS = {"decode": "bench-decode.png", "prefill": "bench-prefill.png", "engine": "bench-engine.png"}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``pagedmla CMD: error: --flag: message``, exit status 2."""

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Prompt(NamedTuple):
    """One --prompt (text) or --prompt-ids (ids) value, in command-line order."""

    flag: str
    text: str | None = None
    ids: list[int] | None = None


def _text_prompt(text: str) -> _Prompt:
    return _Prompt("--prompt", text=text)


def _ids(text: str) -> list[int] | None:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        return None
    return ids or None


def _ids_prompt(text: str) -> _Prompt:
    ids = _ids(text)
    if ids is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of token ids (e.g. \"1 2 3\")")
    return _Prompt("--prompt-ids", ids=ids)


def _build_parser() -> argparse.ArgumentParser:
    """The ``pagedmla`` command line. Long (~80 lines) on purpose: one ``add_argument`` per flag, in the order
    ``--help`` lists them, reads better than the same calls spread over helpers."""
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser = _Parser(prog="pagedmla", description="pagedmla: MLA attention serving tools")
    parser.add_argument("--version", action="version", version=f"pagedmla {pagedmla.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", parents=[common], help="generate text or tokens with a DeepSeek-V2/V3 model")
    gen.add_argument("--model", default=TINY, help="'tiny' (built-in random model) or a checkpoint directory")
    gen.add_argument("--prompt", action="append", dest="prompts", type=_text_prompt, default=[], metavar="TEXT",
                     help="prompt text, tokenised by the checkpoint's (or --tokenizer's) tokenizer; without a "
                          "tokenizer a text of space-separated ids is read as ids; repeat for a batch")
    gen.add_argument("--prompt-ids", action="append", dest="prompts", type=_ids_prompt, metavar="IDS",
                     help='a prompt of token ids ("1 2 3"); repeat for a batch, in order with --prompt')
    gen.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="a tokenizer.json or a directory holding one (default: the checkpoint's)")
    gen.add_argument("--chat", action="store_true",
                     help="send each --prompt as a user message through the tokenizer's chat template "
                          "(needs transformers)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop once the generated text contains TEXT (needs a tokenizer); repeatable")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-stream", action="store_true",
                     help="with one prompt, print the result at the end instead of token by token")
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    gen.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: the checkpoint's)")
    gen.add_argument("--threads", type=int, default=None,
                     help="CPU threads for torch (default: 1 for small models such as tiny, else torch's own; "
                          "OMP_NUM_THREADS, when set, wins)")
    gen.add_argument("--provider", default=None, help="attention provider: torch, triton, ... (default: best)")
    gen.add_argument("--page-size", type=int, default=64)
    gen.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp16", "fp8_e4m3", "fp8_ds_mla"),
                     help="latent cache format: the model's dtype (auto), bf16, fp16, or FP8 (fp8_e4m3: one scale "
                          "per layer; fp8_ds_mla: FlashMLA's 656-byte rows), about twice the pages per byte")
    gen.add_argument("--max-batch-size", type=int, default=32)
    gen.add_argument("--max-context-len", type=int, default=None, help="default: the model's max positions")
    gen.add_argument("--max-num-batched-tokens", type=int, default=8192,
                     help="tokens per step at most (longer prompts are prefilled in chunks)")
    gen.add_argument("--mixed-batching", action="store_true", help="prefill chunks share steps with decodes")
    gen.add_argument("--enable-prefix-caching", action="store_true", help="share cached prompt-prefix pages")
    gen.add_argument("--num-speculative-tokens", type=int, default=0,
                     help="speculative decoding with this many draft tokens per step (0 = off; MTP: 1-4)")
    gen.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                     help="drafter: ngram (prompt lookup, the default) or mtp (the model's multi-token-prediction "
                          "layer: num_nextn_predict_layers in its config)")
    gen.add_argument("--draft-graph", choices=DRAFT_GRAPH_MODES, default="fused",
                     help="MTP with CUDA graphs: one graph for the draft decodes (fused) or one per step")
    gen.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                     help="CUDA graphs for decode / verify steps (auto: on for CUDA)")
    gen.add_argument("--profile-attention", action="store_true", help="count and time attention calls per step")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="split the model over N processes, one per device (spawned, or torchrun's ranks)")
    gen.add_argument("--decode-context-parallel-size", type=int, default=1, metavar="D",
                     help="split the latent cache by token over D of those ranks (D divides N)")
    gen.set_defaults(run=generate)

    bench = sub.add_parser("bench", help="time pagedmla against the baselines installed here, with a PNG plot")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, add_arguments, what in (
            ("decode", options.decode_arguments, "paged MLA decode against FlashMLA and FlashInfer (CPU: against the "
             "torch reference on tiny shapes, Triton under the interpreter)"),
            ("prefill", options.prefill_arguments, "ragged and paged prefill and merge_state against torch SDPA and "
             "FlashInfer"),
            ("engine", options.engine_arguments, "the serving engine against transformers' generate")):
        kind = kinds.add_parser(name, parents=[common], help=what,
                                description=f"{what}. Baselines run where installed; the PNG goes to "
                                            f"{_BENCH_PLOTS[name]} unless --plot or --no-plot says otherwise "
                                            "(matplotlib: pip install 'pagedmla[bench]').")
        add_arguments(kind)
        if name != "engine":
            kind.add_argument("--no-flashinfer", action="store_true",
                              help="skip FlashInfer even when it is installed (it JIT-compiles for ~30-80 s)")
        kind.add_argument("--no-plot", action="store_true", help="write no PNG")
        kind.set_defaults(run=run_bench, plot=_BENCH_PLOTS[name])

    info = sub.add_parser("info", parents=[common], help="versions, devices and the providers of each op")
    info.set_defaults(run=show_info)
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
                     f"({stats.acceptance_rate:.0%}) in {stats.verify_steps} verify steps, "
                     f"{stats.tokens_per_verify:.2f} tokens per request and verify step")
    if stats.cached_prefix_tokens or stats.preemptions:
        lines.append(f"prefix cache: {stats.cached_prefix_tokens} prompt tokens reused "
                     f"({stats.prefix_cache_hits}/{stats.prefix_cache_queries} admissions hit, "
                     f"{stats.prefix_cache_hit_rate:.0%}); preemptions: {stats.preemptions}")
    for kind, calls in stats.attention_calls.items():
        n = max(1, steps.get(kind, 1))
        lines.append(f"attention ({kind}): {calls / n:.0f} calls/step ({num_layers} layers), "
                     f"{stats.attention_seconds[kind] / n * 1e3:.3f} ms/step")
    return lines


def _model_config(model: str) -> DeepseekConfig:
    """The config of ``--model``, read before any weight loads (ValueError naming --model)."""
    if model == TINY:
        return tiny_config()
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is neither 'tiny' nor a checkpoint directory")
    return DeepseekConfig.from_file(model)


def _prompts(args: argparse.Namespace, tokenizer, vocab: int) -> list[_Prompt]:
    """The prompts with their kind settled before the model loads: ids checked against the vocabulary,
    text only with a tokenizer (without one, a text of ids reads as ids)."""
    if not args.prompts:
        raise ValueError("prompts: give at least one --prompt TEXT or --prompt-ids IDS")
    out = []
    for p in args.prompts:
        if p.text is not None and tokenizer is None:
            ids = _ids(p.text)
            if ids is None or args.chat:
                raise ValueError(f"prompts: {p.text!r} is text, and this model has no tokenizer"
                                 f"{missing_tokenizer_hint(args.model)}; pass --tokenizer PATH (a tokenizer.json), "
                                 "or token ids with --prompt-ids")
            p = _Prompt("--prompt", ids=ids)
        if p.ids is not None and not all(0 <= t < vocab for t in p.ids):
            raise ValueError(f"{p.flag}: token ids must lie in 0..{vocab - 1} (the model's vocabulary), got "
                             f"{' '.join(map(str, p.ids))}")
        out.append(p)
    return out


def _set_threads(args: argparse.Namespace, config: DeepseekConfig, device: torch.device) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"threads: expected a positive int, got {args.threads}")
        torch.set_num_threads(args.threads)
    elif device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS") and config.hidden_size < _SMALL_MODEL_HIDDEN:
        torch.set_num_threads(1)


def generate(args: argparse.Namespace) -> int:
    """Run the ``generate`` command: every argument and prompt is checked before the model loads; one
    prompt streams its tokens as they come; prints each request's ids (and text) and the summary."""
    config = _model_config(args.model)
    device = parse_device(args.device)
    tokenizer = resolve_tokenizer(args.tokenizer or "auto", args.model)
    prompts = _prompts(args, tokenizer, config.vocab_size)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, stop=args.stop)
    if params.stop and tokenizer is None:
        raise ValueError("stop: stop strings need a tokenizer and this model has none; pass --tokenizer PATH")
    _set_threads(args, config, device)
    llm = LLM(args.model, device=device, dtype=args.dtype, page_size=args.page_size, provider=args.provider,
              max_batch_size=args.max_batch_size, max_context_len=args.max_context_len,
              max_num_batched_tokens=args.max_num_batched_tokens, mixed_batching=args.mixed_batching,
              enable_prefix_caching=args.enable_prefix_caching, num_speculative_tokens=args.num_speculative_tokens,
              speculative=args.speculative, draft_graph=args.draft_graph,
              enable_cuda_graph={"auto": None, "on": True, "off": False}[args.cuda_graph],
              profile_attention=args.profile_attention, tokenizer=tokenizer,
              tensor_parallel_size=args.tensor_parallel_size,
              decode_context_parallel_size=args.decode_context_parallel_size, kv_cache_dtype=args.kv_cache_dtype)
    with llm:
        return _generate(args, llm, prompts, params)


def _generate(args: argparse.Namespace, llm: LLM, prompts: list[_Prompt], params: SamplingParams) -> int:
    if not llm.is_driver:  # a torchrun rank other than 0: it ran rank 0's steps, which prints
        return 0
    inputs = []
    for p in prompts:
        if p.ids is not None:
            inputs.append(p.ids)
        elif args.chat:
            inputs.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
        else:
            inputs.append(p.text)
    _note_capped(args, [len(llm.encode(x)) for x in inputs], llm.scheduler.max_context_len)
    if len(inputs) == 1 and not args.no_stream:
        outputs = [_stream(llm, inputs[0], params)]
    else:
        outputs = llm.generate(inputs, params, use_tqdm=None)
    for i, out in enumerate(outputs):
        print(f"[{i}] prompt ids: {' '.join(map(str, out.prompt_token_ids))}")
        print(f"[{i}] generated ids: {' '.join(map(str, out.token_ids))} ({out.finish_reason})")
        if out.text is not None:
            print(f"[{i}] text: {out.text!r}")
    threads = f", {torch.get_num_threads()} CPU thread(s)" if llm.device.type == "cpu" else ""
    mla = llm.runner.mla_config
    parallel = f", tensor parallel {mla.attn_tp_size} (decode context parallel {mla.dcp_size})" \
        if mla.attn_tp_size > 1 else ""
    print(f"device {llm.device}, dtype {str(llm.runner.dtype).replace('torch.', '')}, "
          f"provider {llm.runner.backend.provider}, page size {mla.page_size}{threads}{parallel}")
    for line in _summary(llm.stats, llm.model.config.num_hidden_layers):
        print(line)
    return 0


def _note_capped(args: argparse.Namespace, lengths: list[int], context: int) -> None:
    """One line on stderr when the context, not --max-new-tokens, will end some request."""
    room = sorted({context - n for n in lengths if n + args.max_new_tokens > context})
    if room:
        at_most = str(room[0]) if len(room) == 1 else f"{room[0]}..{room[-1]}"
        print(f"pagedmla generate: note: --max-new-tokens {args.max_new_tokens} is capped to {at_most} by the "
              f"context of {context} tokens (prompt included; --max-context-len)", file=sys.stderr)


def _stream(llm: LLM, prompt, params: SamplingParams):
    """Print one request's text (or ids) as the steps produce it; returns its RequestOutput."""
    for delta in llm.stream(prompt, params):
        piece = delta.text if delta.text is not None else "".join(f"{t} " for t in delta.token_ids)
        print(piece, end="", flush=True)
    print()
    return delta.output  # the last delta carries it


def run_bench(args: argparse.Namespace) -> int:
    """``pagedmla bench KIND``: the benchmark module's run with every baseline installed here."""
    from pagedmla.bench.common import installed

    if args.no_plot:
        args.plot = None
    if args.bench == "engine":
        from pagedmla.bench import engine

        if not args.no_hf and not installed("transformers"):
            print("# transformers is not installed: the engine runs alone (pip install transformers to compare)")
            args.no_hf = True
        return engine.run(args)
    if not torch.cuda.is_available():
        # The CPU path runs the Triton kernels under the interpreter, which must be chosen before they load.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.flashinfer = args.flashinfer or (not args.no_flashinfer and installed("flashinfer"))
    from pagedmla.bench import decode, prefill

    if args.bench == "decode":
        decode.run(args, compact=True)
    else:
        prefill.run(args)
    if args.plot:
        print(f"plot: {os.path.abspath(args.plot)}")
    return 0


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def show_info(args: argparse.Namespace) -> int:
    """``pagedmla info``: versions, devices, and which providers implement each op here."""
    from pagedmla.bench.common import installed
    from pagedmla.device import triton_interpreting
    from pagedmla.ops.providers import OPS, available_providers

    print(f"pagedmla {pagedmla.__version__}, python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"triton {_version('triton')}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"device cuda:{i}: {props.name}, compute capability {props.major}.{props.minor}, "
                  f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    else:
        print(f"device: CPU only ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads); Triton kernels "
              f"{'run under the interpreter' if triton_interpreting() else 'need TRITON_INTERPRET=1'} here")
    for op in OPS:
        print(f"providers for {op}: {', '.join(available_providers(op))}")
    found = []
    for module, dists in _OPTIONAL:
        versions = [v for v in map(_version, dists) if v != "not installed"]
        found.append(f"{module} {versions[0] if versions else 'installed' if installed(module) else 'not installed'}")
    print("optional packages: " + ", ".join(found))
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
    """Entry point of the ``pagedmla`` console script. Bad arguments, unreadable files and broken checkpoints
    exit with status 2 and one line naming the flag, file or config field at fault (a CheckpointError's
    message as it is); any other error with status 1 and one line (the traceback with ``--debug``)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    where = f"pagedmla {args.command}" + (f" {args.bench}" if args.command == "bench" else "")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        parser.exit(130, f"{where}: interrupted\n")
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(exc, CheckpointError):  # names a config field or a file, never a flag: as it is,
            # except the checkpoint path itself, which the user gave as --model
            message = str(exc)
            if message.startswith("path: "):
                message = "--model: " + message.removeprefix("path: ")
            parser.exit(2, f"{where}: error: {message}\n")
        if isinstance(exc, (ValueError, TypeError)):
            parser.exit(2, f"{where}: error: {_flag_message(str(exc), args)}\n")
        if isinstance(exc, OSError) and exc.filename is not None:
            parser.exit(2, f"{where}: error: {exc.filename}: {exc.strerror or exc}\n")
        text = " ".join(str(exc).split())
        parser.exit(1, f"{where}: error: {type(exc).__name__}: {text} (run with --debug for the traceback)\n")


if __name__ == "__main__":
    sys.exit(main())
