"""The byte-level BPE: round trip, AutoTokenizer loading, special tokens, determinism."""

from __future__ import annotations

import pytest

from ddtree_jax.train import corpus
from ddtree_jax.train.tokenizer import EOS_TOKEN, MASK_TOKEN, load_tokenizer, mask_token_id, train_tokenizer

VOCAB = 400


def _texts():
    train, _ = corpus.split_files(corpus.list_files())
    return list(corpus.iter_texts(train[:12]))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(_texts(), folder, vocab_size=VOCAB)
    return folder


def test_auto_tokenizer_loads_with_special_tokens(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == VOCAB
    assert tok.convert_ids_to_tokens([0, 1]) == [EOS_TOKEN, MASK_TOKEN]
    assert tok.eos_token_id == tok.pad_token_id == tok.bos_token_id == 0
    assert tok.mask_token_id == mask_token_id(tok) == 1
    assert tok(EOS_TOKEN + "x" + MASK_TOKEN, add_special_tokens=False)["input_ids"][::2] == [0, 1]


@pytest.mark.parametrize("text", [
    "def f(x):\n    \"\"\"Doc.\"\"\"\n\treturn  x  \n\n",
    "caf\u00e9 \u4e2d\u6587 \U0001F600 \x00\x7f",
    "   leading spaces and trailing   ",
])
def test_round_trip(tok_dir, text):
    tok = load_tokenizer(tok_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert all(0 <= i < VOCAB for i in ids) and 1 not in ids
    assert tok.decode(ids) == text


def test_training_is_deterministic(tok_dir, tmp_path):
    train_tokenizer(_texts(), tmp_path, vocab_size=VOCAB)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_merges_shorten_code(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = "import os\n\ndef main():\n    return None\n"
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < 0.6 * len(text.encode())
