"""Run a module with Pallas kernels' default knobs changed, to A/B a knob in whole rounds on a GPU without
committing it.

    python tools/with_knobs.py top_k:threshold_once=1 tree_build:block_rows=64 -m ddtree_jax.bench --budgets 15,31,63 ...
    python tools/with_knobs.py tree_rule:unrolled_chain=1,value_block=32 -m tools.loop_cost ...
    python tools/with_knobs.py engine:tree_kernels_up_to=128 -m ddtree_jax.bench --budgets 255,511 ...

Each KERNEL:KNOBS names a kernel and its config's fields (integers; 0 / 1 for the booleans), laid over that
kernel's `default_config`, which is what the engine uses when it passes no config:
- `top_k`: `pallas_kernels.vocab_top_k.VocabTopKConfig` over `default_config(n, k)`, every row length and k;
- `tree_build`: `pallas_kernels.tree_build.TreeBuildConfig` over `default_config(budget)`, every budget;
- `tree_rule`: `pallas_kernels.tree_delta_rule.TreeDeltaRuleConfig` over `default_config(t)` past one block of
  nodes (17 and more; one block keeps its own form);
- `dense_stream`, `fp8_stream`: `pallas_kernels.stream_matmul.StreamMatmulConfig` over
  `ddtree_jax.models.layers.DENSE_STREAM_KNOBS` / `FP8_STREAM_KNOBS`, the knobs of the dense and FP8 projections
  that stream (`dense_stream:balance=1`: k split so the programs spread evenly over the multiprocessors);
- `attention`: `pallas_kernels.tree_attention.TreeAttentionConfig` over `ddtree_jax.models.layers.ATTENTION_CONFIG`,
  the fast attention kernel's config in every model (`attention:num_stages=2,block_k=32`);
- `engine`: the engine's own choices, `tree_kernels_up_to=N` (`ddtree_jax.round.TREE_BUILD_KERNEL_UP_TO`: the
  budgets whose tree build runs in the Pallas kernel, 512 by default: e.g. 128 to time B = 256 and 512 with XLA's
  builder), `top_k_kernel_up_to=N`
  (`...round.VOCAB_TOP_K_KERNEL_UP_TO`: the budgets whose vocabulary top-k runs in the Pallas kernel),
  `dense_stream_max_rows=N` (`ddtree_jax.models.layers.DENSE_STREAM_MAX_ROWS`: bf16 projections of calls of at most N
  rows through the streaming kernel; 0: none),
  and the switches (0 / 1) `fused_kv_write` (`ddtree_jax.models.layers.FUSED_KV_WRITE`: the q/k-norm-RoPE kernel
  writes the K/V; on by default), `commit_rows_kernel` (`ddtree_jax.round.COMMIT_ROWS_KERNEL`: a round's kept K/V
  written by one kernel for every layer; on), `glu_in_epilogue` (`...layers.GLU_IN_EPILOGUE`: SwiGLU in a streamed
  gate|up projection's epilogue; off), `dense_stream_wide_max_rows=N` (`...layers.DENSE_STREAM_WIDE_MAX_ROWS`:
  bf16 projections of calls of more rows than `dense_stream_max_rows`, up to N, streamed with the knobs of
  `dense_stream_wide:...`, `...layers.DENSE_STREAM_WIDE_KNOBS`; 0, off), `dense_stream_wide_max_bytes=N`
  (`...layers.DENSE_STREAM_WIDE_MAX_BYTES`: of those, only weights of at most N bytes; any by default),
  `w8a8_rows_from_norm` (`...layers.W8A8_ROWS_FROM_NORM`: W8A8's rows for q|k|v and gate|up quantised by the norm
  kernel before them; on),
  `w8a8_quantize_first_above=N` (`...layers.W8A8_QUANTIZE_FIRST_ABOVE`: W8A8's rows of streamed calls of more than N
  rows quantised first, not inside the streaming kernel; 16 by default, 0: inside at any row count),
  `early_launch` (`pallas_kernels.launch.EARLY_LAUNCH`: each Pallas kernel lets the next kernel be launched at
  its entry, Hopper's programmatic dependent launch; on), `split_sums_kernel`
  (`pallas_kernels.stream_matmul.SPLIT_SUMS_KERNEL`: a streamed projection's split sums added by a Pallas kernel,
  which signals its dependents, not by XLA's fusion; off).
A module path after -m may be a file's (tools/loop_cost.py): it is run as a script then.
"""

from __future__ import annotations

import dataclasses
import importlib
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import stream_matmul, tree_attention, tree_build, tree_delta_rule, vocab_top_k  # noqa: E402

# kernel -> (module holding default_config, its config class, the config's samples to validate knobs against)
KERNELS = {
    "top_k": (vocab_top_k, vocab_top_k.VocabTopKConfig, lambda: [vocab_top_k.default_config(n)
                                                                  for n in (8192, 151936)]),
    "tree_build": (tree_build, tree_build.TreeBuildConfig, lambda: [tree_build.default_config(64)]),
    "tree_rule": (tree_delta_rule, tree_delta_rule.TreeDeltaRuleConfig,
                  lambda: [tree_delta_rule.default_config(t)
                           for t in range(tree_delta_rule.BLOCK + 1, tree_delta_rule.MAX_NODES + 1)]),
    "dense_stream": (None, stream_matmul.StreamMatmulConfig, None),  # module attributes (STREAM_KNOBS), not
    "fp8_stream": (None, stream_matmul.StreamMatmulConfig, None),    # a default_config
    "dense_stream_wide": (None, stream_matmul.StreamMatmulConfig, None),
    "attention": (None, tree_attention.TreeAttentionConfig, None),  # layers.ATTENTION_CONFIG, not a default_config
}
# The streaming kernel's knobs the models read, by kernel name: attributes of ddtree_jax.models.layers.
STREAM_KNOBS = {"dense_stream": "DENSE_STREAM_KNOBS", "fp8_stream": "FP8_STREAM_KNOBS",
                "dense_stream_wide": "DENSE_STREAM_WIDE_KNOBS"}


# The `engine` knobs: name -> (module, attribute, kind): limits (ints, kind = the least value) and switches (bool).
ENGINE = {"tree_kernels_up_to": ("ddtree_jax.round", "TREE_BUILD_KERNEL_UP_TO", 1),
          "top_k_kernel_up_to": ("ddtree_jax.round", "VOCAB_TOP_K_KERNEL_UP_TO", 1),
          "dense_stream_max_rows": ("ddtree_jax.models.layers", "DENSE_STREAM_MAX_ROWS", 0),
          "dense_stream_wide_max_rows": ("ddtree_jax.models.layers", "DENSE_STREAM_WIDE_MAX_ROWS", 0),
          "dense_stream_wide_max_bytes": ("ddtree_jax.models.layers", "DENSE_STREAM_WIDE_MAX_BYTES", 0),
          "fused_kv_write": ("ddtree_jax.models.layers", "FUSED_KV_WRITE", bool),
          "commit_rows_kernel": ("ddtree_jax.round", "COMMIT_ROWS_KERNEL", bool),
          "glu_in_epilogue": ("ddtree_jax.models.layers", "GLU_IN_EPILOGUE", bool),
          "w8a8_rows_from_norm": ("ddtree_jax.models.layers", "W8A8_ROWS_FROM_NORM", bool),
          "w8a8_quantize_first_above": ("ddtree_jax.models.layers", "W8A8_QUANTIZE_FIRST_ABOVE", 0),
          "early_launch": ("pallas_kernels.launch", "EARLY_LAUNCH", bool),
          "split_sums_kernel": ("pallas_kernels.stream_matmul", "SPLIT_SUMS_KERNEL", bool)}


def parse_knobs(text: str, config_class) -> dict:
    """'unrolled_chain=1,value_block=32' -> {'unrolled_chain': True, 'value_block': 32} for `config_class`;
    ValueError names a field it lacks or a value that is not an integer."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    knobs = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in fields:
            raise ValueError(f"{name!r} is not a {config_class.__name__} field ({', '.join(fields)})")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected an integer (0 / 1 for a boolean)") from None
        knobs[name] = bool(number) if fields[name].type in ("bool", bool) else number
    return knobs


def override(kernel: str, knobs: dict) -> None:
    """Lay `knobs` over `kernel`'s default_config in this process (`engine`: set its attributes); ValueError (or
    TypeError) now, from the config's own checks, where they do not fit one of its default forms."""
    if kernel == "engine":
        for name, value in knobs.items():
            module, attribute, _ = ENGINE[name]
            setattr(importlib.import_module(module), attribute, value)
        return
    if kernel in STREAM_KNOBS:
        from ddtree_jax.models import layers

        name = STREAM_KNOBS[kernel]
        setattr(layers, name, dataclasses.replace(getattr(layers, name), **knobs))
        return
    if kernel == "attention":
        from ddtree_jax.models import layers

        layers.ATTENTION_CONFIG = dataclasses.replace(layers.ATTENTION_CONFIG or tree_attention.TreeAttentionConfig(),
                                                      **knobs)
        return
    module, _, samples = KERNELS[kernel]
    for config in samples():  # fail now, not at the first trace
        dataclasses.replace(config, **knobs)
    base = module.default_config

    def default_config(size: int, *args, **kwargs):
        config = base(size, *args, **kwargs)
        if kernel == "tree_rule" and size <= tree_delta_rule.BLOCK:
            return config
        return dataclasses.replace(config, **knobs)

    module.default_config = default_config


def parse_item(item: str) -> tuple[str, dict]:
    """'top_k:threshold_once=1' -> ('top_k', {'threshold_once': 1}); ValueError names an unknown kernel or bad knob."""
    kernel, sep, text = item.partition(":")
    if not sep or kernel not in (*KERNELS, "engine"):
        raise ValueError(f"expected KERNEL:KNOBS with KERNEL one of {', '.join(KERNELS)}, engine")
    if kernel == "engine":
        knobs = parse_knobs(text, dataclasses.make_dataclass("EngineKnobs", [(name, int) for name in ENGINE]))
        for name, value in knobs.items():
            kind = ENGINE[name][2]
            if kind is bool:
                if value not in (0, 1):
                    raise ValueError(f"{name}={value}: a switch, 0 or 1")
                knobs[name] = bool(value)
            elif value < kind:
                raise ValueError(f"{name}={value}: a limit, at least {kind}")
        return kernel, knobs
    return kernel, parse_knobs(text, KERNELS[kernel][1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-m" not in argv or argv.index("-m") == 0 or argv.index("-m") == len(argv) - 1:
        print("error: usage: with_knobs.py KERNEL:KNOBS... -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    at = argv.index("-m")
    for item in argv[:at]:
        try:
            override(*parse_item(item))
        except (ValueError, TypeError) as e:
            print(f"error: {item!r}: {e}", file=sys.stderr)
            return 2
    target, args = argv[at + 1], argv[at + 2:]
    sys.argv = [target, *args]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
