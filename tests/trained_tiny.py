"""The built-in ``tiny`` configuration trained (with transformers, in seconds on a GPU) on a task that
needs attention: continue a sequence that repeats a random pattern of ``PERIOD`` tokens. The next token
is the one ``PERIOD - 1`` positions back, so a model with wrong attention predicts wrong tokens, and the
trained model predicts with the clear margins of a real checkpoint (random weights give near-ties that
any bf16 rounding difference flips).

For MTP speculative decoding, ``write_trained_mtp_checkpoint`` makes (in seconds on a CPU) the tiny
configuration with a trained MTP layer on a task it can predict: a successor chain (see there)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedmla.model.config import TINY_CONFIG

PERIOD = 8
# Patterns draw from ids 2..65: a smaller alphabet than the vocabulary makes the copy rule quicker to learn.
VOCAB_USED = 66
# Steps of linear lr warmup: from step 1 at the full lr 5e-3, most runs stalled short of the target.
WARMUP = 100
# The accuracy check uses this many fresh batches, so one easy batch does not end training early: a model
# that read 0.996 on one batch of 64 measured 0.988 on 512 sequences.
EVAL_BATCHES = 4


def periodic_batch(batch: int, length: int, generator: torch.Generator, device) -> torch.Tensor:
    """[batch, length] token ids: a random pattern of PERIOD ids repeated."""
    pattern = torch.randint(2, VOCAB_USED, (batch, PERIOD), generator=generator)
    return pattern.repeat(1, -(-length // PERIOD))[:, :length].to(device)


def continuation(prompt: list[int], n: int) -> list[int]:
    """The next ``n`` tokens of a periodic prompt (of at least PERIOD tokens)."""
    return [prompt[(len(prompt) + i) % PERIOD] for i in range(n)]


def train_tiny(device, max_steps: int = 2000, batch: int = 64, length: int = 160, seed: int = 0,
               target: float = 0.995, attempts: int = 3):
    """A transformers DeepSeek-V3 model with the ``tiny`` config trained in float32 on periodic sequences
    (loss on the predictable positions) until its next-token accuracy on ``EVAL_BATCHES`` fresh batches (256
    sequences by default) reaches ``target`` (checked every 100 steps); returns (model, that accuracy).

    AdamW at lr 5e-3 with a linear warmup over the first 100 steps, then a cosine decay to 5e-4 at
    ``max_steps``; gradients clipped to norm 1. The warmup is what matters. Without it (constant 5e-3
    from step 1, the earlier recipe) 4 of 6 seeds measured on an H200 were still at 0.86-0.98 after
    2000 steps, with a spiky loss. Their errors were spread over all positions (worst in the first two
    periods after the prompt) and were no more common on patterns with a repeated token, so the copy
    attention was imprecise everywhere rather than missing one case. The other 2 seeds needed 300 and
    1200 steps. With this recipe, seeds 0-12 all reached 0.995 after 100-700 steps (median 300). Seed 0
    ran alone in 21 s; the other 12 shared the GPU and took 30-74 s each. A warmup without decay also
    reached the target (4 of 4 seeds, 200-300 steps), and so did peak lr 2e-3 (6 of 6, 100-200 steps).
    Making a quarter of the training patterns from 4-token alphabets was worse (0 of 4). GPU training
    is not bitwise reproducible, so a run that has not reached ``target`` after ``max_steps`` still
    starts again from the next seed (``attempts`` in all; the best model is returned if none gets
    there)."""
    best = None
    for attempt in range(attempts):
        model, accuracy = _train_once(device, max_steps, batch, length, seed + attempt, target)
        if best is None or accuracy > best[1]:
            best = (model, accuracy)
        if accuracy >= target:
            break
    return best


def _lr_factor(step: int, max_steps: int) -> float:
    """Multiplier of the peak lr at ``step`` (1-based): linear warmup over WARMUP steps, then a cosine
    decay to 0.1 at ``max_steps``."""
    if step <= WARMUP:
        return step / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, max_steps - WARMUP))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def _train_once(device, max_steps: int, batch: int, length: int, seed: int, target: float):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    config = AutoConfig.for_model(TINY_CONFIG["model_type"], **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s + 1, max_steps))
    accuracy = 0.0
    for step in range(1, max_steps + 1):
        model.train()
        ids = periodic_batch(batch, length, gen, device)
        logits = model(ids).logits[:, PERIOD - 1:-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, PERIOD:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            model.eval()
            right = total = 0
            with torch.no_grad():
                for _ in range(EVAL_BATCHES):
                    ids = periodic_batch(batch, length, gen, device)
                    pred = model(ids).logits[:, PERIOD - 1:-1].argmax(-1)
                    right += (pred == ids[:, PERIOD:]).sum().item()
                    total += pred.numel()
            accuracy = right / total
            if accuracy >= target:
                break
    model.eval()
    return model, accuracy


# ---------------------------------------------------------------------------------------------- MTP
# The MTP task: a fixed successor permutation of ids 2 .. 2 + MTP_VOCAB - 1. After a prompt the target's
# greedy tokens follow the chain t -> SUCC[t], so the MTP layer can predict token i + 2 from token i + 1.
MTP_VOCAB = 64
MTP_SEED = 0


def successor_map(seed: int = MTP_SEED) -> torch.Tensor:
    """int64 [vocab]: SUCC[t] for the ids of the task, the identity elsewhere."""
    succ = torch.arange(TINY_CONFIG["vocab_size"])
    succ[2:2 + MTP_VOCAB] = torch.randperm(MTP_VOCAB, generator=torch.Generator().manual_seed(seed)) + 2
    return succ


def chain_prompt(length: int, generator: torch.Generator, succ: torch.Tensor, random_prefix: int = 1) -> list[int]:
    """``random_prefix`` (>= 1) random task ids, then the chain from the last of them: ``length`` ids in all."""
    ids = torch.randint(2, 2 + MTP_VOCAB, (random_prefix,), generator=generator).tolist()
    while len(ids) < length:
        ids.append(int(succ[ids[-1]]))
    return ids[:length]


def _target_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """pagedmla's final hidden states [b, l, hidden] of the sequences ``ids`` [b, l] (one prefill)."""
    from pagedmla.backend import ForwardMode
    from pagedmla.engine import ModelRunner, SamplingParams, Sequence
    from pagedmla.model.context import StepContext

    b, length = ids.shape
    page = 16
    runner = ModelRunner(model, page_size=page, num_pages=b * -(-length // page) + 1, max_batch_size=b,
                         max_context_len=length, provider="torch")
    seqs = []
    for row in ids.tolist():
        seq = Sequence(row, SamplingParams(), model.lm_head.weight.device)
        seq.slot = runner.table.add_request()
        runner.table.ensure_capacity(seq.slot, length)
        seqs.append(seq)
    with torch.inference_mode():
        inputs = runner.prepare(seqs, ForwardMode.EXTEND, b)
        runner.backend.init_forward_metadata(inputs.batch)
        hidden = model(inputs.input_ids, inputs.positions, StepContext(runner.backend, runner.cache,
                                                                        inputs.out_cache_loc))
    return hidden.clone().view(b, length, -1)


def hf_mtp_layer(mtp):
    """transformers' own MTP layer (``MtpLayer`` around its DeepSeek-V3 decoder block) holding the weights
    of pagedmla's layer 0 of ``mtp``, float32; and the map of its tensor names to the checkpoint's."""
    pytest.importorskip("transformers.modeling_layers", reason="needs transformers with MTP support")
    from transformers import AutoConfig
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    fields = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    config = AutoConfig.for_model(TINY_CONFIG["model_type"], **fields, num_key_value_heads=TINY_CONFIG[
        "num_attention_heads"])
    config._attn_implementation = "eager"
    index = TINY_CONFIG["num_hidden_layers"]
    layer = MtpLayer(config, hf.DeepseekV3DecoderLayer, hf.DeepseekV3RMSNorm, index, True)
    names = {}
    for name in layer.state_dict():
        tail = name.removeprefix("mtp_block.")
        names[name] = f"model.layers.{index}.{'shared_head.norm.weight' if name == 'post_norm.weight' else tail}"
    ours = {mtp.checkpoint_name(k): v for k, v in mtp.state_dict().items()}
    layer.load_state_dict({name: ours[names[name]].float() for name in layer.state_dict()})
    return layer, hf.DeepseekV3RotaryEmbedding(config), names


def hf_mtp_forward(layer, rotary, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' MTP layer over [b, l] rows: embeddings [b, l, h] of tokens i + 1, hidden [b, l, h] of
    the target at i (positions 0 .. l - 1, causal) -> [b, l, h] after its post norm (``shared_head.norm``)."""
    length, device = embeddings.shape[1], embeddings.device
    positions = torch.arange(length, device=device)[None]
    mask = torch.full((length, length), float("-inf"), device=device).triu(1)[None, None]
    return layer(embeddings, hidden, rotary(embeddings, positions), mask, positions, None)


def write_trained_mtp_checkpoint(directory, seed: int = MTP_SEED, batch: int = 8, length: int = 128,
                                 head_steps: int = 120, mtp_steps: int = 60, device="cpu") -> dict:
    """The ``tiny`` configuration with its MTP layer trained for the successor task, as a checkpoint
    directory (config.json + model.safetensors, float32) that ``LLM(dir, speculative="mtp")`` loads.

    The target is the tiny model's random weights (seed 0) with its LM head fitted (a linear probe, AdamW
    on the cached final hidden states: a full model takes minutes to train on a CPU) to SUCC of each token,
    over prompts of 1 .. 24 random task ids followed by their chain; its greedy tokens then follow the chain
    (98-99% of positions on held-out sequences; the rest depend on the context). The MTP layer, in
    transformers' implementation (``MtpLayer``), learns the target's own argmax at position i + 1 from the
    target's hidden state at i and token i + 1, twice per step: on the target's hidden states, and again
    on its own outputs shifted by one position (the chained draft steps feed it those). The target, its
    hidden states and the probe stay on the CPU (so the weights do not depend on ``device``); the MTP
    layer trains on ``device`` (most of the time: seconds on a GPU). Returns the training figures: probe
    and MTP accuracies, seconds."""
    import json
    import time
    from pathlib import Path

    from safetensors.torch import save_file

    from pagedmla.model import load_model, load_mtp

    start = time.perf_counter()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    succ = successor_map(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    target = load_model("tiny", dtype=torch.float32)

    def sequences(n):
        return torch.tensor([chain_prompt(length, gen, succ, int(torch.randint(1, 25, (1,), generator=gen)))
                             for _ in range(n)])

    ids = sequences(batch)
    hidden = _target_hidden(target, ids)
    head = torch.nn.Parameter(target.lm_head.weight.detach().clone())
    opt = torch.optim.Adam([head], lr=1e-2)
    features, labels = hidden.reshape(-1, hidden.shape[-1]), succ[ids].reshape(-1)
    for _ in range(head_steps):
        loss = F.cross_entropy(features @ head.t(), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        target.lm_head.weight.copy_(head)
        probe_accuracy = ((features @ head.t()).argmax(-1) == labels).float().mean().item()
        # The MTP's label at row i: the target's own greedy choice after token i + 1.
        wanted = (hidden @ head.t()).argmax(-1)
    mtp = load_mtp(target, "tiny", seed=seed)
    layer, rotary, names = hf_mtp_layer(mtp)
    layer.to(device).requires_grad_(True)
    rotary.to(device)
    embed = target.model.embed_tokens.weight.detach().to(device)
    frozen_head = head.detach().to(device)
    ids, hidden, wanted = ids.to(device), hidden.to(device), wanted.to(device)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    for step in range(mtp_steps):
        rows = slice(step * 4 % batch, step * 4 % batch + 4)
        e = F.embedding(ids[rows, 1:], embed)
        out = hf_mtp_forward(layer, rotary, e, hidden[rows, :-1])
        # Row i predicts the target's choice at position i + 1 (wanted[:, i + 1]); the last has no label.
        logits = out[:, :-1] @ frozen_head.t()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), wanted[rows, 1:-1].reshape(-1))
        chained = hf_mtp_forward(layer, rotary, e[:, 1:], out[:, :-1])
        chained_logits = chained[:, :-1] @ frozen_head.t()
        loss = loss + F.cross_entropy(chained_logits.reshape(-1, logits.shape[-1]), wanted[rows, 2:-1].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # The last step's batch, read once: a read per step would wait for the device every step.
    mtp_accuracy = (logits.argmax(-1) == wanted[rows, 1:-1]).float().mean().item()
    tensors = {k: v.contiguous() for k, v in target.state_dict().items()}
    tensors.update({names[k]: v.detach().cpu().contiguous() for k, v in layer.state_dict().items()})
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    return {"probe_accuracy": probe_accuracy, "mtp_accuracy": mtp_accuracy,
            "seconds": time.perf_counter() - start}
