"""DeepSeek-V2/V3 models on pagedmla: configuration, layers, checkpoint loading, the built-in ``tiny`` model."""

from pagedmla.model.config import CheckpointError, DeepseekConfig, RopeConfig, tiny_config
from pagedmla.model.context import StepContext
from pagedmla.model.deepseek import DeepseekForCausalLM
from pagedmla.model.factory import TINY, load_model, load_mtp
from pagedmla.model.loader import load_checkpoint, load_mtp_checkpoint
from pagedmla.model.mtp import DeepseekMTP
from pagedmla.model.random_weights import init_random_

__all__ = [
    "TINY",
    "CheckpointError",
    "DeepseekConfig",
    "DeepseekForCausalLM",
    "DeepseekMTP",
    "RopeConfig",
    "StepContext",
    "init_random_",
    "load_checkpoint",
    "load_model",
    "load_mtp",
    "load_mtp_checkpoint",
    "tiny_config",
]
