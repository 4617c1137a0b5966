"""Pallas GPU kernels, each beside its pure-JAX reference and a dispatcher.

Empty until the kernels issue lands: the models use the pure-JAX attention in
`ddtree_jax.models.layers.cached_attention`, which defines the contract the kernels will meet.
"""
