"""The target's decoding rule: greedy argmax, or a sample at a temperature with optional top-k / top-p.

The same rule decodes AR steps, chain positions and tree nodes, so speculative output follows the
target's own distribution exactly (sample-and-match). Warpers apply in HF's order: temperature,
top-k, top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean off. Static (hashable)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:
    """logits [..., v] float32 -> temperature-scaled logits with filtered tokens at -inf."""
    logits = logits.astype(jnp.float32) / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one).
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < config.top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def decode_tokens(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """One token per position: logits [..., v] -> int32 [...]; independent samples for every position."""
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, config), axis=-1).astype(jnp.int32)
