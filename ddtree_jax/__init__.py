"""ddtree_jax: DDTree speculative decoding on DFlash drafters for Qwen targets, in JAX.

Dimension letters used in shape comments and einsum strings across the package:

    b  batch rows                  t  new tokens in this call (prompt chunk, chain or tree nodes)
    s  KV-cache slots (capacity)    u  new tokens seen as keys (same length as t)
    n  KV heads                     g  query heads per KV head (GQA group); n * g = query heads
    d  head dimension               e  hidden (embedding) size
    f  MLP intermediate size        v  vocabulary
    l  decoder layers

Every array carries a leading batch axis; rows are independent and carry their own lengths.
"""

__version__ = "0.1.0"
