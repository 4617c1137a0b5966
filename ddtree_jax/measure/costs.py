"""The cost model: the least time a round (or a kernel) can take on a device, from its bytes and FLOPs.

A floor is max(bytes / bandwidth, FLOPs / bf16 matmul rate), with the ceilings measured on the same device
in the same run (`measure.ceilings`). Every ratio "x floor" in the benchmark, the kernel check and the docs
comes from here.
"""

from __future__ import annotations

from ddtree_jax.cache import committed_recurrent_bytes, recurrent_node_bytes  # noqa: F401 (part of the cost model)
from ddtree_jax.models import is_recurrent


def floor(bytes_: float, flops: float, ceilings: dict) -> tuple[float, str]:
    """(seconds, which ceiling binds: "bandwidth" or "matmul") = max(bytes / bandwidth, FLOPs / matmul rate)."""
    by_bytes = bytes_ / ceilings["bandwidth_bytes_per_s"]
    by_flops = flops / ceilings["bf16_flops_per_s"]
    return (by_bytes, "bandwidth") if by_bytes >= by_flops else (by_flops, "matmul")


def _nbytes(array) -> int:  # abstract arrays (ShapeDtypeStruct) have no nbytes
    return array.size * array.dtype.itemsize


def param_bytes(params) -> int:
    return sum(map(_nbytes, params.state_flat().values()))


def param_count(params) -> int:
    return sum(a.size for a in params.state_flat().values())


def table_and_head_bytes(params) -> tuple[int, int]:
    """(bytes of the input embedding table where it is not also the output head, bytes of the output head) of a
    target's parameters. A round gathers a few rows of the table (KiB) but reads the whole head for every pass
    that makes logits."""
    flat = params.state_flat()

    def nbytes(suffix):
        [array] = [a for name, a in flat.items() if name.endswith(suffix)]
        return _nbytes(array)

    table = nbytes("embed_tokens.weight")
    return (0, table) if params.config.tie_word_embeddings else (table, nbytes("lm_head.weight"))


def floor_terms(target, drafter, mode: str, tokens: int, context: int, block_size: int = 16, batch: int = 1) -> dict:
    """Bytes that one round moves and FLOPs that it does, at least (`batch` rows, bf16 weights and caches).

    Bytes: every weight that the round reads, once per pass that reads it: the target's actual parameters
    but its untied input embedding table (a round gathers a few of its rows: KiB, left out), and in the
    speculative modes the drafter's parameters and the output head again (the drafter's logits go through the
    target's lm_head: DFlash's block once, each of MTP's steps once); the K/V of `context` tokens in each of the
    target's attention layers (all layers of a Qwen3; the full-attention layers of a hybrid), and on a hybrid the
    recurrent states: the committed state read and written back, plus, when the verify walks a tree
    (DFlash/DDTree), every node's kept vectors written and read back once (`recurrent_node_bytes`).
    FLOPs: 2 x (target parameters, less an untied input embedding) per verified token, attention over the
    cache, on a hybrid the delta-rule update of every Gated DeltaNet layer per token, and 2 x the drafter's
    parameters per block slot. Everything but the weights scales with the rows.
    MTP (`drafter`: the target's head, `block_size` = its steps + 1): the head's steps run one after another,
    so its weights and the lm_head count once per step, and 2 x its parameters per step (the FLOPs of the
    drafter's logits are left out in every mode).
    Until 2026-12-05 the bytes counted every target parameter once, the untied embedding table included, and the
    head once in all modes: the same total for DFlash and DDTree where the table and the head are the same size
    (an untied Qwen), a floor 8% too high for the Qwen3-8B shape's AR step (docs/performance.md).
    """
    cfg = target.config
    hybrid = is_recurrent(cfg)
    attn_layers = len(cfg.attention_layers) if hybrid else cfg.num_layers
    speculative = mode != "ar"
    draft_passes, draft_tokens = (block_size - 1, 1) if mode == "mtp" else (1, block_size)
    table_bytes, head_bytes = table_and_head_bytes(target)
    weight_bytes = param_bytes(target) - table_bytes
    if speculative:
        weight_bytes += draft_passes * (param_bytes(drafter) + head_bytes)
    kv_bytes = batch * 2 * attn_layers * context * cfg.num_kv_heads * cfg.head_dim * 2
    recurrent_bytes = batch * 2 * committed_recurrent_bytes(cfg)
    if speculative:
        recurrent_bytes += batch * 2 * recurrent_node_bytes(cfg, tokens)
    embed = cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    flops = 2 * (param_count(target) - embed) * tokens
    flops += 4 * attn_layers * cfg.num_heads * cfg.head_dim * context * tokens  # attention over the cache
    if hybrid:  # decay, read, update and output of a Hv x Dk x Dv state per token and layer
        flops += 7 * len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim \
            * cfg.linear_value_head_dim * tokens
    if speculative:
        flops += 2 * param_count(drafter) * draft_tokens * draft_passes  # the drafter's block, or the head's steps
    flops *= batch
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "recurrent_bytes": recurrent_bytes,
            "bytes": weight_bytes + kv_bytes + recurrent_bytes, "flops": flops}


def attention_cost(b: int, s: int, t: int, hq: int, n: int, d: int, itemsize: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one tree-attention call: the K/V cache read, q and the new K/V read, the output
    written, the int8 mask; dense FLOPs (scores and values over s + t keys)."""
    kv_cache = 2 * b * s * n * d * itemsize
    tree = b * t * (2 * hq + 2 * n) * d * itemsize + b * t * t
    return kv_cache + tree, 4 * b * hq * d * t * (s + t)
