"""The target's decoding rule: greedy argmax, or a sample at a temperature with optional top-k / top-p.

The same rule decodes AR steps, chain positions and tree nodes, so speculative output follows the
target's own distribution exactly (sample-and-match). Warpers apply in HF's order: temperature,
top-k, top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# top-p first looks for its nucleus among this many most likely tokens (a top-k: ~50x cheaper than sorting a
# 152k vocabulary on a CPU); where they hold less than top_p of the mass it searches for the nucleus's
# threshold (32 bisection passes over the vocabulary, ~10x cheaper than the sort).
TOP_P_CANDIDATES = 64


class SamplingError(ValueError):
    """A sampling setting out of range; `field` names it (the command line maps it to its flag)."""

    def __init__(self, field: str, expected: str, got):
        self.field, self.expected, self.got = field, expected, got
        super().__init__(f"{field}: expected {expected}, got {got}")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean off. Static (hashable)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SamplingError("temperature", ">= 0 (0 is greedy)", self.temperature)
        if self.top_k < 0:
            raise SamplingError("top_k", ">= 0 (0 is off)", self.top_k)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", "a number in (0, 1] (1 is off)", self.top_p)

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
        logits = jnp.where(top_p_keep(logits, config.top_p), logits, -jnp.inf)
    return logits


def top_p_keep(logits: jax.Array, top_p: float) -> jax.Array:
    """[..., v] bool: the smallest set of most likely tokens whose probability reaches `top_p` (always the top
    one), without sorting the vocabulary.

    The rule is that of a stable descending sort: token j of that order is kept when the mass before it is
    < top_p, and tied tokens come in token-id order. Example: probabilities [0.05, 0.5, 0.15, 0.3], top_p 0.7:
    order 1, 3, 2, 0, mass before 0, 0.5, 0.8, 0.95 -> tokens 1 and 3. When the TOP_P_CANDIDATES most likely
    tokens of every row (`lax.top_k`, same tie order) hold top_p of the mass, the set lies among them and is
    read off directly; otherwise `_top_p_by_threshold` finds it.
    """
    logits = jnp.where(logits == 0, 0.0, logits)  # -0.0 ties with 0.0 (top_k and the bit keys would order them)
    probs = jax.nn.softmax(logits, axis=-1)
    candidates = jax.lax.top_k(logits, min(TOP_P_CANDIDATES, logits.shape[-1]))[1]
    p = jnp.take_along_axis(probs, candidates, axis=-1)
    mass = jnp.cumsum(p, axis=-1)

    def from_candidates():
        keep = (mass - p < top_p).reshape(-1, candidates.shape[-1])
        rows = jnp.arange(keep.shape[0])[:, None]
        flat = jnp.zeros((keep.shape[0], logits.shape[-1]), bool)
        return flat.at[rows, candidates.reshape(keep.shape)].set(keep).reshape(logits.shape)

    # The token after the candidates has mass[..., -1] before it: once that reaches top_p (every row: the
    # predicate must be one scalar for `cond` to run one branch), no token outside them is kept.
    return jax.lax.cond(jnp.all(mass[..., -1] >= top_p), from_candidates,
                        lambda: _top_p_by_threshold(logits, probs, top_p))


def _top_p_by_threshold(logits: jax.Array, probs: jax.Array, top_p: float) -> jax.Array:
    """`top_p_keep` by bisection: with m(k) the mass of the tokens whose logit key is > k (keys: the logits'
    float32 bits mapped to uint32 in the same order), token x is kept exactly when m(key_x) < top_p, plus
    the tie rule at the boundary. m never grows with k, so the smallest key k0 with m(k0) < top_p splits the
    vocabulary: keys above k0 are kept, below are not, and the j-th token (by id) holding key k0 is kept
    when m(k0) + j * p < top_p. 32 halvings of the uint32 range find k0."""
    bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
    keys = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))  # negative floats: all bits flipped

    def mass_above(k):
        return jnp.sum(jnp.where(keys > k[..., None], probs, 0.0), axis=-1)

    def halve(_, bounds):  # invariant: m(lo) >= top_p > m(hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = mass_above(mid) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    _, k0 = jax.lax.fori_loop(0, 32, halve, (keys.min(axis=-1) - 1, keys.max(axis=-1)))
    tied = keys == k0[..., None]
    rank = jnp.cumsum(tied, axis=-1) - tied
    return (keys > k0[..., None]) | (tied & (mass_above(k0)[..., None] + rank * probs < top_p))


def decode_tokens(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """One token per position: logits [..., v] -> int32 [...]; independent samples for every position."""
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, config), axis=-1).astype(jnp.int32)
