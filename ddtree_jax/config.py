"""Model configurations parsed from Hugging Face `config.json` files.

Each config is a frozen, hashable dataclass so it can be a static argument of jitted functions. Every
check lives here and fails with a `ConfigError` whose message names the file, the field, the value found
and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A config file is missing, unreadable, or holds a value this project cannot run."""


# transformers' RoPE types that are static rewrites of the inverse frequencies; "dynamic" and "longrope"
# change them with the sequence length and are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding as transformers computes it (`modeling_rope_utils`): inverse frequencies
    rewritten once by the rope type, and a factor on cos and sin. Fields are transformers'
    `rope_parameters` with its defaults filled in (`parse_rope`); a field only its types read is 1 otherwise.
    """

    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear, yarn, llama3: how many times longer the context than in pre-training
    original_max_position_embeddings: int = 0  # yarn, llama3: the pre-training context, in tokens
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn's mscale, 1 for other types)
    beta_fast: float = 32.0  # yarn: pairs turning more often than this in the original context are kept,
    beta_slow: float = 1.0  # yarn: pairs turning less often than this are divided by factor, a ramp between
    truncate: bool = True  # yarn: round the ramp's ends outwards to whole pairs
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are divided by factor,
    high_freq_factor: float = 4.0  # llama3: below original / high_freq_factor kept, a smooth blend between

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        """[rotary_dim // 2] float32 inverse frequencies (radians per position), in transformers' float32
        arithmetic, operation for operation (numpy's float32 `pow` may round one ulp from torch's)."""
        base = self.theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
        inv = 1.0 / base
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "yarn":
            return self._yarn(rotary_dim, base)
        if self.rope_type == "llama3":
            return self._llama3(inv)
        return inv

    def _yarn(self, rotary_dim: int, base: np.ndarray) -> np.ndarray:
        """YaRN (arXiv 2309.00071): dim pair i keeps its frequency where it turns more than beta_fast times in
        the original context, is divided by `factor` where it turns less than beta_slow times, and blends
        linearly between (the ramp runs over pair indices from `low` to `high`)."""
        def pair_turning(rotations: float) -> float:  # the (fractional) pair index turning `rotations` times
            return rotary_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) \
                / (2 * math.log(self.theta))

        low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        kept = 1 - ramp  # the share of pair i's original frequency (1 - (1 - ramp), as transformers rounds it)
        return (1.0 / (self.factor * base)) * (1 - kept) + (1.0 / base) * kept

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
        original = self.original_max_position_embeddings
        wavelength = 2 * math.pi / inv
        long_edge, short_edge = original / self.low_freq_factor, original / self.high_freq_factor
        scaled = np.where(wavelength > long_edge, inv / self.factor, inv)
        smooth = (original / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelength < short_edge) & ~(wavelength > long_edge)
        return np.where(medium, smoothed, scaled)


# Block-scaled FP8 weights, as Qwen publishes them (Qwen3-8B-FP8, Qwen3.6-27B-FP8) and transformers reads
# them (`FineGrainedFP8Config`, `integrations/finegrained_fp8.py`).
FP8_DEFAULT_BLOCK = (128, 128)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """`quantization_config` with `quant_method: fp8`: every projection (`Linear`) that `converts` names keeps
    a float8_e4m3fn weight [out, in] and its `weight_scale_inv` [ceil(out / block[0]), ceil(in / block[1])];
    the dense weight is each FP8 element times its block's scale. Activations are not quantised here (the
    models multiply 16- or 32-bit activations by the dequantised weight).

    `not_converted`: `modules_to_not_convert` patterns in our module names (a `qwen3_5` wrapper's
    'model.language_model.' rewritten to 'model.', as transformers renames them); a checkpoint without
    the list skips the output embedding, as transformers does.
    """

    block: tuple[int, int] = FP8_DEFAULT_BLOCK
    not_converted: tuple[str, ...] = ("lm_head",)

    def converts(self, module: str) -> bool:
        """Whether the projection named `module` (e.g. 'model.layers.0.mlp.up_proj') is FP8: transformers'
        `should_convert_module` rule. A pattern skips a module if it matches from the start up to a name
        boundary, as a regex ('model.layers.*.mlp' skips 'model.layers.11.mlp.up_proj'), or as a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.not_converted)


def parse_fp8(raw: dict[str, Any], where: str, text_prefix: str | None = None) -> Fp8Config | None:
    """The `quantization_config` of a config dict: None if there is none, else its `Fp8Config`. Anything but
    block-scaled e4m3 weights with float scales and dynamic (unstored) activation scales is refused.
    `text_prefix`: where the files keep the text model's 'model.' names ('model.language_model.' in a
    `qwen3_5` wrapper), rewritten in the patterns."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    f = _Fields(raw, where)
    if not isinstance(quant, dict):
        raise f.fail("quantization_config", f"expected an object, found {quant!r}")
    q = _Fields(quant, f"{where}: quantization_config")
    expected = {"quant_method": ("fp8", "block-scaled FP8 weights"), "fmt": ("e4m3", "float8_e4m3fn weights"),
                "activation_scheme": ("dynamic", "no stored activation scales"),
                "scale_fmt": ("float", "float32 or bfloat16 scales")}
    for field, (want, meaning) in expected.items():
        value = quant.get(field, want)
        if value != want:
            raise q.fail(field, f"{value!r} is not supported (expected {want!r}: {meaning})")
    block = quant.get("weight_block_size", list(FP8_DEFAULT_BLOCK))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise q.fail("weight_block_size", f"expected [rows, columns], two positive integers, found {block!r} "
                                          "(per-tensor scales are not supported)")
    if quant.get("modules_to_convert"):
        raise q.fail("modules_to_convert", f"{quant['modules_to_convert']!r}: FP8 embeddings are not supported")
    patterns = quant.get("modules_to_not_convert")
    if patterns is None:
        return Fp8Config(block=tuple(block))
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise q.fail("modules_to_not_convert", f"expected a list of module names, found {patterns!r}")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise q.fail("modules_to_not_convert", f"{p!r} is not a valid pattern ({e})") from None
    if text_prefix:
        patterns = [p.replace(text_prefix, "model.").replace(re.escape(text_prefix), re.escape("model."))
                    for p in patterns]
    return Fp8Config(block=tuple(block), not_converted=tuple(patterns))


def fp8_quantization_config(raw: dict[str, Any], block: tuple[int, int] = FP8_DEFAULT_BLOCK) -> dict[str, Any]:
    """The `quantization_config` that `conversions.convert quantize-fp8` writes for a config dict, in the
    published layout: embeddings, lm_head and norms stay as they are, and in a hybrid the Gated DeltaNet's
    small `in_proj_a`/`in_proj_b` too (its A_log, dt_bias and conv1d are no projections)."""
    skip = [] if DRAFTER_ARCHITECTURE in (raw.get("architectures") or []) else ["lm_head", "model.embed_tokens"]
    if raw.get("model_type") in ("qwen3_5", "qwen3_5_text"):
        skip += ["linear_attn.in_proj_a", "linear_attn.in_proj_b"]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            "modules_to_not_convert": skip}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Facts about a Qwen3 dense target (HF `model_type: qwen3`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    # Per layer: the sliding window in tokens, or None for full attention (HF: only when
    # `use_sliding_window` is true and `layer_types[i] == "sliding_attention"`).
    sliding_windows: tuple[int | None, ...]
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    fp8: Fp8Config | None = None  # block-scaled FP8 projections (`quantization_config`), or None
    # Decoder layers of a multi-token-prediction head trained for this target (`train/mtp.py`), stored beside it
    # (`mtp.*`, `MTPConfig`); 0: no head. Not an HF Qwen3 field: transformers keeps it as an unused attribute.
    mtp_num_hidden_layers: int = 0

    model_type = "qwen3"

    def num_params(self) -> int:
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = e * q + 2 * e * kv + q * e + 3 * e * f + 2 * e + 2 * self.head_dim
        return v * e * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + e


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Read `config.json` from a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"{file}: not found (a checkpoint folder needs a config.json)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(raw).__name__}")
    return raw


class _Fields:
    """Typed access to a config dict; every failure names the file and the field."""

    def __init__(self, raw: dict[str, Any], where: str):
        self.raw, self.where = raw, where

    def fail(self, field: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.where}: field '{field}': {msg}")

    def int(self, field: str, default: Any = dataclasses.MISSING, minimum: int = 1) -> int:
        value = self.raw.get(field, default)
        if value is dataclasses.MISSING:
            raise self.fail(field, "missing (expected an integer)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"expected an integer, found {value!r}")
        if value < minimum:
            raise self.fail(field, f"expected an integer >= {minimum}, found {value}")
        return value

    def float(self, field: str, default: Any = dataclasses.MISSING, positive: bool = True) -> float:
        value = self.raw.get(field, default)
        if value is dataclasses.MISSING:
            raise self.fail(field, "missing (expected a number)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(field, f"expected a finite number, found {value!r}")
        if positive and value <= 0:
            raise self.fail(field, f"expected a positive number, found {value}")
        return float(value)

    def bool(self, field: str, default: bool) -> bool:
        value = self.raw.get(field, default)
        if not isinstance(value, bool):
            raise self.fail(field, f"expected true or false, found {value!r}")
        return value

    def token_ids(self, field: str) -> tuple[int, ...]:
        value = self.raw.get(field)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.fail(field, f"expected a token id or a list of token ids, found {value!r}")
        return tuple(values)


def parse_attention_shape(f: _Fields) -> dict[str, int]:
    """The attention shape of every model here, under the config dataclasses' field names: hidden_size,
    num_heads, num_kv_heads (default: num_heads, which it must divide) and head_dim (default:
    hidden_size // num_heads)."""
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}")
    return dict(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=f.int("head_dim", hidden // heads))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times longer: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_rope(f: _Fields, head_dim: int, partial_rotary_default: float | None = None) -> tuple[RopeConfig, int]:
    """RoPE as transformers reads it, and the number of dims of each head it rotates (even).

    The parameters are `rope_scaling` if set (transformers prefers it), else `rope_parameters`; `rope_theta`
    and `partial_rotary_factor` are read there, else at the top level; the type is `rope_type`, else `type`,
    else "default"; `original_max_position_embeddings` defaults to `max_position_embeddings`. A YaRN
    `factor` that disagrees with max_position_embeddings / original_max_position_embeddings is used as
    given, as transformers does (with a warning; published Qwen3 configs disagree).
    `partial_rotary_default`: the share of each head rotated when the config does not say (Qwen3.5: 0.25);
    None for families that rotate whole heads (transformers' Qwen3 ignores `partial_rotary_factor` for
    default RoPE and cannot run another value with the other types, so that is refused).
    """
    field = "rope_scaling" if f.raw.get("rope_scaling") else "rope_parameters"
    params = f.raw.get(field) or {}
    if not isinstance(params, dict):
        raise f.fail(field, f"expected an object, found {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.fail(field, f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    sub = _Fields(params, f"{f.where}: {field}")

    def inside_else_top(name: str) -> _Fields:  # a value inside the rope object wins over the top level's
        return sub if name in params else f

    theta = inside_else_top("rope_theta").float("rope_theta", 10000.0)
    fraction_fields = inside_else_top("partial_rotary_factor")
    if partial_rotary_default is not None:
        fraction = fraction_fields.float("partial_rotary_factor", partial_rotary_default)
        if fraction > 1:
            raise fraction_fields.fail("partial_rotary_factor", f"expected a number in (0, 1], found {fraction}")
        rotary_dim = int(head_dim * fraction)
        if rotary_dim < 2 or rotary_dim % 2:
            raise fraction_fields.fail("partial_rotary_factor", f"{fraction} x head_dim {head_dim} = {rotary_dim} "
                                       "rotary dims; expected an even number >= 2 (RoPE rotates pairs)")
    else:
        fraction = fraction_fields.float("partial_rotary_factor", 1.0)
        if rope_type != "default" and fraction != 1:
            raise fraction_fields.fail("partial_rotary_factor", f"expected 1 (this model rotates whole heads), "
                                       f"found {fraction}")
        rotary_dim = head_dim
        if head_dim % 2:
            raise f.fail("head_dim", f"expected an even number (RoPE rotates pairs), found {head_dim}")

    if rope_type == "default":
        return RopeConfig(theta=theta), rotary_dim
    factor = sub.float("factor")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type=rope_type, factor=factor), rotary_dim
    original = sub.int("original_max_position_embeddings", f.int("max_position_embeddings", 32768))
    if rope_type == "llama3":
        low, high = sub.float("low_freq_factor"), sub.float("high_freq_factor")
        if high <= low:
            raise sub.fail("high_freq_factor", f"expected more than low_freq_factor={low}, found {high}")
        return RopeConfig(theta=theta, rope_type=rope_type, factor=factor, original_max_position_embeddings=original,
                          low_freq_factor=low, high_freq_factor=high), rotary_dim
    # yarn. transformers reads beta_fast, beta_slow, mscale and mscale_all_dim as `.get(name) or default`.
    if params.get("attention_factor") is not None:
        attention_factor = sub.float("attention_factor")
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention_factor = _yarn_mscale(factor, sub.float("mscale")) / _yarn_mscale(factor, sub.float("mscale_all_dim"))
    else:
        attention_factor = _yarn_mscale(factor)
    return RopeConfig(
        theta=theta, rope_type=rope_type, factor=factor, original_max_position_embeddings=original,
        attention_factor=attention_factor,
        beta_fast=sub.float("beta_fast") if params.get("beta_fast") else 32.0,
        beta_slow=sub.float("beta_slow") if params.get("beta_slow") else 1.0,
        truncate=sub.bool("truncate", True),
    ), rotary_dim


def parse_qwen3(raw: dict[str, Any], where: str = "config.json") -> Qwen3Config:
    """Build a `Qwen3Config` from a parsed HF `config.json` dict; `where` names the file in errors."""
    f = _Fields(raw, where)
    model_type = raw.get("model_type")
    if model_type != "qwen3":
        raise f.fail("model_type", f"expected 'qwen3', found {model_type!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"expected 'silu', found {raw.get('hidden_act')!r}")
    if raw.get("attention_bias", False):
        raise f.fail("attention_bias", "biased q/k/v/o projections are not supported (expected false)")

    shape = parse_attention_shape(f)
    rope, _ = parse_rope(f, shape["head_dim"])
    num_layers = f.int("num_hidden_layers")

    layer_types = raw.get("layer_types")
    window = f.int("sliding_window", 4096) if f.bool("use_sliding_window", False) else None
    if layer_types is None:
        max_window_layers = f.int("max_window_layers", num_layers, minimum=0)
        layer_types = [
            "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise f.fail("layer_types", f"expected a list of {num_layers} entries, found {layer_types!r}")
    for i, kind in enumerate(layer_types):
        if kind not in ("full_attention", "sliding_attention"):
            raise f.fail("layer_types", f"entry {i} is {kind!r}; expected 'full_attention' or 'sliding_attention'")
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)

    return Qwen3Config(
        **shape,
        vocab_size=f.int("vocab_size"),
        intermediate_size=f.int("intermediate_size"),
        num_layers=num_layers,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope=rope,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        sliding_windows=windows,
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        eos_token_ids=f.token_ids("eos_token_id"),
        bos_token_id=(f.token_ids("bos_token_id") or (None,))[0],
        pad_token_id=(f.token_ids("pad_token_id") or (None,))[0],
        fp8=parse_fp8(raw, where),
        mtp_num_hidden_layers=f.int("mtp_num_hidden_layers", 0, minimum=0),
    )


# ----------------------------------------------------------------------------------------------------
# Qwen3.5 / Qwen3.6 hybrid targets (Gated DeltaNet + gated full attention)

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    """Facts about a Qwen3.5/3.6 hybrid target (HF `model_type: qwen3_5` with a `text_config`, or
    `qwen3_5_text`). Field names shared with `Qwen3Config` mean the same thing.

    `layer_types[i]` is "linear_attention" (a Gated DeltaNet layer with a recurrent state) or
    "full_attention" (gated GQA over the KV cache). RoPE rotates only the first `rotary_dim` dims of each
    head. `hf_model_type` records the file layout: "qwen3_5" stores text weights under
    `model.language_model.`, "qwen3_5_text" under `model.`. `mtp_num_hidden_layers` decoder layers of a
    multi-token-prediction head ship beside the target (`mtp.*` tensors, `MTPConfig`); 0: no head.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    rotary_dim: int  # int(head_dim * partial_rotary_factor), even
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    linear_conv_kernel: int
    linear_key_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    attn_output_gate: bool = True
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    hf_model_type: str = "qwen3_5_text"
    fp8: Fp8Config | None = None
    mtp_num_hidden_layers: int = 0

    model_type = "qwen3_5"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Ids of the full-attention layers (each owns one KV cache layer, in this order)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Ids of the Gated DeltaNet layers (each owns one recurrent state, in this order)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v] of a Gated DeltaNet layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def num_params(self) -> int:
        e, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = e * q * (2 if self.attn_output_gate else 1) + 2 * e * kv + q * e + 2 * d
        hv, conv, vd = self.linear_num_value_heads, self.linear_conv_dim, self.linear_value_dim
        gdn = e * conv + e * vd + 2 * e * hv + conv * self.linear_conv_kernel + 2 * hv \
            + self.linear_value_head_dim + vd * e
        common = 3 * e * f + 2 * e
        mixers = len(self.attention_layers) * attn + len(self.linear_layers) * gdn
        return v * e * (1 if self.tie_word_embeddings else 2) + self.num_layers * common + mixers + e


def parse_qwen3_5(raw: dict[str, Any], where: str = "config.json") -> Qwen3_5Config:
    """Build a `Qwen3_5Config` from a `qwen3_5` (fields inside `text_config`) or `qwen3_5_text` config dict.

    M-RoPE with identical text positions for its three sections is ordinary 1-D RoPE, so `mrope_section`
    and `mrope_interleaved` are accepted and ignored; the rope types are `parse_rope`'s.
    """
    top = _Fields(raw, where)
    model_type = raw.get("model_type")
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise top.fail("text_config", f"missing or not an object (found {text!r}); a qwen3_5 config keeps its "
                                          "language model's fields there")
        f = _Fields(text, f"{where}: text_config")
    elif model_type == "qwen3_5_text":
        text, f = raw, top
    else:
        raise top.fail("model_type", f"expected 'qwen3_5' or 'qwen3_5_text', found {model_type!r}")
    if text.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"expected 'silu', found {text.get('hidden_act')!r}")
    if text.get("attention_bias", False):
        raise f.fail("attention_bias", "biased q/k/v/o projections are not supported (expected false)")
    if text.get("output_gate_type", "swish") != "swish":
        raise f.fail("output_gate_type",
                     f"expected 'swish' (SiLU-gated RMSNorm), found {text.get('output_gate_type')!r}")
    attn_output_gate = f.bool("attn_output_gate", True)
    if not attn_output_gate:
        raise f.fail("attn_output_gate", "false is not supported (HF Qwen3.5 attention always has the output gate)")

    shape = parse_attention_shape(f)
    rope, rotary_dim = parse_rope(f, shape["head_dim"], partial_rotary_default=0.25)
    num_layers = f.int("num_hidden_layers")

    layer_types = text.get("layer_types")
    if layer_types is None:  # HF's default: every `full_attention_interval`-th layer is full attention
        interval = f.int("full_attention_interval", 4)
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise f.fail("layer_types", f"expected a list of {num_layers} entries, found {layer_types!r}")
    for i, kind in enumerate(layer_types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise f.fail("layer_types", f"entry {i} is {kind!r}; expected {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")

    k_heads = f.int("linear_num_key_heads", 16)
    v_heads = f.int("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise f.fail("linear_num_value_heads", f"{v_heads} is not a multiple of linear_num_key_heads={k_heads}")
    # EOS: the text config's and, for a qwen3_5 wrapper, the top level's too (it keeps the chat EOS there).
    eos = tuple(dict.fromkeys(f.token_ids("eos_token_id") + (top.token_ids("eos_token_id") if f is not top else ())))
    tie = top.bool("tie_word_embeddings", False) if "tie_word_embeddings" in raw and model_type == "qwen3_5" \
        else f.bool("tie_word_embeddings", False)
    return Qwen3_5Config(
        **shape,
        vocab_size=f.int("vocab_size"),
        intermediate_size=f.int("intermediate_size"),
        num_layers=num_layers,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope=rope,
        rotary_dim=rotary_dim,
        tie_word_embeddings=tie,
        layer_types=tuple(layer_types),
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        linear_conv_kernel=f.int("linear_conv_kernel_dim", 4, minimum=2),
        linear_key_head_dim=f.int("linear_key_head_dim", 128),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_value_head_dim=f.int("linear_value_head_dim", 128),
        attn_output_gate=attn_output_gate,
        eos_token_ids=eos,
        bos_token_id=((f.token_ids("bos_token_id") or top.token_ids("bos_token_id")) or (None,))[0],
        pad_token_id=((f.token_ids("pad_token_id") or top.token_ids("pad_token_id")) or (None,))[0],
        hf_model_type=model_type,
        fp8=parse_fp8(raw, where, "model.language_model." if model_type == "qwen3_5" else None),
        mtp_num_hidden_layers=f.int("mtp_num_hidden_layers", 0, minimum=0),
    )


TARGET_PARSERS = {"qwen3": parse_qwen3, "qwen3_5": parse_qwen3_5, "qwen3_5_text": parse_qwen3_5}


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """A multi-token-prediction head beside a target (`mtp.*` tensors, `models/mtp.py`): `num_layers` gated
    full-attention decoder layers, a fusion `fc` and three zero-centred norms, shaped by `layers`; it borrows
    the target's embedding and lm_head.

    `layers`: what the head's decoder layers and norms are built from (sizes, heads, RoPE, eps). For a
    Qwen3.5/3.6 target, the head Qwen ships: the target's own config (the head's layer is shaped as the
    target's full-attention layers). For a dense Qwen3 target, a head trained by this project
    (`train/mtp.py`): the same module, its layer given the dense target's dimensions (`dense_mtp_layers`).
    """

    layers: Qwen3_5Config

    @property
    def num_layers(self) -> int:
        return self.layers.mtp_num_hidden_layers

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """No tapped layers: the head reads the target's final (normed) hidden state (`ForwardOut.hidden`)."""
        return ()


def dense_mtp_layers(target: Qwen3Config) -> Qwen3_5Config:
    """The shape of an MTP head's decoder layers for a dense Qwen3 target: a Qwen3.5 gated full-attention layer
    with the target's hidden size, MLP width, heads, KV heads, head_dim, RMSNorm eps and RoPE, rotating whole
    heads as the target does (rotary_dim = head_dim); `mtp_num_hidden_layers` of them. The linear-attention
    fields are Qwen3.5's defaults, unused (every layer here is full attention); no FP8."""
    return Qwen3_5Config(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_layers=target.mtp_num_hidden_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope=target.rope, rotary_dim=target.head_dim,
        tie_word_embeddings=target.tie_word_embeddings, layer_types=(FULL_ATTENTION,) * target.mtp_num_hidden_layers,
        max_position_embeddings=target.max_position_embeddings, linear_conv_kernel=4, linear_key_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_value_head_dim=128,
        eos_token_ids=target.eos_token_ids, bos_token_id=target.bos_token_id, pad_token_id=target.pad_token_id,
        mtp_num_hidden_layers=target.mtp_num_hidden_layers)


def mtp_config(target, where: str = "config.json") -> MTPConfig:
    """The MTP head of a parsed target config (Qwen3.5/3.6, or dense Qwen3 with a trained head), or a
    ConfigError saying why it has none."""
    if target.mtp_num_hidden_layers == 0:
        raise ConfigError(f"{where}: field 'mtp_num_hidden_layers' is missing or 0: a {target.model_type} target "
                          "has no multi-token-prediction head (--mode mtp needs a Qwen3.5/3.6 checkpoint that ships "
                          "one, or a head trained with python -m ddtree_jax.train.mtp: `mtp.*` tensors)")
    return MTPConfig(target if isinstance(target, Qwen3_5Config) else dense_mtp_layers(target))


def load_target_config(path: str | Path) -> Qwen3Config | Qwen3_5Config:
    """Parse the target config in a checkpoint folder; the model_type picks the parser."""
    path = Path(path)
    return parse_target(read_config_json(path), str(path / "config.json" if path.is_dir() else path))


def parse_target(raw: dict[str, Any], where: str = "config.json") -> Qwen3Config | Qwen3_5Config:
    """A target config dict parsed by its model_type's parser; `where` names the file in errors."""
    model_type = raw.get("model_type")
    parser = TARGET_PARSERS.get(model_type)
    if parser is None:
        raise ConfigError(
            f"{where}: field 'model_type': {model_type!r} is not a supported target "
            f"(supported: {', '.join(sorted(TARGET_PARSERS))})"
        )
    return parser(raw, where)


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """EOS ids from `generation_config.json`, if the folder has one (HF merges these with the config's)."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return ()
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    return _Fields(raw if isinstance(raw, dict) else {}, str(file)).token_ids("eos_token_id")


# ----------------------------------------------------------------------------------------------------
# DFlash drafter


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Facts about a DFlash block-diffusion drafter (HF `architectures: ["DFlashDraftModel"]`).

    The drafter has no embedding and no lm_head: it borrows the target's. `layer_causal[i]` and
    `layer_windows[i]` give layer i's mask: causal inside the block or not, and the sliding window on
    absolute positions (None: unwindowed).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    layer_causal: tuple[bool, ...]
    layer_windows: tuple[int | None, ...]
    max_position_embeddings: int
    fp8: Fp8Config | None = None



DRAFTER_ARCHITECTURE = "DFlashDraftModel"


def parse_dflash(raw: dict[str, Any], where: str = "config.json") -> DFlashConfig:
    """Build a `DFlashConfig` from a drafter's HF `config.json` dict, as the published checkpoints lay it out."""
    f = _Fields(raw, where)
    archs = raw.get("architectures") or []
    if DRAFTER_ARCHITECTURE not in archs:
        raise f.fail("architectures", f"expected a list holding {DRAFTER_ARCHITECTURE!r}, found {archs!r}")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise f.fail("dflash_config", f"missing or not an object (found {dflash!r}); it must hold mask_token_id "
                                      "and target_layer_ids")
    sub = _Fields(dflash, f"{where}: dflash_config")
    if raw.get("hidden_act", "silu") != "silu":
        raise f.fail("hidden_act", f"expected 'silu', found {raw.get('hidden_act')!r}")
    if raw.get("attention_bias", False):
        raise f.fail("attention_bias", "biased projections are not supported (expected false)")

    if "block_size" in raw:
        block_size = f.int("block_size", minimum=2)
    elif "block_size" in dflash:
        block_size = sub.int("block_size", minimum=2)
    else:
        raise f.fail("block_size", "missing (expected at top level or inside dflash_config)")
    mask_token_id = sub.int("mask_token_id", minimum=0)
    layer_ids = dflash.get("target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layer_ids):
        raise sub.fail("target_layer_ids", f"expected a non-empty list of layer indices, found {layer_ids!r}")

    shape = parse_attention_shape(f)
    rope, _ = parse_rope(f, shape["head_dim"])
    num_layers = f.int("num_hidden_layers")
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise f.fail("layer_types", f"expected a list of {num_layers} entries, found {layer_types!r}")
    for i, kind in enumerate(layer_types):
        if kind not in ("full_attention", "sliding_attention"):
            raise f.fail("layer_types", f"entry {i} is {kind!r}; expected 'full_attention' or 'sliding_attention'")
    # As the reference: a window only where HF's config keeps one (use_sliding_window), on sliding layers;
    # causal per layer from `is_causal` if set, else sliding layers are causal.
    window = f.int("sliding_window") if f.bool("use_sliding_window", False) and raw.get("sliding_window") else None
    is_causal = raw.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise f.fail("is_causal", f"expected true, false or null, found {is_causal!r}")
    causal = tuple(kind == "sliding_attention" if is_causal is None else is_causal for kind in layer_types)
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)

    num_target_layers = raw.get("num_target_layers")
    if num_target_layers is not None:
        num_target_layers = f.int("num_target_layers")
    return DFlashConfig(
        **shape,
        intermediate_size=f.int("intermediate_size"),
        num_layers=num_layers,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope=rope,
        vocab_size=f.int("vocab_size"),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=num_target_layers,
        layer_causal=causal,
        layer_windows=windows,
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        fp8=parse_fp8(raw, where),
    )


def load_drafter_config(path: str | Path) -> DFlashConfig:
    path = Path(path)
    return parse_dflash(read_config_json(path), str(path / "config.json" if path.is_dir() else path))


def check_pair(target: Qwen3Config, drafter: DFlashConfig, *, allow_layer_mismatch: bool = False,
               where: str = "drafter config.json") -> None:
    """Check that a drafter can run on a target; a ConfigError names the field, the value and what was expected."""
    if drafter.mask_token_id >= target.vocab_size:
        raise ConfigError(f"{where}: field 'dflash_config.mask_token_id': {drafter.mask_token_id} is not a row of the "
                          f"target's embedding (expected 0..{target.vocab_size - 1})")
    for layer_id in drafter.target_layer_ids:
        if layer_id >= target.num_layers:
            raise ConfigError(f"{where}: field 'dflash_config.target_layer_ids': {layer_id} is not a target layer "
                              f"(expected 0..{target.num_layers - 1}; found {list(drafter.target_layer_ids)})")
    if drafter.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: field 'hidden_size': {drafter.hidden_size}, expected the target's "
                          f"hidden_size {target.hidden_size} (the drafter uses the target's embedding and lm_head)")
    if drafter.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: field 'vocab_size': {drafter.vocab_size}, expected the target's vocab_size "
                          f"{target.vocab_size}")
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_layers \
            and not allow_layer_mismatch:
        raise ConfigError(f"{where}: field 'num_target_layers': {drafter.num_target_layers}, but the target has "
                          f"{target.num_layers} layers (a drafter trained for another target? "
                          "--allow-layer-mismatch overrides)")
