"""Test helper: drive an LLM step by step, requests joining at given steps, auditing the page books
after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedmla.engine import LLM, SamplingParams


@dataclass
class Run:
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> generated tokens
    steps: int = 0
    peak_pages: int = 0
    forms: set = field(default_factory=set)  # (mode, attention form) of every step


def drive(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
          join_at: list[int] | None = None) -> Run:
    """Run ``prompts`` (prompt i added before step ``join_at[i]``, default all at once; ``params`` one for
    all or one each) to completion."""
    join_at = join_at or [0] * len(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    run = Run()
    ids: dict[int, int] = {}
    while len(run.outputs) < len(prompts):
        for i, at in enumerate(join_at):
            if at == run.steps:
                ids[llm.add_request(prompts[i], params[i])] = i
        for out in llm.step():
            run.outputs[ids[out.request_id]] = out.token_ids
        if llm.runner.backend.metadata is not None:
            run.forms.add((llm.runner.backend.metadata.mode, llm.runner.backend.metadata.form))
        llm.pages.audit(llm.scheduler.running)
        run.peak_pages = max(run.peak_pages, llm.pages.allocator.num_used)
        run.steps += 1
        assert run.steps < 10_000
    return run
