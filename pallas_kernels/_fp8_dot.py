"""An FP8 x FP8 -> float32 tile product for Pallas Triton kernels that Hopper runs on FP8 tensor cores.

`fp8_dot(a, b, promote_k)`: a [m, k] and b [n, k], both float8_e4m3fn -> a @ b^T [m, n] float32.

Why not `lax.dot_general`: Pallas's Triton lowering builds `tt.dot` without `maxNumImpreciseAcc`, and Triton
then refuses Hopper's FP8 wgmma for a float32 result (it would sum products inside the instruction in fewer than
float32's bits) and takes mma.sync on float16 copies instead: both tiles widened in registers, the cost an FP8
weight stream exists to avoid (tools/triton_offline.py: m16n8k16 f16 after 101 conversions, against wgmma
m64n16k32 e4m3 with the tiles read from shared memory once this is set). `promote_k` is that attribute: the
most k Hopper sums in its own precision before they join the float32 result (Triton splits a longer k and
adds the pieces in float32). DeepSeek-V3's FP8 recipe promotes every 128.

The Triton rule is registered into Pallas's table of lowering rules, a private one (the only hook there is);
where a jax release lacks it, `HAS_FP8_WGMMA` is False and `fp8_dot` is `lax.dot_general` (the same products,
mma.sync on widened tiles). Everywhere else (interpreted kernels, CPU) the product is XLA's dot_general in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

_NT = (((1,), (1,)), ((), ()))  # a [m, k] x b [n, k]: contract both last dims


def _reference(a, b, *, promote_k):
    del promote_k
    return lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)


fp8_dot_p = Primitive("ddtree_fp8_dot")
fp8_dot_p.def_impl(_reference)
fp8_dot_p.def_abstract_eval(
    lambda a, b, *, promote_k: jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32))
mlir.register_lowering(fp8_dot_p, mlir.lower_fun(_reference, multiple_results=False))


def _triton_rule(ctx, a, b, *, promote_k):
    del ctx
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax._src.lib.triton import dialect as tt

    b = tt.trans(b, (1, 0))  # [k, n], k-major in memory: what FP8 wgmma reads
    m, n = ir.RankedTensorType(a.type).shape[0], ir.RankedTensorType(b.type).shape[1]
    f32 = ir.F32Type.get()
    acc_type = ir.RankedTensorType.get([m, n], f32)
    acc = arith.constant(acc_type, ir.DenseElementsAttr.get_splat(acc_type, ir.FloatAttr.get(f32, 0.0)))
    return tt.dot(a, b, acc, max_num_imprecise_acc=promote_k)


try:
    from jax._src.pallas.triton import lowering as _triton_lowering

    _triton_lowering.triton_lowering_rules[fp8_dot_p] = _triton_rule
    HAS_FP8_WGMMA = True
except (ImportError, AttributeError):  # pragma: no cover - a jax release without the table
    HAS_FP8_WGMMA = False


def fp8_dot(a: jax.Array, b: jax.Array, promote_k: int) -> jax.Array:
    """a [m, k] float8_e4m3fn, b [n, k] float8_e4m3fn -> a @ b^T [m, n] float32 (inside a Pallas Triton kernel:
    FP8 wgmma on Hopper, summing at most `promote_k` (>= 32) of k in the tensor cores' precision at a time)."""
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn or a.ndim != 2 or b.ndim != 2 \
            or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_dot takes float8_e4m3fn [m, k] and [n, k], got {a.dtype}{list(a.shape)} and "
                         f"{b.dtype}{list(b.shape)}")
    if not HAS_FP8_WGMMA:
        return _reference(a, b, promote_k=promote_k)
    return fp8_dot_p.bind(a, b, promote_k=int(promote_k))
