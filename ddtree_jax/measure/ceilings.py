"""The device's ceilings, measured in the run that uses them: memory bandwidth and the bf16 matmul rate."""

from __future__ import annotations

import statistics

from ddtree_jax.measure.timing import in_loop_seconds, median_seconds


def measure_ceilings(repeats: int, small: bool) -> dict:
    """Memory bandwidth and the bf16 matmul rate of the default device.

    Bandwidth is measured several ways, because XLA's kernels reach different fractions of the hardware
    rate: `copy` (`a * 2 + 1` over 2 GiB of bf16, bytes read + written), `read` (a float32 sum of the same
    array, bytes read), `gemv` (a 1 GiB bf16 matrix times a vector, the matrix's bytes: the access pattern
    of a batch-1 decode step), `gemv_loop` (a [1, n] row times a 2 GiB [n, n] matrix, each product the next
    row, timed per iteration inside a device loop: the form and timing of a decode step's lm_head) and,
    where PyTorch sees a CUDA GPU, `torch_copy` (a 4 GiB device-to-device copy timed with CUDA events,
    bytes read + written: the method the device notes use). On the H200 the first three came out at
    2.3-3.4 TB/s while torch's copy reached 4.26 and XLA's lm_head GEMV inside a decode step 4.34 TB/s
    (docs/performance.md). `bandwidth_bytes_per_s` is the highest of them: the floors use it, so that no row
    can look closer to its floor because one measurement came out low.
    """
    import jax
    import jax.numpy as jnp

    n = 2**22 if small else 2**30  # elements of bf16: 8 MiB or 2 GiB
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2 + 1)
    copy_bw = 2 * x.nbytes / median_seconds(lambda: copy(x), repeats)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    read_bw = x.nbytes / median_seconds(lambda: total(x), repeats)
    shape = (512, 2048) if small else (2**14, 2**15)  # 2 MiB or 1 GiB of bf16
    w = x[: shape[0] * shape[1]].reshape(shape)
    v = jax.random.normal(jax.random.key(3), (w.shape[1],), jnp.bfloat16)
    gemv = jax.jit(lambda m, u: jnp.einsum("oi,i->o", m, u))
    gemv_bw = w.nbytes / median_seconds(lambda: gemv(w, v), repeats)
    loop_s = gemv_loop_seconds(x, repeats)  # 0 where noise swamps a tiny matrix (small, on a CPU)
    m = 512 if small else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    matmul = 2 * m**3 / median_seconds(lambda: mm(a, b), repeats)
    out = {"copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "gemv_bytes_per_s": gemv_bw,
           "bf16_flops_per_s": matmul}
    if loop_s > 0:
        out["gemv_loop_bytes_per_s"] = x.nbytes / loop_s
    torch_bw = None if small else torch_copy_bandwidth()
    if torch_bw:
        out["torch_copy_bytes_per_s"] = torch_bw
    out["bandwidth_bytes_per_s"] = max(v for k, v in out.items() if k.endswith("bytes_per_s"))
    return out


def gemv_loop_seconds(x, repeats: int) -> float:
    """Seconds one [1, n] x [n, n] product adds inside a device loop: the array `x` (n^2 elements: 2^22 or
    2^30) reshaped square; 0 where the loop's noise exceeds its work (a small matrix on a CPU). Each
    product, scaled by 1/sqrt(n) to keep its magnitude, is the next row: XLA can neither hoist a product
    out of the loop nor run two at once."""
    import jax
    import jax.numpy as jnp

    n = int(round(x.size ** 0.5))
    w = x.reshape(n, n)
    scale = 1.0 / n ** 0.5

    @jax.jit
    def chain(m, row, iterations):
        body = lambda _, r: (jnp.dot(r, m, preferred_element_type=jnp.float32) * scale).astype(m.dtype)  # noqa: E731
        return jax.lax.fori_loop(0, iterations, body, row)

    row = jax.random.normal(jax.random.key(4), (1, n), w.dtype)
    return in_loop_seconds(lambda iterations: chain(w, row, jnp.int32(iterations)), repeats)[0]


def torch_copy_bandwidth(n_bytes: int = 4 << 30, repeats: int = 10) -> float | None:
    """Bytes read + written per second of a PyTorch device-to-device copy timed with CUDA events, or None
    where PyTorch is missing or sees no CUDA GPU (it then costs nothing but the import attempt)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        src = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * n_bytes / statistics.median(times)
    except RuntimeError:  # e.g. no device memory left beside JAX's
        return None


def ceilings_text(c: dict) -> str:
    """One sentence with the measured ceilings (`measure_ceilings`)."""
    tb = lambda k: f"{c[k] / 1e12:.2f}" if k in c else "-"  # noqa: E731
    return (f"Measured ceilings: bandwidth {tb('bandwidth_bytes_per_s')} TB/s (the highest of copy "
            f"{tb('copy_bytes_per_s')}, read {tb('read_bytes_per_s')}, gemv {tb('gemv_bytes_per_s')}, gemv in a loop "
            f"{tb('gemv_loop_bytes_per_s')}, torch copy "
            f"{tb('torch_copy_bytes_per_s')}), bf16 matmul {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s.")
