"""DeepSeek rotary embedding of the ``qk_rope_head_dim`` part, with YaRN frequency scaling.

The frequencies and the cos/sin magnitude (``attention_factor``) follow the YaRN recipe DeepSeek uses
(and transformers implements): per-dimension blend of interpolated and extrapolated frequencies
along a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedmla.config import yarn_mscale
from pagedmla.model.config import RopeConfig


def rope_inv_freq(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies float32 [dim // 2] (on the CPU, even under a meta-device context) and the cos/sin
    magnitude for a rotary part of width ``dim``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    pos_freqs = cfg.theta ** exponents
    if not cfg.is_yarn:
        return 1.0 / pos_freqs, 1.0
    factor = cfg.factor
    if cfg.attention_factor is not None:
        attention_factor = float(cfg.attention_factor)
    elif cfg.mscale and cfg.mscale_all_dim:
        attention_factor = yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        wavelengths = cfg.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # Written as transformers writes it (weight of extrapolation = 1 - ramp) so the floats agree bit for bit.
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, and their application in the model's pair layout (RopeConfig.style)."""

    def __init__(self, cfg: RopeConfig, dim: int):
        super().__init__()
        # A plain float32 attribute, not a buffer: model-wide dtype casts and meta-device materialisation must
        # not touch its values. It moves with the module (``_apply``: ``model.to(device)``, ``to_empty``), so that
        # no step copies it (a host-to-device copy inside a step synchronises); a module never moved still
        # works, moving it on first use.
        self.inv_freq, self.attention_factor = rope_inv_freq(cfg, dim)
        self.style = cfg.style

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        # Only the device of what fn makes of the table (a dtype cast or an empty copy would lose its values),
        # and never the meta device, which holds none.
        device = fn(self.inv_freq.new_empty(0)).device
        if device.type != "meta":
            self.inv_freq = self.inv_freq.to(device)
        return module

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int [T] -> (cos, sin) float32 [T, dim // 2], already scaled by attention_factor."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, dim] or [T, H, dim] (float32 math, result in x's dtype)."""
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        if self.style == "neox":
            a, b = xf[..., :half], xf[..., half:]
        else:
            a, b = xf[..., 0::2], xf[..., 1::2]
        ra = a * cos - b * sin
        rb = b * cos + a * sin
        if self.style == "complex":
            # DeepSeek-V2 keeps each rotated pair in place.
            out = torch.stack((ra, rb), dim=-1).flatten(-2)
        else:
            # V3 (rope_interleave) and NeoX both emit [first of each pair | second of each pair].
            out = torch.cat((ra, rb), dim=-1)
        return out.to(x.dtype)
