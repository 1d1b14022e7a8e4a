"""A small serving engine over pagedmla (nano-vllm style): sequences, scheduler, model runner, LLM API."""

from pagedmla.engine.cuda_graph import GraphRunner
from pagedmla.engine.drafter import NgramDrafter
from pagedmla.engine.kv_pages import KVPages, PageBookError
from pagedmla.engine.llm import LLM, CompletionOutput, EngineStats, RequestOutput, StreamDelta
from pagedmla.engine.model_runner import ModelRunner
from pagedmla.engine.mtp_drafter import MTPDrafter
from pagedmla.engine.prefix_cache import PrefixCache
from pagedmla.engine.sampling import SamplingParams, sample
from pagedmla.engine.scheduler import ScheduledBatch, Scheduler
from pagedmla.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineStats",
    "GraphRunner",
    "KVPages",
    "MTPDrafter",
    "ModelRunner",
    "NgramDrafter",
    "PageBookError",
    "PrefixCache",
    "RequestOutput",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "StreamDelta",
    "sample",
]
