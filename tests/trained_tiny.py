"""The built-in ``tiny`` configuration trained (with transformers, in seconds on a GPU) on a task that
needs attention: continue a sequence that repeats a random pattern of ``PERIOD`` tokens. The next token
is the one ``PERIOD - 1`` positions back, so a model with wrong attention predicts wrong tokens, and the
trained model predicts with the clear margins of a real checkpoint (random weights give near-ties that
any bf16 rounding difference flips)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedmla.model.config import TINY_CONFIG

PERIOD = 8
# Patterns draw from ids 2..65: a smaller alphabet than the vocabulary makes the copy rule quicker to learn.
VOCAB_USED = 66


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
    (loss on the predictable positions) until its next-token accuracy on a fresh batch reaches ``target``
    (checked every 100 steps); returns (model, that accuracy). On an H200 it gets there after 300-800
    steps (10-20 s), but GPU training is not bitwise reproducible and about one run in a few stalled on a
    plateau (0.94 after 4000 steps, seen once in a parallel test run): gradients are clipped, and a run
    that has not reached ``target`` after ``max_steps`` starts again from the next seed (``attempts`` in
    all; the best model is returned if none gets there)."""
    best = None
    for attempt in range(attempts):
        model, accuracy = _train_once(device, max_steps, batch, length, seed + attempt, target)
        if best is None or accuracy > best[1]:
            best = (model, accuracy)
        if accuracy >= target:
            break
    return best


def _train_once(device, max_steps: int, batch: int, length: int, seed: int, target: float):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    config = AutoConfig.for_model(TINY_CONFIG["model_type"], **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
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
        if step % 100 == 0:
            model.eval()
            with torch.no_grad():
                ids = periodic_batch(batch, length, gen, device)
                pred = model(ids).logits[:, PERIOD - 1:-1].argmax(-1)
                accuracy = (pred == ids[:, PERIOD:]).float().mean().item()
            if accuracy >= target:
                break
    model.eval()
    return model, accuracy
