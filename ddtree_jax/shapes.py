"""The named model shapes of the benchmark and the tools: one table.

`SHAPES` holds HF config fields of each target (overrides of `random_checkpoint`'s tiny configs, which are
the "tiny" shapes as they are); `DRAFTERS` the published DFlash layout of each target's drafter;
`shape_configs(name)` the two HF config dicts.
"""

from __future__ import annotations

SHAPES = {
    # HF config fields of the targets; the drafter follows the published DFlash layout for each.
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1e6),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                     rope_theta=1e6),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False,
                      rope_theta=1e6),
    "tiny": dict(),  # random_checkpoint.tiny_qwen3_config as it is
    # Hybrid targets (Gated DeltaNet + gated full attention), HF `qwen3_5_text` fields. Qwen3.6-27B's
    # text_config as research/dflash_qwen.md 5.2 gives it (every field is there; none falls back to
    # transformers' Qwen3_5TextConfig defaults). M-RoPE with text positions is 1-D RoPE, so mrope_section is
    # left out; MTP weights are not part of the target.
    "qwen3.6-27b": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                        intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        attn_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_value_head_dim=128,
                        vocab_size=248320, tie_word_embeddings=False, rms_norm_eps=1e-6,
                        max_position_embeddings=262144,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "tiny-hybrid": dict(model_type="qwen3_5_text"),  # random_checkpoint.tiny_qwen3_5_config as it is
    # The shipped demo pair's target (ddtree_jax/assets/demo; train.target.TargetShape's defaults come from here).
    "demo": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=768, vocab_size=8192, tie_word_embeddings=True, rope_theta=1e4,
                 max_position_embeddings=4096),
}
# The drafter of each shape, as the published DFlash checkpoint for that target lays it out (HF drafter
# config fields; research/dflash_qwen.md 1.3 and 1.6). Shapes not listed get the Qwen3-8B-DFlash layout
# (5 full-attention non-causal layers, 32/8 heads of 128, the target's FFN width, block 16).
DRAFTERS = {
    # z-lab/Qwen3.6-27B-DFlash: 4 causal sliding-window (2048) layers + 1 non-causal full-attention layer.
    "qwen3.6-27b": dict(num_hidden_layers=5, layer_types=["sliding_attention"] * 4 + ["full_attention"],
                        sliding_window=2048, use_sliding_window=True, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, intermediate_size=17408, rope_theta=1e7,
                        max_position_embeddings=262144, block_size=16, num_target_layers=64,
                        dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}),
    # The demo drafter: two non-causal layers tapping the demo target's layers 1-3.
    "demo": dict(num_hidden_layers=2, layer_types=["full_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=768, rope_theta=1e4, max_position_embeddings=4096, block_size=16,
                 num_target_layers=6, dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 2, 3]}),
    # The same layout in miniature: one causal sliding-window layer (window 8) and one non-causal layer.
    "tiny-hybrid": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                        use_sliding_window=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, block_size=16, num_target_layers=4,
                        dflash_config={"mask_token_id": 319, "target_layer_ids": [0, 3]}),
}
SMALL_SHAPES = ("tiny", "tiny-hybrid")  # CPU-sized: small ceiling measurements and drafters too


def shape_configs(shape: str, layers: int | None = None) -> tuple[dict, dict]:
    """HF config dicts (target, drafter) of a named shape; `layers` cuts the target to that many decoder
    layers (tools/compile_times.py; shapes without a listed drafter only)."""
    from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_5_config, tiny_qwen3_config

    fields = dict(SHAPES[shape])
    if layers:
        if shape in DRAFTERS:
            raise ValueError(f"--layers cuts Qwen3 shapes only, not {shape}")
        fields["num_hidden_layers"] = layers
    hybrid = fields.get("model_type") == "qwen3_5_text"
    target_raw = tiny_qwen3_5_config(**fields) if hybrid else tiny_qwen3_config(**fields)
    if shape in DRAFTERS:
        return target_raw, tiny_dflash_config(target_raw, **DRAFTERS[shape])
    n_layers = target_raw["num_hidden_layers"]
    big = shape not in SMALL_SHAPES
    # The published drafters' taps at 36 layers; otherwise five spread over the layers (fewer when few).
    taps = [1, 9, 17, 25, 33] if n_layers == 36 else \
        sorted({min(n_layers - 1, round(1 + i * max(n_layers - 4, 0) / 4)) for i in range(5)})
    drafter_raw = tiny_dflash_config(
        target_raw, num_hidden_layers=5 if big else 2, layer_types=["full_attention"] * (5 if big else 2),
        num_attention_heads=32 if big else 4, num_key_value_heads=8 if big else 2, head_dim=128 if big else 16,
        intermediate_size=target_raw["intermediate_size"], block_size=16,
        dflash_config={"mask_token_id": target_raw["vocab_size"] - 1,
                       "target_layer_ids": taps if big else [0, n_layers - 1]})
    return target_raw, drafter_raw
