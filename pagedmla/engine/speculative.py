"""Speculative decoding: verify a request's draft tokens against the target model's logits.

A verify step runs ``[last token, d_1 .. d_k]`` through the target in one forward (TARGET_VERIFY,
q_len = k + 1): row j of its logits is the target's next-token distribution after ``d_1 .. d_j``.
Greedy requests keep the drafts that equal the target's argmax, then add the target's own token at the
first mismatch (or after the last draft: the bonus token), so the output is exactly plain greedy
decoding. Sampling requests use the standard rejection rule; an n-gram draft is a point mass q = delta_x,
so draft x is accepted with probability min(1, p(x) / q(x)) = p(x), and a rejection samples from
normalise(max(p - q, 0)), which is p with x removed. Either way the tokens follow p exactly.
"""

from __future__ import annotations

import torch

from pagedmla.engine.sampling import SamplingParams, sampling_probs


def accept_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k + 1, vocab] of one request's verify rows, draft its k tokens -> the tokens to append
    (the accepted drafts followed by the target's token: 1 .. k + 1 tokens)."""
    target = logits.argmax(dim=-1).tolist()
    out = []
    for j, token in enumerate(draft):
        if token != target[j]:
            break
        out.append(token)
    out.append(target[len(out)])
    return out


def accept_sampled(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                   generator: torch.Generator | None) -> list[int]:
    """Rejection sampling of point-mass drafts: the same contract as ``accept_greedy`` for a request
    that samples (temperature > 0), drawing from ``generator``."""
    out = []
    for j, token in enumerate(draft):
        probs = _normalised(logits[j], params)
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[token]:
            out.append(token)
            continue
        residual = probs.clone()
        residual[token] = 0.0
        # probs[token] < 1 here (u < 1 was not below it), so the residual keeps some mass.
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]))
        return out
    probs = _normalised(logits[len(draft)], params)
    out.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
    return out


def _normalised(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # The top_p filter leaves the kept mass below 1; acceptance compares against true probabilities.
    probs = sampling_probs(row, params)
    return probs / probs.sum()


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """logits [bs * (k + 1), vocab] of a verify step (request-major), drafts [bs][k] -> per request the
    tokens to append."""
    bs = len(drafts)
    if not bs or logits.shape[0] % bs or len(params) != bs or len(generators) != bs:
        raise ValueError(f"logits/drafts/params/generators: expected bs * (k + 1) logits rows and one draft, "
                         f"params and generator per request, got {logits.shape[0]} rows, {bs} drafts, "
                         f"{len(params)} params, {len(generators)} generators")
    rows = logits.view(bs, logits.shape[0] // bs, -1)
    out = []
    for i, draft in enumerate(drafts):
        if len(draft) != rows.shape[1] - 1:
            raise ValueError(f"drafts: request {i} has {len(draft)} draft tokens, "
                             f"the step verified {rows.shape[1] - 1}")
        if params[i].greedy:
            out.append(accept_greedy(rows[i], draft))
        else:
            out.append(accept_sampled(rows[i], draft, params[i], generators[i]))
    return out
