"""DeepSeek-V2/V3 models on pagedmla: configuration, layers, checkpoint loading, the built-in ``tiny`` model."""

from pagedmla.model.config import CheckpointError, DeepseekConfig, RopeConfig, tiny_config
from pagedmla.model.context import StepContext
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.factory import TINY, load_model
from pagedmla.model.loader import load_checkpoint
from pagedmla.model.random_weights import init_random_

__all__ = [
    "TINY",
    "CheckpointError",
    "DeepseekConfig",
    "DeepseekForCausalLM",
    "RopeConfig",
    "StepContext",
    "init_random_",
    "load_checkpoint",
    "load_model",
    "tiny_config",
]
