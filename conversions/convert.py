"""Convert target and DFlash drafter checkpoints between the Hugging Face safetensors layout and orbax,
or quantise one into block-scaled FP8.

    python -m conversions.convert hf-to-orbax SRC DST [--force] [--verify [--target DIR]]
    python -m conversions.convert orbax-to-hf SRC DST [--force] [--verify [--target DIR]] [--max-shard-mb N]
    python -m conversions.convert quantize-fp8 SRC DST [--block 128,128] [--scale-dtype float32|bfloat16]

Targets and DFlash drafters both convert. Tensors keep their stored dtype (FP8 weights and their scales
included), so a round trip is bit-exact. `quantize-fp8` reads a 16- or 32-bit checkpoint (either format)
and writes the published FP8 layout as an HF folder: every projection but lm_head (and a hybrid's
in_proj_a/in_proj_b) as float8_e4m3fn with per-block `weight_scale_inv`, and the `quantization_config`
that says so (`config.fp8_quantization_config`).

The output is written to a temporary folder next to DST and renamed at the end; an existing DST is
refused unless --force. `--verify` runs both checkpoints (float32) on the same input and reports the
largest logit difference (a drafter runs on random context features with `--target DIR`'s embedding
and lm_head); a difference above `--tolerance` exits 1 (quantising changes the logits: give a
tolerance). Bad input (a wrong source, a destination that exists or cannot be written) exits 2 with one
`error:` line before anything is read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddtree_jax.cli import EXIT_BAD_INPUT

EXIT_MISMATCH = 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conversions.convert", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("direction", choices=["hf-to-orbax", "orbax-to-hf", "quantize-fp8"], help="which way to convert")
    p.add_argument("src", type=Path, help="the checkpoint folder to read (a target or a DFlash drafter)")
    p.add_argument("dst", type=Path, help="the folder to write (written to a temporary folder, then renamed)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--verify", action="store_true",
                   help="run SRC and DST on the same input (float32) and compare their logits")
    p.add_argument("--tolerance", type=float, default=0.0, help="largest logit difference --verify accepts")
    p.add_argument("--target", type=Path, default=None,
                   help="--verify of a drafter: the target whose embedding and lm_head it runs with")
    p.add_argument("--max-shard-mb", type=int, default=5120,
                   help="orbax-to-hf, quantize-fp8: largest safetensors shard, MiB")
    p.add_argument("--block", default="128,128", help="quantize-fp8: ROWS,COLS of a weight block sharing one scale")
    p.add_argument("--scale-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="quantize-fp8: the dtype of the stored scales")
    return p.parse_args(argv)


def parse_block(text: str) -> tuple[int, int]:
    """'128,128' -> (128, 128); anything but two positive integers is a CheckpointError."""
    from ddtree_jax.checkpoint import CheckpointError

    try:
        block = tuple(int(v) for v in text.split(","))
    except ValueError:
        block = ()
    if len(block) != 2 or min(block) < 1:
        raise CheckpointError(f"--block takes two positive integers ROWS,COLS, got {text!r}")
    return block


def check_destination(src: Path, dst: Path, force: bool) -> None:
    """Refuse, before anything is read, a DST that exists (without `force`), is SRC, or cannot be written."""
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.cli import BadInput, check_writable

    if dst.exists() and not force:
        raise CheckpointError(f"{dst}: already exists (pass --force to overwrite)")
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: is the source folder; choose another destination")
    try:
        check_writable(dst, "DST", folder=True)
    except BadInput as e:
        raise CheckpointError(str(e)) from None


def convert(direction: str, src: Path, dst: Path, *, force: bool = False, max_shard_mb: int = 5120) -> Path:
    from ddtree_jax.checkpoint import CheckpointError, checkpoint_format, read_arrays, save_hf, save_orbax

    names = {"hf": "a Hugging Face (safetensors)", "orbax": "an orbax"}
    want = {"hf-to-orbax": "hf", "orbax-to-hf": "orbax"}[direction]
    found = checkpoint_format(src)
    if found != want:
        raise CheckpointError(f"{src}: is {names[found]} checkpoint, but {direction} reads {names[want]} one")
    check_destination(src, dst, force)
    arrays, config_raw = read_arrays(src, progress=True)
    if direction == "orbax-to-hf" and config_raw.get("model_type") == "qwen3_5":
        # The orbax folder keeps our 'model.' names; the wrapper layout stores them under 'model.language_model.'.
        raise CheckpointError(f"{src}: orbax-to-hf of a 'qwen3_5' (vision-language wrapper) checkpoint is not "
                              "supported yet; convert from a 'qwen3_5_text' folder")
    if direction == "hf-to-orbax":
        return save_orbax(arrays, config_raw, dst, side_files_from=src, force=force)
    return save_hf(arrays, config_raw, dst, side_files_from=src, force=force, max_shard_bytes=max_shard_mb * 2**20)


def quantize_fp8(src: Path, dst: Path, *, block: tuple[int, int], scale_dtype: str = "float32", force: bool = False,
                 max_shard_mb: int = 5120) -> Path:
    """Write SRC (a target or drafter, HF or orbax, 16- or 32-bit) as a block-scaled FP8 HF checkpoint at DST:
    the projections that the written `quantization_config` converts become float8_e4m3fn weights with
    `weight_scale_inv` (`models.fp8.quantize`); every other tensor is copied as stored."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.checkpoint import CheckpointError, checkpoint_format, model_abstract, read_arrays, save_hf
    from ddtree_jax.config import fp8_quantization_config, read_config_json
    from ddtree_jax.models.fp8 import quantize

    checkpoint_format(src)
    raw = read_config_json(src)
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise CheckpointError(f"{src / 'config.json'}: already has a quantization_config (quant_method {method!r}); "
                              "quantize-fp8 reads a 16- or 32-bit checkpoint")
    if raw.get("model_type") == "qwen3_5":
        raise CheckpointError(f"{src}: quantize-fp8 of a 'qwen3_5' (vision-language wrapper) checkpoint is not "
                              "supported yet; convert from a 'qwen3_5_text' folder")
    check_destination(src, dst, force)
    quantized_raw = {**raw, "quantization_config": fp8_quantization_config(raw, block)}
    abstract, _ = model_abstract(src, quantized_raw)  # which projections the new config makes FP8
    arrays, _ = read_arrays(src, progress=True)
    quantize_one = jax.jit(quantize, static_argnums=(1, 2))
    for name in abstract.flat():
        if name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            q, scale = quantize_one(jnp.asarray(arrays[weight]), block, jnp.dtype(scale_dtype))
            arrays[weight], arrays[name] = np.asarray(q), np.asarray(scale)
    return save_hf(arrays, quantized_raw, dst, side_files_from=src, force=force,
                   max_shard_bytes=max_shard_mb * 2**20)


def max_logit_difference(a: Path, b: Path, seq_len: int = 16, seed: int = 0, target: Path | None = None) -> float:
    """Largest |logit| difference between two checkpoints on the same random input (float32).

    Targets run on random tokens; drafters (which need `target`) on random context features and a block.
    """
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.checkpoint import CheckpointError, is_drafter, load_drafter, load_target
    from ddtree_jax.config import read_config_json
    from ddtree_jax.models import dflash, target_family
    from ddtree_jax.models.contract import ForwardMeta

    logits = []
    if is_drafter(read_config_json(a)):
        if target is None:
            raise CheckpointError(f"{a}: is a DFlash drafter; --verify needs --target DIR to run it")
        target_params = load_target(target, jnp.float32)
        for folder in (a, b):
            drafter = load_drafter(folder, target_params.config, jnp.float32)
            features = len(drafter.config.target_layer_ids) * target_params.config.hidden_size
            taps = jnp.asarray(np.random.default_rng(seed).standard_normal((1, seq_len, features)), jnp.float32)
            cache = dflash.ingest_context(drafter, taps, jnp.array([seq_len]),
                                          dflash.create_cache(drafter.config, 1, seq_len, jnp.float32))
            block = jnp.full((1, drafter.config.block_size), drafter.config.mask_token_id, jnp.int32)
            logits.append(np.asarray(dflash.draft_logits(drafter, target_params, block, cache)))
        return float(np.abs(logits[0] - logits[1]).max())
    for folder in (a, b):
        params = load_target(folder, jnp.float32)
        tokens = np.random.default_rng(seed).integers(0, params.config.vocab_size, (1, seq_len))
        family = target_family(params.config)
        cache = family.create_cache(params.config, 1, seq_len, jnp.float32)
        out = family.forward(params, jnp.asarray(tokens), ForwardMeta.prompt(jnp.array([seq_len]), seq_len), cache)
        logits.append(np.asarray(family.logits(params, out.hidden)))
    return float(np.abs(logits[0] - logits[1]).max())


def main(argv=None) -> int:
    args = parse_args(argv)
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    try:
        if args.verify and args.target is None:
            from ddtree_jax.checkpoint import is_drafter
            from ddtree_jax.config import read_config_json

            if is_drafter(read_config_json(args.src)):
                raise CheckpointError(f"{args.src}: is a DFlash drafter; --verify needs --target DIR to run it")
        if args.direction == "quantize-fp8":
            out = quantize_fp8(args.src, args.dst, block=parse_block(args.block), scale_dtype=args.scale_dtype,
                               force=args.force, max_shard_mb=args.max_shard_mb)
        else:
            out = convert(args.direction, args.src, args.dst, force=args.force, max_shard_mb=args.max_shard_mb)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {out}")
    if args.verify:
        try:
            diff = max_logit_difference(args.src, out, target=args.target)
        except (CheckpointError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        ok = diff <= args.tolerance
        print(f"verify: max |logit difference| = {diff:.3g} ({'ok' if ok else f'above tolerance {args.tolerance}'})")
        if not ok:
            return EXIT_MISMATCH
    return 0


if __name__ == "__main__":
    sys.exit(main())
