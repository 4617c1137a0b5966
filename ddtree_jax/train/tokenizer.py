"""A byte-level BPE tokenizer trained with HF `tokenizers`, saved for `transformers.AutoTokenizer`.

Byte-level (GPT-2 style): every byte string round-trips exactly, whitespace and indentation included,
and there is no unknown token. Two special tokens come first: `<|endoftext|>` (id 0: EOS, BOS and
padding) and `<|mask|>` (id 1: the DFlash drafter's mask token; never in the training text). Training
is deterministic for the same texts and settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

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
    from transformers import PreTrainedTokenizerFast

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


def encode_documents(tokenizer, texts: Iterable[str], *, batch: int = 64) -> "list[list[int]]":
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
