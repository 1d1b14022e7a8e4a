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

from pagedmla.engine.sampling import NonFiniteLogitsError, SamplingParams, sampling_probs


def accept_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k + 1, vocab] of one request's verify rows, draft its k tokens -> the tokens to append
    (the accepted drafts followed by the target's token: 1 .. k + 1 tokens)."""
    return accept_targets(logits.argmax(dim=-1).tolist(), draft)


def accept_targets(target: list[int], draft: list[int]) -> list[int]:
    """``accept_greedy`` given the target's argmax of each verify row (``verify`` reads them back for the
    whole batch at once)."""
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
    that samples (temperature > 0), drawing from ``generator``.

    Every draw is made up front on the device, so the decision costs one readback: a uniform per draft,
    and one token per verify row (row j < k from the residual p_j without d_j, the one used if d_j is the
    first rejected draft; row k from p_k, the bonus token if every draft is accepted). Draws that the
    decision does not use change nothing: each token still follows p exactly."""
    k = len(draft)
    probs = _normalised(logits[: k + 1], params)
    rows = torch.arange(k, device=probs.device)
    picked = torch.tensor(draft, dtype=torch.int64, device=probs.device)
    accept = torch.rand(k, generator=generator, device=probs.device) < probs[rows, picked]
    residual = probs.clone()
    residual[rows, picked] = 0.0
    # A draft with p = 1 leaves no residual mass, but it is always accepted (u < 1), so its row is never
    # used; multinomial only needs some mass there.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    candidates = torch.multinomial(residual, 1, generator=generator).view(-1)
    decided = torch.cat([accept.to(torch.int64), candidates]).tolist()
    accepted, tokens = decided[:k], decided[k:]
    n = accepted.index(0) if 0 in accepted else k
    return draft[:n] + [tokens[n]]


def _normalised(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # The top_p filter leaves the kept mass below 1; acceptance compares against true probabilities.
    probs = sampling_probs(rows, params)
    return probs / probs.sum(dim=-1, keepdim=True)


def verify(logits: torch.Tensor, drafts: list[list[int]] | torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """logits [bs * (k + 1), vocab] of a verify step (request-major), drafts [bs][k] (host lists, or an
    int64 tensor [bs, k] on the logits' device: a draft model's tokens, read back together with the
    target's) -> per request the tokens to append. NonFiniteLogitsError when a request's rows hold an inf
    or NaN (its ``tokens`` carry the other requests' results)."""
    bs = len(drafts)
    if not bs or logits.shape[0] % bs or len(params) != bs or len(generators) != bs:
        raise ValueError(f"logits/drafts/params/generators: expected bs * (k + 1) logits rows and one draft, "
                         f"params and generator per request, got {logits.shape[0]} rows, {bs} drafts, "
                         f"{len(params)} params, {len(generators)} generators")
    rows = logits.view(bs, logits.shape[0] // bs, -1)
    on_device = isinstance(drafts, torch.Tensor)
    for i, draft in enumerate(drafts):
        if len(draft) != rows.shape[1] - 1:
            raise ValueError(f"drafts: request {i} has {len(draft)} draft tokens, "
                             f"the step verified {rows.shape[1] - 1}")
    # One readback of every row's argmax (for the greedy requests), of whether each request's rows are
    # finite (a request with an inf or NaN logit is reported, NonFiniteLogitsError, and never sampled), and
    # of the drafts made on the device.
    finite = torch.isfinite(rows).flatten(1).all(dim=-1)
    parts = [rows.argmax(dim=-1), finite.view(bs, 1).to(torch.int64)]
    if on_device:
        parts.append(drafts.to(torch.int64))
    read = torch.cat(parts, dim=1).tolist()
    k = rows.shape[1] - 1
    if on_device:
        drafts = [row[k + 2:] for row in read]
    out: list[list[int] | None] = []
    for i, draft in enumerate(drafts):
        *targets, ok = read[i][: k + 2]
        if not ok:
            out.append(None)
        elif params[i].greedy:
            out.append(accept_targets(targets, draft))
        else:
            out.append(accept_sampled(rows[i], draft, params[i], generators[i]))
    bad = [i for i, tokens in enumerate(out) if tokens is None]
    if bad:
        raise NonFiniteLogitsError(bad, out)
    return out
