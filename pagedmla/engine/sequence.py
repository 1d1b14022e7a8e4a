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
    their latent rows in the cache; a step processes ``token_ids[num_cached_tokens:]``. ``slot`` is the
    RequestTable row while the request holds pages (None otherwise)."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, device: torch.device):
        self.seq_id = next(_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step has to run through the model."""
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
