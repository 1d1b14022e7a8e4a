"""The built-in ``tiny`` configuration trained (with transformers, in seconds on a GPU) on a task that
needs attention: continue a sequence that repeats a random pattern of ``PERIOD`` tokens. The next token
is the one ``PERIOD - 1`` positions back, so a model with wrong attention predicts wrong tokens, and the
trained model predicts with the clear margins of a real checkpoint (random weights give near-ties that
any bf16 rounding difference flips)."""

from __future__ import annotations

import math

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
