"""The multi-token-prediction (MTP) head that Qwen3.5/3.6 checkpoints ship beside the target (`mtp.*`), as
NNX modules and pure functions: the drafter of `--mode mtp` (and, trained by this project, of a dense target).

One step at position i takes a token and a hidden state (vLLM `vllm/model_executor/models/qwen3_5_mtp.py`,
`Qwen3_5MultiTokenPredictor.forward`; SGLang `python/sglang/srt/models/qwen3_5_mtp.py` computes the same):

    x   = fc(concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])   (embedding first)
    x   = decoder layer 0 at position i: gated full attention over the head's own KV cache (as the target's
          full-attention layers: q/k norms, partial RoPE, output gate), then the SwiGLU MLP, pre-norm residuals
    out = norm(x);  logits = the target's lm_head(out)

The embedding and lm_head are the target's; every norm is zero-centred (`(1 + w) * x / rms(x)`).

The same module drafts for a dense Qwen3 target when a head was trained for it (`train/mtp.py`): its decoder
layer is a gated full-attention layer with the dense target's dimensions and RoPE, rotating whole heads
(`config.dense_mtp_layers`), and it reads the dense target's final normed hidden state (`ForwardOut.hidden` of
every target family), as below; the lm_head is `qwen3.logits` for both families.

Which hidden state feeds which step (vLLM `vllm/v1/spec_decode/llm_base_proposer.py`):
- The first step pairs a position with the target's hidden state there and the token one position later:
  `set_inputs_first_pass` shifts the target's token ids by one ("[a1, b1, b2, ...] -> [b1, b2, ...]"), puts
  the newly sampled token in the last slot, keeps the target's positions, and passes `target_hidden_states`,
  the target model's output, which Qwen3.5's model returns after its final norm (`ForwardOut.hidden` here).
- A later step pairs the token the previous step drafted with the previous step's own output, one position
  further (`propose`: `positions += 1`; for Qwen3.5 `model_returns_tuple()` is false, so the returned hidden
  states, after `mtp.norm`, are both the logits' input and the next step's hidden).
- Every step runs layer 0: `Qwen3_5MTP.forward` calls the predictor without `spec_step_idx` (its default 0),
  and SGLang builds the head with one layer. The published checkpoints have `mtp_num_hidden_layers` 1; any
  further layers are loaded (loading is strict and conversions keep them) but not run.

Laid out over a round here (m = `--mtp-steps`, L = the target's committed tokens, x_L the newest emitted one):
- `ingest` runs the head over newly committed positions with the target's verified hidden states and keeps
  their K/V, so that slot i pairs (token i + 1, target hidden i) and the head's cache is as long as the
  target's (`cache.MTPCache`); it runs in prefill over the prompt and in every round's commit over the
  accepted tokens (whose last is the round's bonus token: its output is the next round's first step).
- `draft_logits`: draft 1 is the lm_head of that kept output; step j = 1 .. m - 1 feeds (draft j, the
  previous output) at position L - 1 + j, seeing the committed slots and the chain's own K/V. Those K/V stay
  in a small buffer of m - 1 rows: the draft never writes the cache, so the commit updates it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache, MTPCache, advance, write_pending
from ddtree_jax.config import FULL_ATTENTION, MTPConfig
from ddtree_jax.models import qwen3, qwen3_5
from ddtree_jax.models.contract import Runtime, causal_mask
from ddtree_jax.models.layers import Linear, add_and_norm, cached_attention, rope_cos_sin
from ddtree_jax.models.params import ModelParams, abstract_params, random_params

PREFIX = "mtp."  # where a checkpoint keeps the head's tensors, beside the target's


class MultiTokenPredictor(nnx.Module):
    """HF names under `mtp.`: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.{i}.*, norm."""

    def __init__(self, config: MTPConfig, *, dtype, rngs):
        text = config.layers
        e, eps = text.hidden_size, text.rms_norm_eps
        self.fc = Linear(2 * e, e, ("embed", None), dtype=dtype, rngs=rngs)  # input: [embedding | hidden]
        self.pre_fc_norm_embedding = qwen3_5.ZeroCenteredRMSNorm(e, eps, dtype=dtype)
        self.pre_fc_norm_hidden = qwen3_5.ZeroCenteredRMSNorm(e, eps, dtype=dtype)
        self.layers = nnx.List([qwen3_5.DecoderLayer(text, FULL_ATTENTION, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_layers)])
        self.norm = qwen3_5.ZeroCenteredRMSNorm(e, eps, dtype=dtype)


class MTPHead(nnx.Module):
    """The head alone, so that its parameters' NNX paths are the checkpoint's names ('mtp.fc.weight', ...)."""

    def __init__(self, config: MTPConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.mtp = MultiTokenPredictor(config, dtype=dtype, rngs=rngs)


def build(config: MTPConfig, dtype=jnp.bfloat16):
    return lambda rngs: MTPHead(config, dtype=dtype, rngs=rngs)


def abstract(config: MTPConfig, dtype=jnp.bfloat16) -> ModelParams:
    return abstract_params(build(config, dtype), config)


def init_random(config: MTPConfig, dtype=jnp.bfloat16, seed: int = 0) -> ModelParams:
    return random_params(build(config, dtype), config, seed)


def create_cache(config: MTPConfig, batch: int, capacity: int, dtype) -> MTPCache:
    """An empty cache: K/V of the one decoder layer that runs, and a zero hidden state."""
    text = config.layers
    kv = KVCache.create(1, batch, capacity, text.num_kv_heads, text.head_dim, dtype)
    return MTPCache(kv=kv, hidden=jnp.zeros((batch, text.hidden_size), dtype))


# ----------------------------------------------------------------------------------------------------
# One step, in three parts (the draft puts its own attention between them)


def fuse(head: MultiTokenPredictor, target: ModelParams, tokens: jax.Array, hidden: jax.Array,
         runtime: Runtime) -> jax.Array:
    """The decoder layer's input: tokens [b, t] int, hidden [b, t, e] -> [b, t, e] in hidden's dtype."""
    embedded = target.module().model.embed_tokens(tokens).astype(hidden.dtype)
    fused = jnp.concatenate([head.pre_fc_norm_embedding(embedded), head.pre_fc_norm_hidden(hidden)], axis=-1)
    return head.fc(fused, runtime)


def project(head: MultiTokenPredictor, config: MTPConfig, x: jax.Array, positions: jax.Array, runtime: Runtime):
    """Layer 0's attention inputs for x [b, t, e] at positions [b, t]: (q, gate, k, v) as
    `qwen3_5.GatedAttention.project`."""
    cos, sin = rope_cos_sin(positions, config.layers.rope, config.layers.rotary_dim)
    layer = head.layers[0]
    return layer.self_attn.project(add_and_norm(layer.input_layernorm, x, None, runtime)[1], cos, sin, runtime)


def finish(head: MultiTokenPredictor, x: jax.Array, attended: jax.Array, gate: jax.Array,
           runtime: Runtime) -> jax.Array:
    """The rest of the step after attention (attended [b, t, n*g, d]): residual, MLP, final norm -> [b, t, e]
    (the residual adds inside the norms' calls, `layers.add_and_norm`)."""
    layer = head.layers[0]
    x, h = add_and_norm(layer.post_attention_layernorm, x, layer.self_attn.output(attended, gate, runtime), runtime)
    return add_and_norm(head.norm, x, layer.mlp(h, runtime), runtime)[1]


# ----------------------------------------------------------------------------------------------------
# What the round calls


def ingest(params: ModelParams, target: ModelParams, tokens: jax.Array, hidden: jax.Array, counts: jax.Array,
           cache: MTPCache, runtime: Runtime = Runtime()) -> MTPCache:
    """Run the head over newly committed positions and keep the first `counts[r]` of each row (`ingest_outputs`'
    cache)."""
    return ingest_outputs(params, target, tokens, hidden, counts, cache, runtime)[1]


def ingest_outputs(params: ModelParams, target: ModelParams, tokens: jax.Array, hidden: jax.Array,
                   counts: jax.Array, cache: MTPCache, runtime: Runtime = Runtime()) -> tuple[jax.Array, MTPCache]:
    """Run the head over newly committed positions and keep the first `counts[r]` of each row: (the head's
    output at every new position [b, t, e], the cache). `ingest` keeps the cache; training reads the outputs.

    Position `cache.lengths + i` pairs tokens[:, i] (the token at the next position) with hidden[:, i] (the
    target's final hidden state at this position). tokens [b, t] int, hidden [b, t, e], counts [b] int
    (0 for a row that is done; rows beyond counts are padding). Returns the cache `counts` slots longer
    whose `hidden` is the head's output at the last kept position (unchanged where counts is 0).

    Example: prefill of prompt [a b c] with first emitted token y: tokens [b c y], target hidden states at
    positions 0, 1, 2, counts 3; a round that committed [x d1] and emits [d1 y]: tokens [d1 y], hidden
    states of the target at x and d1, counts 2.
    """
    config: MTPConfig = params.config
    head = params.module().mtp
    t = tokens.shape[1]
    kv = cache.kv
    positions = kv.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    x = fuse(head, target, tokens, hidden.astype(kv.k[0].dtype), runtime)
    q, gate, k, v = project(head, config, x, positions, runtime)
    attended = cached_attention(q, kv.k[0], kv.v[0], kv.lengths, k, v, causal_mask(counts, t), positions,
                                scale=config.layers.head_dim ** -0.5, runtime=runtime)
    out = finish(head, x, attended, gate, runtime)
    last = jnp.take_along_axis(out, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    kv = KVCache(k=(write_pending(kv.k[0], k, kv.lengths),), v=(write_pending(kv.v[0], v, kv.lengths),),
                 lengths=kv.lengths)
    return out, MTPCache(kv=advance(kv, counts), hidden=jnp.where((counts > 0)[:, None], last, cache.hidden))


def draft_logits(params: ModelParams, target: ModelParams, cache: MTPCache, steps: int,
                 runtime: Runtime = Runtime(), tokens: jax.Array | None = None) -> jax.Array:
    """float32 logits [b, steps, v] of `steps` chained MTP steps after the committed cache; each step's input
    token is the previous step's argmax (the chain the round verifies), or, given `tokens` [b, steps - 1] int,
    tokens[:, j - 1] for step j + 1 (training feeds the true continuation: a draft only counts when it is it).

    Step 1 is the target's lm_head on `cache.hidden`. Step j + 1 (j = 1 .. steps - 1) runs the head on
    (draft j, step j's output) at position L - 1 + j, L = `cache.lengths`; it sees the committed slots and
    the K/V of steps 2 .. j + 1, which stay in a buffer of steps - 1 rows (buffer row i at position L + i):
    every call of the attention has the buffer's steps - 1 rows as its new tokens and the step's query on
    each row, and row i's output is step i + 2's (the causal mask keeps later rows unseen)."""
    config: MTPConfig = params.config
    head = params.module().mtp
    kv, hidden = cache.kv, cache.hidden
    logits = [qwen3.logits(target, hidden, runtime)]
    chain = steps - 1
    if chain == 0:
        return jnp.stack(logits, axis=1)
    b, _, n, d = kv.k[0].shape
    positions = kv.lengths[:, None] + jnp.arange(chain, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((chain, chain), bool)), (b, chain, chain))
    buffer_k = jnp.zeros((b, chain, n, d), kv.k[0].dtype)
    buffer_v = jnp.zeros((b, chain, n, d), kv.v[0].dtype)
    for i in range(chain):
        with jax.named_scope(f"mtp_step_{i + 2}"):
            token = jnp.argmax(logits[-1], axis=-1).astype(jnp.int32) if tokens is None else tokens[:, i]
            x = fuse(head, target, token[:, None], hidden[:, None], runtime)
            q, gate, k, v = project(head, config, x, positions[:, i:i + 1], runtime)
            buffer_k, buffer_v = buffer_k.at[:, i].set(k[:, 0]), buffer_v.at[:, i].set(v[:, 0])
            rows = jnp.broadcast_to(q, (b, chain) + q.shape[2:])
            attended = cached_attention(rows, kv.k[0], kv.v[0], kv.lengths, buffer_k, buffer_v, mask, positions,
                                        scale=config.layers.head_dim ** -0.5, runtime=runtime)[:, i:i + 1]
            hidden = finish(head, x, attended, gate, runtime)[:, 0]
            logits.append(qwen3.logits(target, hidden, runtime))
    return jnp.stack(logits, axis=1)
