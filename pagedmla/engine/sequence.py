"""One request inside the engine: its tokens, where it stands, and its cache slot."""

from __future__ import annotations

import enum
import itertools

import torch

from pagedmla.engine.sampling import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """token_ids: prompt followed by the generated tokens. ``num_cached_tokens`` tokens already have
    their latent rows in the cache; a step processes (a chunk of) ``token_ids[num_cached_tokens:]``.
    ``slot`` is the RequestTable row while the request holds pages (None otherwise).

    ``seq_id`` grows with arrival order, so it is also the request's age: preemption takes the
    youngest (largest id) first. ``token_times`` records when each output token was produced (the
    benchmark's time-to-first-token and inter-token latencies)."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, device: torch.device,
                 arrival_time: float = 0.0):
        self.seq_id = next(_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        # Why the request failed (finish_reason "error"): a step that could not sample or post-process it.
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self.arrival_time = arrival_time
        self.token_times: list[float] = []
        self.num_preemptions = 0
        # Full pages of this request already offered to the prefix cache: a commit offers the pages again
        # only once another one has filled.
        self.num_committed_pages = 0
        # Chained prefix-cache hashes of the full pages of token_ids so far (``extend_page_hashes``): tokens
        # are only ever appended, so the chain stays valid and each page is hashed once, preemption included.
        self.page_hashes: list[bytes] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens not yet run through the model (the next steps' work)."""
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
