"""The whole demo pipeline in one command: tokenizer -> target pretraining -> drafter training -> prompts.

    python -m ddtree_jax.train.demo --out DIR [--scale small|quick|tiny] [--no-check]

`small` is sized for one H200: at most 3000 target steps (about 45 s; the parameters of the best
held-out evaluation are exported, since the small corpus overfits within a few epochs) and 3 minutes
of drafter training (a time budget: the step count is fixed after timing the first steps), plus
tokenization, data generation and compilation. `quick` is the same models on a shorter schedule.
`tiny` is a CPU smoke run of under a minute whose models learn little. Everything lands in DIR:

    tokenizer/            byte-level BPE (AutoTokenizer loads it)
    target/               the Qwen3 target, HF layout (bf16 safetensors, tokenizer, generation_config)
    drafter/              the DFlash drafter, HF layout (bf16)
    prompts.jsonl         held-out prompts: signatures + docstrings of held-out stdlib files
    target_loss.png, drafter_loss.png
    summary.json          losses, sizes, timings, and a decode check on 8 held-out prompts: tau of
                          greedy DFlash and DDTree, DFlash acceptance per draft position, output == AR
    work/target, work/drafter   checkpoints, logs (a rerun resumes from them)

Then try: python -m ddtree_jax.generate --target DIR/target --drafter DIR/drafter --prompt "def f(x):"
          python -m ddtree_jax.doctor --target DIR/target --drafter DIR/drafter --prompts DIR/prompts.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from ddtree_jax.train import corpus
from ddtree_jax.train.drafter import DrafterTrainConfig, train_drafter
from ddtree_jax.train.target import TargetShape, TargetTrainConfig, train_target
from ddtree_jax.train.tokenizer import train_tokenizer


@dataclasses.dataclass(frozen=True)
class Scale:
    vocab_size: int
    tokenizer_files: int | None  # None: every training file
    include_tests: bool
    max_files: int | None
    target_shape: TargetShape
    target: dict  # TargetTrainConfig fields
    drafter: dict  # DrafterTrainConfig fields
    prompts: int  # held-out prompts written
    ddtree_budget: int


SCALES = {
    # One H200. Target 6.8M parameters (13.6 MB bf16), drafter 1.8M (3.5 MB bf16). The stdlib gives
    # ~2.8M training tokens: the target overfits after ~6 epochs (a 4-minute run went from held-out
    # loss 2.75 at step 1000 to 5.69 at step 16178), so it trains for a fixed, short schedule and the
    # best held-out evaluation is exported.
    "small": Scale(
        vocab_size=8192, tokenizer_files=None, include_tests=True, max_files=None,
        target_shape=TargetShape(),
        target=dict(minutes=None, steps=3000, batch=32, seq_len=512, lr=2e-3, warmup=200, eval_every=250,
                    patience=3, save_every=1000, log_every=100, eval_batches=8),
        drafter=dict(minutes=3.0, steps=None, layers=2, block_size=16, sequences=16384, prompt_len=64, gen_len=192,
                     gen_batch=1024, batch=32, anchors=16, lr=1.5e-3, warmup=200, eval_every=500, patience=4,
                     save_every=1000, log_every=100, check_prompts=0),
        prompts=256, ddtree_budget=64),
    # The small models on a shorter schedule (about 2 minutes on one H200).
    "quick": Scale(
        vocab_size=8192, tokenizer_files=None, include_tests=True, max_files=None,
        target_shape=TargetShape(),
        target=dict(minutes=None, steps=1500, batch=32, seq_len=512, lr=2e-3, warmup=150, eval_every=250,
                    patience=2, save_every=1500, log_every=100, eval_batches=4, sample_prompt=None),
        drafter=dict(minutes=0.6, steps=None, layers=2, block_size=16, sequences=16384, prompt_len=64, gen_len=192,
                     gen_batch=1024, batch=32, anchors=16, lr=1.5e-3, warmup=200, eval_every=1000, patience=3,
                     save_every=100000, log_every=200, check_prompts=0),
        prompts=256, ddtree_budget=64),
    # CPU smoke run (under a minute).
    "tiny": Scale(
        vocab_size=512, tokenizer_files=30, include_tests=False, max_files=30,
        target_shape=TargetShape(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                                 intermediate_size=128),
        target=dict(steps=60, batch=8, seq_len=64, lr=3e-3, warmup=10, eval_every=60, save_every=60, log_every=20,
                    eval_batches=2, dtype="float32", sample_prompt=None),
        drafter=dict(steps=40, layers=1, block_size=8, sequences=64, prompt_len=16, gen_len=32, gen_batch=64, batch=8,
                     anchors=8, lr=3e-3, warmup=10, eval_every=40, save_every=40, log_every=20, check_prompts=0,
                     eval_decode=0, dtype="float32"),
        prompts=16, ddtree_budget=16),
}


def ddtree_check(target_dir: Path, drafter_dir: Path, prompts_file: Path, *, num: int, budget: int,
                 max_new_tokens: int, dtype: str) -> dict:
    """tau of greedy DFlash and DDTree on the first `num` held-out prompts, DFlash's acceptance rate per
    draft position (as the doctor prints it), and whether both outputs equal AR."""
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.doctor import position_acceptance
    from ddtree_jax.engine import DecodeOptions, Mode, generate
    from ddtree_jax.train.common import compute_dtype
    from ddtree_jax.train.tokenizer import load_tokenizer

    dt = compute_dtype(dtype)
    target = load_target(target_dir, dt)
    drafter = load_drafter(drafter_dir, target.config, dt)
    tok = load_tokenizer(target_dir)
    texts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()[:num]]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    base = DecodeOptions(max_new_tokens=max_new_tokens)
    ar = generate(target, prompts, base)
    out = {"prompts": len(prompts), "max_new_tokens": max_new_tokens}
    for mode in (Mode.DFLASH, Mode.DDTREE):
        res = generate(target, prompts, dataclasses.replace(base, mode=mode, budget=budget), drafter=drafter)
        out[mode.value] = {"tau": round(res.tau, 3), "equals_ar": res.output_ids == ar.output_ids}
        if mode is Mode.DFLASH:
            dflash_lengths = res.acceptance_lengths
    out["ddtree"]["budget"] = budget
    out["dflash"]["position_acceptance"] = [round(r, 4) for r in position_acceptance(
        dflash_lengths, drafter.config.block_size)]
    out["sample"] = {"prompt": texts[0], "continuation": tok.decode(ar.output_ids[0])}
    return out


def run_demo(out: Path, scale_name: str = "small", dtype: str = "auto", check: bool = True) -> dict:
    scale = SCALES[scale_name]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings = {}

    def say(msg: str) -> None:
        print(f"[demo {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    # 1. Tokenizer (kept if already there: a rerun resumes).
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        say(f"training the tokenizer (vocab {scale.vocab_size})")
        train_files, _ = corpus.split_files(corpus.list_files(include_tests=scale.include_tests))
        train_tokenizer(corpus.iter_texts(train_files[:scale.tokenizer_files]), tok_dir, vocab_size=scale.vocab_size)
    timings["tokenizer"] = round(time.perf_counter() - t0, 1)

    # 2. Target.
    say("pretraining the target")
    t = time.perf_counter()
    target_cfg = TargetTrainConfig(out=out / "target", tokenizer=tok_dir, work=out / "work" / "target",
                                   shape=scale.target_shape, include_tests=scale.include_tests,
                                   max_files=scale.max_files, **{"dtype": dtype, **scale.target})
    target_summary = train_target(target_cfg)
    timings["target"] = round(time.perf_counter() - t, 1)

    # 3. Drafter.
    say("training the drafter")
    t = time.perf_counter()
    drafter_cfg = DrafterTrainConfig(target=out / "target", out=out / "drafter", work=out / "work" / "drafter",
                                     include_tests=scale.include_tests, max_files=scale.max_files,
                                     **{"dtype": dtype, **scale.drafter})
    drafter_summary = train_drafter(drafter_cfg)
    timings["drafter"] = round(time.perf_counter() - t, 1)

    # 4. Held-out prompts, loss curves, a DDTree check, the summary.
    prompts = corpus.held_out_prompts(include_tests=scale.include_tests, max_prompts=scale.prompts)
    corpus.write_prompts_jsonl(prompts, out / "prompts.jsonl")
    for name in ("target", "drafter"):
        shutil.copy2(out / "work" / name / "loss.png", out / f"{name}_loss.png")
    sizes = {name: sum(f.stat().st_size for f in (out / name).glob("*.safetensors")) for name in ("target", "drafter")}
    summary = {"scale": scale_name, "timings": timings, "safetensors_bytes": {**sizes, "total": sum(sizes.values())},
               "prompts": len(prompts), "target": target_summary, "drafter": drafter_summary}
    if not check:
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        say(f"done (no decode check): target {sizes['target'] / 1e6:.1f} MB + drafter {sizes['drafter'] / 1e6:.1f} MB")
        return summary
    say(f"wrote {len(prompts)} held-out prompts; checking DFlash and DDTree on them")
    check = ddtree_check(out / "target", out / "drafter", out / "prompts.jsonl", num=8, budget=scale.ddtree_budget,
                         max_new_tokens=64 if scale_name == "small" else 32,
                         dtype=scale.target.get("dtype", dtype))
    summary.update(seconds=round(time.perf_counter() - t0, 1), decode_check=check)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    say(f"done: target {sizes['target'] / 1e6:.1f} MB + drafter {sizes['drafter'] / 1e6:.1f} MB; "
        f"DFlash tau {check['dflash']['tau']:.2f} (acceptance per draft position "
        f"{check['dflash']['position_acceptance']}), DDTree tau {check['ddtree']['tau']:.2f} "
        f"(budget {scale.ddtree_budget}); greedy output equals AR: "
        f"{check['dflash']['equals_ar'] and check['ddtree']['equals_ar']}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.train.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (a rerun resumes what is there)")
    p.add_argument("--scale", choices=sorted(SCALES), default="small",
                   help="small: about 5 minutes in all on one H200; quick: about 2; tiny: a CPU smoke run")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="compute dtype (auto: bfloat16 on a GPU)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the closing decode check (DFlash and DDTree against AR on 8 held-out prompts)")
    a = p.parse_args(argv)
    summary = run_demo(a.out, a.scale, a.dtype, a.check)
    print(json.dumps({"out": str(a.out), "seconds": summary["seconds"],
                      "safetensors_bytes": summary["safetensors_bytes"],
                      "decode_check": {k: summary["decode_check"][k] for k in ("dflash", "ddtree")}
                      if "decode_check" in summary else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
