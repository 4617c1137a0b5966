"""A byte-level BPE tokenizer trained with HF `tokenizers`, saved for `transformers.AutoTokenizer`.

Byte-level (GPT-2 style): every byte string round-trips exactly, whitespace and indentation included,
and there is no unknown token. Two special tokens come first: `<|endoftext|>` (id 0: EOS, BOS and
padding) and `<|mask|>` (id 1: the DFlash drafter's mask token; never in the training text). Training
is deterministic for the same texts and settings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 8192


def train_tokenizer(texts: Iterable[str], out: str | Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    min_frequency: int = 2):
    """Train a byte-level BPE on `texts` and save it into the folder `out` (tokenizer.json,
    tokenizer_config.json); returns the `PreTrainedTokenizerFast`.

    The vocabulary holds the 2 special tokens, the 256 byte symbols and up to `vocab_size - 258` merges
    (fewer if the texts run out of pairs seen `min_frequency` times).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258 + 1:
        raise ValueError(f"vocab_size must be > 258 (2 special tokens + 256 bytes), got {vocab_size}")
    # Parallel BPE training merges its pair counts in a fixed order, but stay on the safe side.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = wrap(tok)
    Path(out).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def wrap(tok):
    """A `tokenizers.Tokenizer` -> `PreTrainedTokenizerFast` with EOS/BOS/pad = <|endoftext|>, mask = <|mask|>."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, mask_token=MASK_TOKEN, unk_token=None,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 30)


def load_tokenizer(folder: str | Path):
    """`AutoTokenizer.from_pretrained(folder)`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def mask_token_id(tokenizer) -> int | None:
    """The tokenizer's `<|mask|>` id (or its declared mask token's), or None when it has neither."""
    if tokenizer is None:
        return None
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    ids = tokenizer.convert_tokens_to_ids([MASK_TOKEN])
    unk = getattr(tokenizer, "unk_token_id", None)
    return int(ids[0]) if ids and ids[0] is not None and ids[0] != unk else None


def encode_documents(tokenizer, texts: Iterable[str], *, batch: int = 64) -> list[list[int]]:
    """Token ids of each text (no special tokens added), in batches for speed."""
    out: list[list[int]] = []
    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            out.extend(tokenizer(chunk, add_special_tokens=False)["input_ids"])
            chunk = []
    if chunk:
        out.extend(tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return out


def main(argv=None) -> int:
    """`python -m ddtree_jax.train.tokenizer --out DIR [--vocab-size N] [--max-files N] [--include-tests]`:
    train on the corpus's training split (held-out files excluded)."""
    import argparse
    import json

    from ddtree_jax.train import corpus

    p = argparse.ArgumentParser(prog="python -m ddtree_jax.train.tokenizer", description=main.__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--corpus-root", type=Path, default=None, help="folder of .py files (default: the stdlib)")
    p.add_argument("--include-tests", action="store_true")
    p.add_argument("--max-files", type=int, default=None, help="train on the first N training files only")
    a = p.parse_args(argv)
    train, _ = corpus.split_files(corpus.list_files(a.corpus_root, include_tests=a.include_tests))
    tok = train_tokenizer(corpus.iter_texts(train[:a.max_files], a.corpus_root), a.out, vocab_size=a.vocab_size)
    print(json.dumps({"out": str(a.out), "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                      "mask_token_id": tok.mask_token_id, "files": len(train[:a.max_files])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
