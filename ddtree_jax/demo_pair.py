"""The demo pair that ships with the package, used by every command when `--target`/`--drafter` are not given.

`assets/demo/` holds a 6.8M-parameter Qwen3 target (HF layout, bf16, with its byte-level BPE tokenizer)
pretrained on the Python standard library's source, its DFlash drafter (2 layers, block 16), and
held-out prompts (signatures and docstrings of held-out stdlib files, JSONL). Both were trained on one
H200 by `python -m ddtree_jax.train.demo` (README, "The demo pair"). The target folder also holds an MTP head
trained for it by `python -m ddtree_jax.train.mtp` (`mtp.safetensors`, for `--mode mtp`; README, "MTP").
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
DEMO_NOTE = ("a 6.8M-parameter Qwen3 target trained on the Python standard library, its DFlash drafter and an "
             "MTP head trained for it, shipped in " + str(DEMO_DIR))


def _existing(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path}: the demo pair is missing from this installation (expected the "
                                "package data ddtree_jax/assets/demo); reinstall, or pass --target/--drafter")
    return path


def demo_target() -> Path:
    """The demo target's folder (HF layout, tokenizer included)."""
    return _existing(DEMO_DIR / "target")


def demo_drafter() -> Path:
    """The demo DFlash drafter's folder (HF layout)."""
    return _existing(DEMO_DIR / "drafter")


def demo_prompts() -> Path:
    """Held-out prompts, one JSON object {"prompt": ...} per line."""
    return _existing(DEMO_DIR / "prompts.jsonl")


def is_demo_target(folder: Path) -> bool:
    return Path(folder).resolve() == (DEMO_DIR / "target").resolve()
