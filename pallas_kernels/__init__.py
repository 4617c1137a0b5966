"""Pallas GPU kernels (Triton lowering), each beside its plain-jnp reference and a dispatcher.

- `pallas_kernels.tree_attention`: tree-masked attention over the committed KV cache plus the new
  tokens; `tree_attention(..., implementation=)` is the one entry the models call.
- `pallas_kernels.tree_accept`: greedy tree acceptance (argmax over the vocabulary per node, then the
  vectorised walk); `tree_accept(..., implementation=)` is the one entry the engine calls, and
  `tree_walk` the walk it shares with every other decoding rule.
- `pallas_kernels.vocab_top_k`: the top k of every row of the draft log-probs over the vocabulary, lax.top_k's
  order without sorting, in three launches; `tree.build_tree(..., top_k="pallas")` calls `vocab_top_k`.
- `pallas_kernels.tree_build`: the draft-tree build after the vocabulary top-k in one launch, bit-identical
  to `ddtree_jax.tree._build_one`; `tree.build_tree(..., implementation="pallas")` calls `tree_build`.
- `pallas_kernels.tree_delta_rule`: the Gated DeltaNet rule over a tree's nodes (the hybrid's verify), one launch
  per layer for one block of 16 nodes and two past it; the models call it for trees of up to 128 nodes on the
  Pallas path.
- `pallas_kernels.rms_norm`: the residual add and the RMSNorm after it (`add_rms_norm`), per token row.
- `pallas_kernels.qk_norm_rope`: a Qwen3 attention's q|k|v split, q/k RMSNorm and RoPE (`qk_norm_rope`).
- `pallas_kernels.stream_matmul`: a weight-streaming matmul for few rows whose arithmetic for a row does not depend
  on the other rows (dense weights: the models' `--row-invariant`, off by default, XLA's GEMMs being faster;
  block-scaled FP8 weights: the models' `--fp8-matmul stream`, auto's choice on a GPU; FP8 rows times FP8 weights
  on Hopper's FP8 tensor cores, the rows quantised inside the kernel (`quantize_rows`' rule) or given with their
  scales: `--fp8-matmul w8a8`, through `pallas_kernels._fp8_dot`).
- `pallas_kernels.launch`: the launch signal every kernel gives at its entry on Hopper (`kernel_body`), so XLA's
  next kernel is placed while it runs.

A dispatcher runs the kernel on a GPU and the reference elsewhere; `implementation=` or the
environment variable DDTREE_JAX_KERNELS=pallas|reference overrides (`resolve_implementation`). Kernels
import nothing from the application. Submodules are not imported here, so importing the package stays
cheap. GPU checks and timing live outside the package, in `tools/kernel_check.py`.
"""

from pallas_kernels._dispatch import ENV_VAR, core_count, on_gpu, resolve_implementation

__all__ = ["ENV_VAR", "core_count", "on_gpu", "resolve_implementation"]
