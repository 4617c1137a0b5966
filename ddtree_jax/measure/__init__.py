"""Measurement, kept out of the decoding path (nothing in the engine imports it):

- `costs`: the cost model (floors from bytes and FLOPs);
- `ceilings`: the device's bandwidth and matmul rate, measured in the same run;
- `timing`: medians of synchronised calls and the dispatch-cancelling in-loop timer;
- `workload`: random weights of a named shape (`ddtree_jax.shapes`), filled decode states, and the
  round's own stage functions compiled one by one.

`python -m ddtree_jax.bench` (the CLI and its report) and `tools/` are built on these.
"""
