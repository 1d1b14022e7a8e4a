"""Sampling parameters and the sampler that turns last-token logits into next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request generates.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature) after the
    top_k (0 = off) and top_p (1 = off) filters. seed: per-request generator seed, so a request's
    samples do not depend on what else is in the batch (None: the global torch generator).
    max_tokens: new tokens to generate at most. stop_token_ids: tokens that end the request (kept in
    the output). ignore_eos: do not stop at the model's end-of-sequence token(s).
    n: independent samples of the prompt (``RequestOutput.outputs`` holds n completions; with a seed,
    sample i draws from seed + i). stop: strings that end the request once the generated text contains
    one (needs a tokenizer; the text stops before it, the token ids include the token completing it).
    logprobs: k >= 0 records, for every generated token, the log-probabilities (natural log, of the
    model's distribution before temperature and filters) of that token and of the k most likely ones
    (None: off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a float >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: expected an int or None, got {self.seed!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected a list of ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n: expected an int >= 1, got {self.n!r}")
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs: expected an int >= 0 or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits float32 [bs, vocab] (one row per request) -> the next token id of each request.

    Greedy rows take the argmax (ties: lowest id, as torch.argmax); the others are sampled row by
    row with their own generator."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"logits/params/generators: expected one row per request, got {logits.shape[0]}, "
                         f"{len(params)}, {len(generators)}")
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    for i in sampled:
        probs = sampling_probs(logits[i], params[i])
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens.tolist()


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: softmax(row / temperature) after the top_k
    and top_p filters; row float [vocab] (or rows [n, vocab], filtered each on its own) -> float32 of the
    same shape, each row summing to 1."""
    row = row.float() / p.temperature
    if p.top_k and p.top_k < row.shape[-1]:
        kth = row.topk(p.top_k, dim=-1).values[..., -1:]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = row.softmax(dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[dict[int, float]]:
    """logits float32 [n, vocab] of the rows that produced ``tokens`` (one each) -> per row a dict of
    log-probabilities (natural log of softmax(logits), before temperature and filters): the produced token's
    and those of the ``top[i]`` most likely tokens. One readback for all rows."""
    if logits.shape[0] != len(tokens) or len(tokens) != len(top):
        raise ValueError(f"logits/tokens/top: expected one row per token, got {logits.shape[0]}, {len(tokens)}, "
                         f"{len(top)}")
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device).view(-1, 1))
    k = min(max(top, default=0), logp.shape[-1])
    best = logp.topk(k, dim=-1)
    # Ids ride along as float32, exact below 2**24 (vocabularies are far smaller): one readback.
    rows = torch.cat([chosen, best.values, best.indices.float()], dim=1).tolist()
    out = []
    for row, token, n in zip(rows, tokens, top):
        entry = {int(t): v for t, v in zip(row[1 + k: 1 + k + n], row[1: 1 + n])}
        entry[token] = row[0]
        out.append(entry)
    return out
