"""ddtree_jax: DDTree speculative decoding on DFlash drafters for Qwen targets, in JAX (and MTP drafting with a
Qwen3.5/3.6 target's own head).

Dimension letters used in shape comments and einsum strings across the package:

    b  batch rows                  t  new tokens in this call (prompt chunk, chain or tree nodes)
    s  KV-cache slots (capacity)    u  new tokens seen as keys (same length as t)
    n  KV heads                     g  query heads per KV head (GQA group); n * g = query heads
    d  head dimension               e  hidden (embedding) size
    f  MLP intermediate size        v  vocabulary
    l  decoder layers

Speculative rounds (round.py, tree.py, accept.py, pallas_kernels/tree_accept.py):

    B  tree budget (nodes besides the root)      T  tree nodes verified per round (B + 1; bs for a chain)
    L  draft depths (block size - 1)             P  path slots (the block size: root + L)
    K  tokens kept per depth (min(B, v))         C  candidate children of one depth
    m  MTP steps per round (models/mtp.py): the chain has m + 1 tokens (T = P = m + 1)
    N  candidate budgets of `--budget auto` (budget.py; 0 = the chain)

Gated DeltaNet layers (models/qwen3_5.py, cache.py): H value heads (key heads repeated to them), Dk / Dv key
and value head dims, C conv channels, c chunk length. The Pallas kernels name their own tiling letters at
the top of each file (rows r, chunks c, splits s).

Every array carries a leading batch axis; rows are independent and carry their own lengths.
"""

__version__ = "0.1.0"
