"""Rotary position embeddings (RoPE) in Hugging Face Llama's rotate-half convention: the frequencies, with each
model.rope_scaling (linear, llama3, longrope, yarn) and a sliding-window layer's own base (model.rope_local_theta),
their cos/sin tables, and the rotation of a head's first rotary_dim channels."""

from __future__ import annotations

import math

import torch

from loom.engine.config import ModelConfig


def rotary_frequencies(config: ModelConfig, seq_length: int, device=None, local: bool = False) -> torch.Tensor:
    """The rotary_dim/2 angular frequencies of the rotary embedding in sequences of `seq_length` tokens, with
    config.rope_scaling applied (`local`: uses_local_rotary's, a sliding-window layer's of base
    model.rope_local_theta, unscaled)."""
    width = config.rotary_dim
    exponents = torch.arange(0, width, 2, device=device).float() / width
    if local:
        return 1.0 / config.rope_local_theta**exponents
    if config.rope_scaling == "longrope":  # the divisors of the context the sequence needs (Hugging Face's rule)
        long = seq_length > config.rope_original_max_positions
        factors = config.rope_long_factors if long else config.rope_short_factors
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * config.rope_theta**exponents)
    frequencies = 1.0 / config.rope_theta**exponents
    if config.rope_scaling == "linear":
        frequencies = frequencies / config.rope_scaling_factor
    if config.rope_scaling == "llama3":
        frequencies = _llama3_scaled(frequencies, config)
    if config.rope_scaling == "yarn":
        frequencies = _yarn_scaled(frequencies, config)
    return frequencies


def _yarn_scaled(frequencies: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    # YaRN: a frequency that turns few times over the pretraining context is interpolated (divided by the factor),
    # one that turns many times is kept; the bounds are channel-pair indices, rounded outwards as Hugging Face does.
    width, context = config.rotary_dim, config.rope_original_max_positions

    def pair_turning(times: float) -> float:  # the channel pair whose frequency turns `times` times over the context
        return width * math.log(context / (times * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low = max(math.floor(pair_turning(config.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(pair_turning(config.rope_yarn_beta_slow)), width - 1)
    pairs = torch.arange(width // 2, dtype=torch.float32, device=frequencies.device)
    interpolated = ((pairs - low) / ((high - low) or 0.001)).clamp(0.0, 1.0)
    return frequencies / config.rope_scaling_factor * interpolated + frequencies * (1 - interpolated)


def _llama3_scaled(frequencies: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    # Llama 3.1's scaling: long wavelengths (those the pretraining context never completed) are stretched by
    # the factor, short ones kept, and the band between blends the two linearly in context / wavelength.
    context = config.rope_original_max_positions
    low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_scaling_factor
    wavelength = 2 * math.pi / frequencies
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - blend) * frequencies / factor + blend * frequencies
    return torch.where(
        wavelength > context / low, frequencies / factor, torch.where(wavelength < context / high, frequencies, blended)
    )


def rotary_tables(
    seq_length: int, config: ModelConfig, device, first_position: int = 0, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [s, 1, 1, rotary_dim] for the rotate-half (Hugging Face Llama) convention, for the
    positions first_position .. seq_length - 1 of a sequence of seq_length tokens (decoding wants the new ones);
    `local`: uses_local_rotary's (rotary_frequencies)."""
    positions = torch.arange(first_position, seq_length, dtype=torch.float32, device=device)
    angles = torch.outer(positions, rotary_frequencies(config, seq_length, device, local))
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    if config.rope_scaling in ("longrope", "yarn") and not local:
        scale = config.rope_attention_factor
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def uses_local_rotary(config: ModelConfig, window: int | None) -> bool:
    """Whether a layer with sliding window `window` turns by the local rotary tables (model.rope_local_theta)."""
    return window is not None and config.rope_local_theta is not None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    width = cos.shape[-1]
    if width < x.shape[-1]:  # model.rotary_percent < 1: the head's first channels turn, the rest pass
        return torch.cat([apply_rotary(x[..., :width], cos, sin), x[..., width:]], dim=-1)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
