"""The RMSNorm scalings of HF's Qwen norms, on float32 rows and their inverse RMS: one definition for the add +
RMSNorm kernel (`pallas_kernels.rms_norm`), the streaming matmul's normalised rows (`stream_matmul`'s `norm`) and
their references. Works on jnp arrays and inside Pallas kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

KINDS = ("qwen3", "zero_centered")


def rms_inverse(s, *, eps: float, width: int):
    """float32 rows s [..., e] (padding entries 0; `width` the real e) -> 1 / sqrt(mean(s^2) + eps) [..., 1]."""
    return lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) / width + eps)


def scale_rows(s, rms_inv, w, *, kind: str, dtype):
    """float32 rows s [..., e] times their inverse RMS (broadcast), scaled by the weight w [e] as HF does, in `dtype`:
    "qwen3" (`Qwen3RMSNorm`): w * (s * rms_inv).astype(dtype), the product in `dtype`; "zero_centered"
    (`Qwen3_5RMSNorm`): (s * rms_inv * (1 + w)).astype(dtype), all in float32."""
    if kind == "qwen3":
        return (w.astype(dtype) * (s * rms_inv).astype(dtype)).astype(dtype)
    return (s * rms_inv * (1.0 + w.astype(jnp.float32))).astype(dtype)
