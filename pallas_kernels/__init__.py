"""Pallas GPU kernels (Triton lowering), each beside its plain-jnp reference and a dispatcher.

- `pallas_kernels.tree_attention`: tree-masked attention over the committed KV cache plus the new
  tokens (the contract of `ddtree_jax.models.layers.cached_attention`); `tree_attention(...)` dispatches.
- `pallas_kernels.tree_accept`: greedy tree acceptance (argmax over the vocabulary per node, then the
  vectorised walk; the contract of `ddtree_jax.accept.accept_tree`); `tree_accept(...)` dispatches.
- `python -m pallas_kernels.gpu_check --out DIR`: correctness and timing on a GPU at Qwen3-8B shapes.

A dispatcher runs the kernel on a GPU and the reference elsewhere; `implementation=` or the
environment variable DDTREE_JAX_KERNELS=pallas|reference overrides (see `_dispatch`). Kernels never
import the models. Submodules are not imported here, so importing the package stays cheap.
"""
