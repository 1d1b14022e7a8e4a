"""Sampling parameters and the sampler that turns last-token logits into next tokens.

The sampler is numerically safe for every parameter ``SamplingParams`` accepts: temperatures below
``MIN_TEMPERATURE`` act as greedy, logits are shifted by their maximum before the temperature divides them
(so any finite logits give a distribution), and top_p keeps at least the most likely token. A row of
logits holding an inf or NaN has no distribution: ``sample`` reports it (``NonFiniteLogitsError``) and
still returns every other row's token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Temperatures below this sample as greedy: softmax(logits / t) puts all its mass on the argmax anyway
# (logits differing by 1e-3 differ by 100 after the division, a factor e^100), and much smaller ones
# become 0 in float32.
MIN_TEMPERATURE = 1e-5
# A larger temperature would become inf in float32 (and -inf / inf is NaN).
_FLOAT32_MAX = torch.finfo(torch.float32).max
# torch.Generator.manual_seed's range.
_SEED_RANGE = (-(1 << 63), 1 << 64)


class NonFiniteLogitsError(ValueError):
    """Some requests' logits hold an inf or NaN (a model or cache that overflowed, or corrupt weights):
    they have no next token. ``rows``: their batch rows; ``tokens``: every row's result, None at those
    rows (the other requests' tokens stand; their generators have drawn them)."""

    def __init__(self, rows: list[int], tokens: list):
        super().__init__(f"logits: rows {rows} hold inf or NaN values; those requests have no next token")
        self.rows = rows
        self.tokens = tokens


@dataclass
class SamplingParams:
    """How one request generates.

    temperature: a finite float >= 0; below ``MIN_TEMPERATURE`` (0 included) greedy (argmax), otherwise
    samples from softmax(logits / temperature) after the top_k (0 = off) and top_p (in (0, 1]; 1 = off;
    the most likely token always stays) filters. seed: per-request generator seed in
    [-2**63, 2**64), so a request's samples do not depend on what else is in the batch (None: the global
    torch generator).
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
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite float >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise ValueError(f"seed: expected an int in [-2**63, 2**64) or None, got {self.seed!r}")
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
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits float32 [bs, vocab] (one row per request) -> the next token id of each request.

    Greedy rows take the argmax (ties: lowest id, as torch.argmax); the others are sampled row by
    row with their own generator. One readback. NonFiniteLogitsError when a row holds an inf or NaN
    (its ``tokens`` carry the other rows' results)."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"logits/params/generators: expected one row per request, got {logits.shape[0]}, "
                         f"{len(params)}, {len(generators)}")
    finite = torch.isfinite(logits).all(dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    for i in sampled:
        # A non-finite row samples from zeros instead (multinomial rejects NaN); it is reported below.
        probs = sampling_probs(torch.where(finite[i], logits[i], 0.0), params[i])
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    out, ok = torch.stack([tokens, finite.to(tokens.dtype)]).tolist()
    if not all(ok):
        raise NonFiniteLogitsError([i for i, f in enumerate(ok) if not f],
                                   [t if f else None for t, f in zip(out, ok)])
    return out


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: softmax(row / temperature) after the top_k
    and top_p filters; row float [vocab] (or rows [n, vocab], filtered each on its own), finite -> float32
    of the same shape, each row summing to 1 before top_p (which keeps at least the top token).

    The row is shifted by its maximum before the division, so the largest logit becomes exactly 0 and
    no finite logit or accepted temperature can make a NaN: a gap beyond float32's range counts as -inf
    (probability 0), and a temperature beyond it divides as float32's largest value."""
    row = row.float()
    row = (row - row.max(dim=-1, keepdim=True).values) / min(p.temperature, _FLOAT32_MAX)
    if p.top_k and p.top_k < row.shape[-1]:
        kth = row.topk(p.top_k, dim=-1).values[..., -1:]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = row.softmax(dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays, however small
        # top_p is (a top_p that rounds to 0 in float32 would otherwise drop every token).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
        drop[..., 0] = False
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
