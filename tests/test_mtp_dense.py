"""An MTP head on a dense Qwen3 target (`config.dense_mtp_layers`): stored beside the target's files
(`checkpoint.write_mtp_beside`), which the project's loaders and transformers still read as before, and greedy
`--mode mtp` equal to AR token for token in float32."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ddtree_jax.checkpoint import CheckpointError, load_mtp, load_target, write_mtp_beside
from ddtree_jax.config import FULL_ATTENTION, ConfigError, load_target_config, mtp_config
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.models import mtp
from ddtree_jax.random_checkpoint import write_random_qwen3
from test_mtp_decoding import MAX_NEW, PROMPTS, fitted_head

DENSE = dict(vocab_size=16, hidden_size=32, intermediate_size=48, head_dim=16, num_attention_heads=4,
             num_key_value_heads=2, eos_token_id=None, bos_token_id=None)


def random_head_arrays(folder, seed: int = 0) -> dict[str, np.ndarray]:
    """Random `mtp.*` arrays (one layer) for the dense target in `folder`: N(0, 0.1), norms N(0, 0.1) offsets."""
    config = mtp_config(dataclasses.replace(load_target_config(folder), mtp_num_hidden_layers=1))
    rng = np.random.default_rng(seed)
    return {name: (0.1 * rng.standard_normal(a.shape)).astype(np.float32)
            for name, a in mtp.abstract(config, jnp.float32).flat().items()}


def test_the_head_layer_takes_the_dense_targets_shape(tmp_path):
    folder = write_random_qwen3(tmp_path / "t", with_tokenizer=False, rope_theta=5000.0, **DENSE)
    target = load_target_config(folder)
    with pytest.raises(ConfigError, match="a qwen3 target has no multi-token-prediction head"):
        mtp_config(target)
    layers = mtp_config(dataclasses.replace(target, mtp_num_hidden_layers=2)).layers
    assert (layers.hidden_size, layers.intermediate_size, layers.num_heads, layers.num_kv_heads, layers.head_dim) \
        == (32, 48, 4, 2, 16)
    assert (layers.rope.theta, layers.rotary_dim, layers.layer_types) == (5000.0, 16, (FULL_ATTENTION,) * 2)


def test_head_beside_the_target_leaves_it_readable(tmp_path):
    """The head goes into mtp.safetensors with an index; model.safetensors keeps its bytes, `load_target` and
    transformers read the same target weights, `load_mtp` the head's; a second head replaces the first, and a
    folder whose own files hold a head is refused."""
    folder = write_random_qwen3(tmp_path / "t", with_tokenizer=False, **DENSE)
    before = (folder / "model.safetensors").read_bytes()
    plain = {n: np.asarray(a) for n, a in load_target(folder, jnp.float32).flat().items()}
    head = random_head_arrays(folder)
    write_mtp_beside(folder, head, 1)

    assert (folder / "model.safetensors").read_bytes() == before
    assert json.loads((folder / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n, f in index.items() if f == "mtp.safetensors"} == set(head)
    target = load_target(folder, jnp.float32)
    assert all(np.array_equal(np.asarray(a), plain[n]) for n, a in target.flat().items())
    loaded = load_mtp(folder, target.config, jnp.float32)
    assert all(np.array_equal(np.asarray(a), head[n]) for n, a in loaded.flat().items())

    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    state = {n: t.numpy() for n, t in model.state_dict().items()}
    assert set(state) == set(load_file(str(folder / "model.safetensors")))
    assert all(np.array_equal(state[n], plain[n]) for n in plain)

    again = random_head_arrays(folder, seed=1)
    write_mtp_beside(folder, again, 1)
    assert np.array_equal(np.asarray(load_mtp(folder, target.config, jnp.float32).flat()["mtp.fc.weight"]),
                          again["mtp.fc.weight"])
    inside = write_random_qwen3(tmp_path / "inside", with_tokenizer=False, **DENSE)
    arrays = load_file(str(inside / "model.safetensors")) | head
    from safetensors.numpy import save_file

    save_file(arrays, str(inside / "model.safetensors"))
    with pytest.raises(CheckpointError, match="already holds an MTP head"):
        write_mtp_beside(inside, head, 1)


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory):
    """(target, fitted head, AR outputs): a random dense Qwen3 on a 16-token vocabulary with a one-layer head
    stored beside it and loaded from there."""
    folder = write_random_qwen3(tmp_path_factory.mktemp("dense_mtp") / "t", seed=4, with_tokenizer=False,
                                std=0.3, **DENSE)
    write_mtp_beside(folder, random_head_arrays(folder, seed=2), 1)
    target = load_target(folder, jnp.float32)
    head = load_mtp(folder, target.config, jnp.float32)
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=MAX_NEW)).output_ids
    return target, fitted_head(target, head, [p + o for p, o in zip(PROMPTS, ar)]), ar


def test_dense_greedy_equals_ar(dense_pair):
    target, head, ar = dense_pair
    m = 3
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.MTP, max_new_tokens=MAX_NEW, mtp_steps=m), drafter=head)
    assert spec.output_ids == ar
    lengths = [n for row in spec.acceptance_lengths for n in row]
    assert max(lengths) >= 3, "no round accepted a chain of drafts: the commit would go untested"
    assert min(lengths) == 1, "no round rejected the first draft"
