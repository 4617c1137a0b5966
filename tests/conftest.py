"""Shared fixtures: small random checkpoints in the Hugging Face layout, built on the fly."""

from __future__ import annotations

import atexit
import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Tests compare float32 results to 1e-4; keep XLA on CPU from using lower-precision matmuls.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent XLA compilation cache in the tests (subprocesses included: they inherit the variable): with one
# shared over the run, jaxlib 0.10.2 crashed (segfault) twice inside `executable.serialize()` writing an entry
# (2026-12-01); without it a crash inside a compile still came (pyproject.toml: a crashed test runs again).
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
# `--budget auto` (the generate CLI's default) keeps round costs and per-call records on disk: in a folder of this
# run, not the user's cache, so that no test reads what an earlier run measured (a kept record skips the
# calibration a test may exercise) and none writes outside the run. Subprocesses inherit it.
if "DDTREE_JAX_ROUND_COSTS" not in os.environ:
    os.environ["DDTREE_JAX_ROUND_COSTS"] = tempfile.mkdtemp(prefix="ddtree_jax_costs_")
    atexit.register(shutil.rmtree, os.environ["DDTREE_JAX_ROUND_COSTS"], ignore_errors=True)
# On the CPU, XLA's cheapest code generation: the tests' programs are tiny, so compiling them is what takes the
# time. Each flag is left as the caller's XLA_FLAGS set it, if it does.
#   - LLVM's optimisation level 0 (about a third less compile time than the default level; it changes no result:
#     XLA's CPU backend does not use fast-math, IEEE semantics at every level);
#   - loop fusions emitted by XLA's legacy LLVM IR emitters instead of its MLIR fusion emitters (jaxlib 0.10.2's
#     default), which took twice as long to compile the tests' programs: XLA's compile of the pair16 target and
#     drafter's AR, DFlash and DDTree programs (prefill and decode loop each) 6.6-6.8 s -> 3.1-3.2 s on this
#     project's 2-core CPU, 2026-12-04, their runs a little faster too. Same arithmetic but for the last bits of
#     some transcendental functions' approximations (tanh, which neither the models nor the kernels use, differed;
#     exp, log, rsqrt, sigmoid, softplus, softmax, sin, cos, pow and erf were bit-identical in float32);
#   - each module compiled by LLVM in one piece, not split for parallel threads (which a 2-core machine running two
#     test workers has none to spare for): 2.4-3.1 s -> 2.1-2.3 s more.
# XLA aborts the process at start on a flag it does not define, and a later jaxlib may drop the legacy emitters'
# flag: the last two are passed only where this jaxlib's library names them (`_xla_defines`).
CPU_COMPILE_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
                     "xla_cpu_parallel_codegen_split_count": "1"}


def _xla_defines(flag: str) -> bool:
    """Whether this jaxlib's XLA defines `flag`: its name is in the library that holds XLA (a search of ~0.4 s,
    made once per run: the workers and subprocesses inherit XLA_FLAGS with the flags already in it)."""
    import importlib.util
    import mmap

    library = Path(importlib.util.find_spec("jaxlib").origin).parent / "libjax_common.so"
    if not library.exists():
        return False
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(flag.encode()) >= 0


if os.environ["JAX_PLATFORMS"] == "cpu":
    _given = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([_given] + [
        f"--{name}={value}" for name, value in CPU_COMPILE_FLAGS.items()
        if name not in _given and (name == "xla_backend_optimization_level" or _xla_defines(name))]).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Four host devices for the multi-device tests; everything else runs on the first one.
jax.config.update("jax_num_cpu_devices", 4)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


HAS_TORCH = _has_torch()
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not importable (the transformers parity oracle)")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


# Modules whose single tests (or module fixtures) run longest, longest first (the full two-worker runs of
# 2026-12-04, `--durations`, with the single-process times after that evening's trims). `--dist load` hands tests
# out in collection order, so these go first and the run ends on short tests (a long test handed out last runs
# alone on one worker while the other idles).
# A module stays in one piece (its module-scoped fixtures are built once per worker) and keeps its own order
# (negative controls that drop every compilation run last in their module). Unlisted modules follow in
# collection order.
SLOW_FIRST = (
    "test_notebooks.py", "train/test_train_demo.py", "test_bench.py", "test_kernels_in_engine.py", "test_doctor.py",
    "test_tools.py", "test_generate_prompts.py", "test_hybrid_decoding.py", "train/test_train_mtp.py",
    "train/test_train_drafter.py", "test_generate_cli.py", "test_kernel_check.py", "train/test_train_features.py",
    "test_ddtree_decoding.py", "test_mtp_decoding.py", "test_fp8.py", "test_budget.py", "test_dflash_decoding.py",
    "train/test_train_target.py", "models/test_qwen3.py", "test_multiprocess.py", "test_parallel.py",
    "test_sampling.py", "test_tree.py",
)
TESTS = Path(__file__).resolve().parent


def _slow_rank(item) -> int:
    try:
        module = Path(item.path).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return len(SLOW_FIRST)
    return SLOW_FIRST.index(module) if module in SLOW_FIRST else len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)  # stable: each module's tests keep their order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    has_gpu = None
    for item in items:
        if "gpu" in item.keywords:
            has_gpu = _has_gpu() if has_gpu is None else has_gpu
            if not has_gpu:
                item.add_marker(skip_gpu)


# RoPE scaling on a 64-token original context, so that a 16-dim head keeps some frequencies, divides some by
# the factor and blends some. YaRN in the older `rope_scaling` spelling of Qwen3's model cards (factor 4),
# with max_position_embeddings disagreeing (4096, not 4 x 64), as on the cards.
YARN_ROPE_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}

# Configurations the parity tests run on: GQA untied, tied, MHA, sliding-window layers, YaRN and llama3 RoPE.
# Linear scaling (llama3's long wavelengths) runs the same model code; its frequencies are checked against
# transformers' in tests/test_config.py.
HF_VARIANTS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "gqa8_tied": dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True, head_dim=8),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "sliding": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=3),
    "rope_yarn": dict(rope_scaling=YARN_ROPE_SCALING),
    "rope_llama3": dict(rope_scaling=LLAMA3_ROPE_SCALING),
}


def build_hf_qwen3(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random transformers Qwen3ForCausalLM (float32) with randomised norms, as HF does."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree_jax.random_checkpoint import byte_tokenizer, tiny_qwen3_config

    raw = copy.deepcopy(tiny_qwen3_config(**overrides))  # transformers fills rope dicts in place
    raw.pop("architectures")
    raw.pop("torch_dtype")
    torch.manual_seed(seed)
    config = Qwen3Config(**raw)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    byte_tokenizer(folder, raw["vocab_size"])
    return folder


def randomise_qwen3_5(model, std: float = 0.1) -> None:
    """Random weights for a transformers Qwen3.5 model, norms and the decay parameters included (HF inits
    norms to constants): A_log = log U(0.5, 4), dt_bias ~ N(0, 1), the gated norm 1 + noise, the
    zero-centred norms noise, every other weight N(0, std)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))


@pytest.fixture(scope="session", params=sorted(HF_VARIANTS))
def hf_qwen3(request, tmp_path_factory):
    """(folder, torch model) for each parity variant."""
    if not HAS_TORCH:
        pytest.skip("PyTorch is not importable (the transformers parity oracle)")
    from transformers import Qwen3ForCausalLM

    folder = build_hf_qwen3(tmp_path_factory.mktemp(f"hf_{request.param}"), **HF_VARIANTS[request.param])
    model = Qwen3ForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    return folder, model


@pytest.fixture(scope="session")
def random_target(tmp_path_factory) -> Path:
    """A small random Qwen3 HF checkpoint written with numpy (no torch needed), with a byte tokenizer."""
    from ddtree_jax.random_checkpoint import write_random_qwen3

    return write_random_qwen3(tmp_path_factory.mktemp("random") / "target", seed=1)


@pytest.fixture(scope="session")
def tiny_abstract_pair():
    """The "tiny" shape's target and drafter as abstract float32 parameters (shapes only: for tracing and
    lowering, which need no values)."""
    import jax.numpy as jnp

    from ddtree_jax.config import parse_dflash, parse_qwen3
    from ddtree_jax.models import dflash, qwen3
    from ddtree_jax.shapes import shape_configs

    target_raw, drafter_raw = shape_configs("tiny")
    t_cfg, d_cfg = parse_qwen3(target_raw), parse_dflash(drafter_raw)
    return qwen3.abstract(t_cfg, jnp.float32), dflash.abstract(d_cfg, t_cfg.hidden_size, jnp.float32)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def chain_ordered(tree_rule):
    """A deliberately wrong version of a tree recurrence (`qwen3_5.tree_gated_delta_rule`), for negative
    controls: node i continues from node i - 1 (node-index order, as a plain chain would: its "root path" is
    every node before it) instead of its parent."""
    import jax.numpy as jnp

    def wrong(q, k, v, g, beta, initial_state, visible):
        t = visible.shape[-1]
        return tree_rule(q, k, v, g, beta, initial_state, jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)),
                                                                           visible.shape))
    return wrong
