"""Small randomly initialised checkpoints in the Hugging Face layout.

Used by the tests (as fixtures) and by the benchmark's weightless shapes. The weights are random, so the
text they produce is gibberish; the code paths (config parsing, safetensors loading, tokenizer,
generation) are the real ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddtree_jax.checkpoint import atomic_folder, write_hf_files

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def tiny_qwen3_config(**overrides) -> dict:
    """An HF `config.json` dict for a small Qwen3 (GQA 4/2, untied, 2 layers, vocab 320)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 256,
        "eos_token_id": 256,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def tiny_qwen3_5_config(**overrides) -> dict:
    """An HF `config.json` dict for a small Qwen3.5/3.6 hybrid (`qwen3_5_text`): 4 layers, three Gated
    DeltaNet layers then one gated full-attention layer (GQA 4/2, head_dim 16 half rotated), GDN 2 key heads
    -> 4 value heads of 16, conv kernel 4, untied, vocab 320."""
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def random_qwen3_arrays(config: dict, seed: int = 0, dtype=np.float32, std: float = 0.05) -> dict[str, np.ndarray]:
    """Random weights under HF names for a qwen3 config dict; norms are 1 + noise so they matter."""
    from ddtree_jax.config import parse_qwen3
    from ddtree_jax.models import qwen3

    parsed = parse_qwen3(config)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in {n: a.shape for n, a in qwen3.abstract(parsed).flat().items()}.items():
        if "norm" in name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = std * rng.standard_normal(shape)
        arrays[name] = value.astype(dtype)
    return arrays


def byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """Save a byte-level tokenizer (256 byte tokens, then EOS and mask; no merges) that AutoTokenizer loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, MASK_TOKEN])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte tokenizer ({tok.get_vocab_size()})")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, mask_token=MASK_TOKEN)
    fast.save_pretrained(str(folder))


def write_random_qwen3(out: str | Path, seed: int = 0, dtype=np.float32, with_tokenizer: bool = True,
                       force: bool = False, std: float = 0.05, **overrides) -> Path:
    """Write a small random Qwen3 checkpoint folder (config.json, model.safetensors, tokenizer), atomically.
    A larger weight `std` gives a more peaked next-token distribution."""
    config = tiny_qwen3_config(**overrides)
    arrays = random_qwen3_arrays(config, seed=seed, dtype=dtype, std=std)

    def write(tmp: Path):
        write_hf_files(tmp, arrays, config)
        if with_tokenizer:
            byte_tokenizer(tmp, config["vocab_size"])

    return atomic_folder(out, write, force=force)


def random_qwen3_5_arrays(config: dict, seed: int = 0, dtype=np.float32, std: float = 0.1) -> dict[str, np.ndarray]:
    """Random weights under our names (`qwen3_5_text` layout) for a Qwen3.5/3.6 config dict (`qwen3_5` or
    `qwen3_5_text`), the MTP head's (`mtp.*`) too when it has `mtp_num_hidden_layers`: A_log = log U(0.5, 4),
    dt_bias ~ N(0, 1), the gated norm 1 + N(0, 0.1), the zero-centred norms N(0, 0.1) (their weight is an
    offset from 1), every other weight N(0, std)."""
    from ddtree_jax.config import mtp_config, parse_qwen3_5
    from ddtree_jax.models import mtp, qwen3_5

    parsed = parse_qwen3_5(config)
    shapes = {n: a.shape for n, a in qwen3_5.abstract(parsed).flat().items()}
    if parsed.mtp_num_hidden_layers:
        shapes.update({n: a.shape for n, a in mtp.abstract(mtp_config(parsed)).flat().items()})
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            value = np.log(rng.uniform(0.5, 4.0, shape))
        elif name.endswith("dt_bias"):
            value = rng.standard_normal(shape)
        elif "linear_attn.norm" in name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "norm" in name:
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = std * rng.standard_normal(shape)
        arrays[name] = value.astype(dtype)
    return arrays


def published_qwen3_5(text_config: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """A `qwen3_5_text` config and weights laid out as the published Qwen3.5/3.6 checkpoints: `model_type:
    qwen3_5` with the text fields in `text_config`, the text weights under `model.language_model.`, lm_head
    and `mtp.*` at the top level, and a (tiny, random) vision tensor that a text target skips."""
    text = {k: v for k, v in text_config.items() if k not in ("architectures", "torch_dtype")}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": dict(text, model_type="qwen3_5_text"),
              "tie_word_embeddings": text.get("tie_word_embeddings", False), "torch_dtype": "float32"}
    stored = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
              for n, a in arrays.items()}
    stored["model.visual.patch_embed.proj.weight"] = np.zeros((4, 4), next(iter(arrays.values())).dtype)
    return config, stored


def write_random_qwen3_5(out: str | Path, seed: int = 0, dtype=np.float32, *, published: bool = False,
                         mtp_layers: int = 0, std: float = 0.1, with_tokenizer: bool = False, force: bool = False,
                         **overrides) -> Path:
    """Write a small random Qwen3.5/3.6 hybrid checkpoint folder, atomically: `tiny_qwen3_5_config(**overrides)`
    with `mtp_layers` MTP decoder layers (random `mtp.*` weights), as `qwen3_5_text` or, `published`, in the
    published layout (`published_qwen3_5`)."""
    config = tiny_qwen3_5_config(**overrides, **({"mtp_num_hidden_layers": mtp_layers} if mtp_layers else {}))
    arrays = random_qwen3_5_arrays(config, seed=seed, dtype=dtype, std=std)
    if published:
        config, arrays = published_qwen3_5(config, arrays)

    def write(tmp: Path):
        write_hf_files(tmp, arrays, config)
        if with_tokenizer:
            byte_tokenizer(tmp, tiny_qwen3_5_config(**overrides)["vocab_size"])

    return atomic_folder(out, write, force=force)


def tiny_dflash_config(target_config: dict, **overrides) -> dict:
    """An HF drafter `config.json` dict (published layout) fitting a target config dict: 2 layers, block 4,
    taps from the target's first and last layers, mask token = the target's last embedding row."""
    n_target = target_config["num_hidden_layers"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target_config["vocab_size"],
        "hidden_size": target_config["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": 4,
        "num_target_layers": n_target,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "use_sliding_window": False,
        "dflash_config": {"mask_token_id": target_config["vocab_size"] - 1,
                          "target_layer_ids": sorted({0, n_target - 1})},
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def random_dflash_arrays(config: dict, target_hidden_size: int, seed: int = 0, dtype=np.float32,
                         std: float = 0.05) -> dict[str, np.ndarray]:
    from ddtree_jax.config import parse_dflash
    from ddtree_jax.models import dflash

    parsed = parse_dflash(config)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, a in dflash.abstract(parsed, target_hidden_size).flat().items():
        value = 1.0 + 0.1 * rng.standard_normal(a.shape) if "norm" in name else std * rng.standard_normal(a.shape)
        arrays[name] = value.astype(dtype)
    return arrays


def write_random_dflash(out: str | Path, target_config: dict, seed: int = 0, dtype=np.float32, force: bool = False,
                        **overrides) -> Path:
    """Write a small random DFlash drafter folder for a target config dict, atomically."""
    config = tiny_dflash_config(target_config, **overrides)
    arrays = random_dflash_arrays(config, target_config["hidden_size"], seed=seed, dtype=dtype)
    return atomic_folder(out, lambda tmp: write_hf_files(tmp, arrays, config), force=force)
