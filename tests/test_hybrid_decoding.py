"""Decoding a Qwen3.5/3.6 hybrid target (gated attention + Gated DeltaNet): AR equals transformers' greedy
`generate`; DFlash and DDTree equal AR token for token, which needs every recurrent layer to walk the tree
from parent states (a chain-ordered recurrence must break DDTree); at temperature 1 their samples follow the
target's exact distribution (chi-square), which the chain-ordered recurrence fails."""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import engine
from ddtree_jax.cache import HybridCache, advance
from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.engine import DecodeOptions, Mode, generate
from conftest import chain_ordered, randomise_qwen3_5
from ddtree_jax.models import qwen3_5
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.random_checkpoint import write_random_dflash
from ddtree_jax.sampling import SamplingConfig
from test_dflash_decoding import VOCAB8, _exact_three_token_distribution, chi2_pvalue

torch = pytest.importorskip("torch", reason="PyTorch is not importable (builds the transformers hybrid)")

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def text_config(vocab_size: int) -> dict:
    """A small `qwen3_5_text` config: GQA 4/2, head_dim 16 half rotated; GDN 4 key heads -> 8 value heads of 4 (whole
    key-head groups on 2 and 4 devices under tp)."""
    return dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=LAYER_TYPES, linear_conv_kernel_dim=4,
        linear_key_head_dim=4, linear_num_key_heads=4, linear_num_value_heads=8, linear_value_head_dim=4,
        rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )


def build_hf_hybrid(folder, vocab_size: int, seed: int = 0, std: float = 0.1):
    """A random transformers Qwen3_5ForCausalLM (float32) saved as a `qwen3_5_text` checkpoint: random weights,
    norms and decay parameters included. Returns the torch model."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config(vocab_size))).float().eval()
    randomise_qwen3_5(model, std)
    model.save_pretrained(str(folder))
    return model


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 9, 4]]  # unequal lengths, batch 2


# ---- stage 1: AR


def test_greedy_ar_equals_transformers_generate(tmp_path):
    from transformers import GenerationConfig

    hf = build_hf_hybrid(tmp_path / "t", vocab_size=96, seed=0)
    target = load_target(tmp_path / "t", jnp.float32)
    n = 24
    result = generate(target, PROMPTS, DecodeOptions(max_new_tokens=n))
    for r, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
                max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)).numpy()[0, len(prompt):]
        assert result.output_ids[r] == want.tolist(), r
    assert result.acceptance_lengths == [[1] * (n - 1)] * 2


def test_ar_rows_that_are_done_keep_their_state(tmp_path):
    """EOS stops one row early; the other row's tokens are those of the row run alone."""
    build_hf_hybrid(tmp_path / "t", vocab_size=32, seed=1)
    target = load_target(tmp_path / "t", jnp.float32)
    free = generate(target, PROMPTS, DecodeOptions(max_new_tokens=16))
    eos = free.output_ids[1][3]
    both = generate(target, PROMPTS, DecodeOptions(max_new_tokens=16, eos_ids=(eos,)))
    for r, prompt in enumerate(PROMPTS):
        alone = generate(target, [prompt], DecodeOptions(max_new_tokens=16, eos_ids=(eos,)))
        assert both.output_ids[r] == alone.output_ids[0]
    assert both.output_ids[1][-1] == eos and len(both.output_ids[1]) <= 4


# ---- stages 2-3: DFlash (a chain) and DDTree (a tree) verified through the recurrent layers


VOCAB = 16  # small, so that random drafts are accepted often and paths go 2-3 deep
MAX_NEW = 40


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """Seeds with which some budget-16 trees accept 3 tokens (as the DDTree test below requires)."""
    root = tmp_path_factory.mktemp("hybrid_pair")
    build_hf_hybrid(root / "t", vocab_size=VOCAB, seed=6, std=0.1)
    target = load_target(root / "t", jnp.float32)
    drafter = load_drafter(write_random_dflash(root / "d", text_config(VOCAB), seed=7, block_size=8),
                           target.config, jnp.float32)
    return target, drafter


@pytest.fixture(scope="module")
def hybrid_ar(hybrid_pair):
    return generate(hybrid_pair[0], PROMPTS, DecodeOptions(max_new_tokens=MAX_NEW)).output_ids


@pytest.fixture(scope="module")
def hybrid_spec(hybrid_pair):
    """(mode, block_size, budget) -> the greedy DFlash or DDTree result on PROMPTS, each run once per module (the
    greedy tests, the off-spine count and the one-device reference of the tp tests share them). The budget-16
    DDTree run records its trees."""
    runs = {}

    def run(mode: Mode, block_size: int = 8, budget: int = 16):
        if (mode, block_size, budget) not in runs:
            options = DecodeOptions(mode=mode, max_new_tokens=MAX_NEW, block_size=block_size, budget=budget,
                                    record_trees=mode is Mode.DDTREE and budget == 16)
            runs[mode, block_size, budget] = generate(hybrid_pair[0], PROMPTS, options, drafter=hybrid_pair[1])
        return runs[mode, block_size, budget]

    return run


def _check_lengths(result, block_size):
    lengths = [n for row in result.acceptance_lengths for n in row]
    assert all(1 <= n <= block_size for n in lengths)
    assert max(lengths) >= 2, "no draft was ever accepted: the commit of a non-trivial path is not exercised"
    return lengths


@pytest.mark.parametrize("block_size", [4, 8])
def test_dflash_greedy_equals_ar(hybrid_spec, hybrid_ar, block_size):
    spec = hybrid_spec(Mode.DFLASH, block_size)
    assert spec.output_ids == hybrid_ar
    _check_lengths(spec, block_size)


@pytest.mark.parametrize("budget", [1, 16, 64])
def test_ddtree_greedy_equals_ar(hybrid_spec, hybrid_ar, budget):
    spec = hybrid_spec(Mode.DDTREE, 8, budget)
    assert spec.output_ids == hybrid_ar
    lengths = _check_lengths(spec, 8)
    if budget >= 16:  # most rounds accept a draft; some accept two
        assert np.mean(lengths) > 1.5 and sum(n >= 3 for n in lengths) >= 2


def test_ddtree_accepts_off_spine_nodes(hybrid_spec):
    """The trees accept paths that leave node-index order (a node whose parent is not the previous index),
    so the exactness above depends on parent-ordered recurrent states."""
    spec = hybrid_spec(Mode.DDTREE, 8, 16)
    off_spine = 0
    for tree in spec.trees:
        path = tree["accepted"]
        off_spine += any(b != a + 1 for a, b in zip(path, path[1:]))
    assert off_spine >= 1


def test_auto_budget_greedy_equals_ar(hybrid_pair, hybrid_ar, tmp_path, monkeypatch):
    """`--budget auto` over (chain, 4, 16) through the recurrent layers, batch 2: AR's tokens per round under cost
    tables that make it verify different candidates (costs are an argument of the one compiled loop), and per call
    with a calibrated record in which budget 4 is the fastest (so that its fixed program runs: the per-call choice
    itself is tested on the dense pair)."""
    monkeypatch.setenv("DDTREE_JAX_ROUND_COSTS", str(tmp_path / "records"))
    target, drafter = hybrid_pair
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=MAX_NEW, block_size=8, budgets=(0, 4, 16),
                            auto_scope="round")
    chosen = set()
    for costs in HYBRID_AUTO_COSTS:
        spec = generate(target, PROMPTS, options, drafter=drafter, round_costs=costs)
        assert spec.output_ids == hybrid_ar, costs
        chosen |= {b for row in spec.budgets_chosen for b in row}
    assert chosen == {0, 4, 16}, chosen
    spec = generate(target, PROMPTS, dataclasses.replace(options, auto_scope="call"), drafter=drafter,
                    auto_learned={"calls": [4, 4, 4], "tokens": [1.0, 3.0, 1.0], "seconds": [1.0, 1.0, 1.0],
                                  "paired": 4})
    assert spec.output_ids == hybrid_ar and spec.budgets_chosen == [[4] * len(r) for r in spec.acceptance_lengths]


HYBRID_AUTO_COSTS = [(1.0, 1.0, 1.2), (1.0, 1.0, 1.6), (1.0, 1.3, 2.0)]


@pytest.fixture
def chain_ordered_recurrence(monkeypatch):
    """Switch the recurrence to node-index order. The flag is read when tracing, so drop every trace and
    compilation before and after (JAX caches traces per function; the engine caches compilations)."""
    def fresh():
        jax.clear_caches()
        engine._COMPILED.clear()

    fresh()
    monkeypatch.setattr(qwen3_5, "tree_gated_delta_rule", chain_ordered(qwen3_5.tree_gated_delta_rule))
    yield
    monkeypatch.undo()
    fresh()


def test_chain_ordered_recurrence_breaks_ddtree(hybrid_pair, hybrid_ar, chain_ordered_recurrence):
    """Negative control: each node starting from the previous node index's state (not its parent's) makes
    DDTree differ from AR on the same setup; DFlash (a chain: parent = previous index) is unaffected."""
    target, drafter = hybrid_pair
    wrong = generate(target, PROMPTS, DecodeOptions(mode=Mode.DDTREE, max_new_tokens=MAX_NEW, block_size=8,
                                                    budget=16), drafter=drafter)
    assert wrong.output_ids != hybrid_ar
    chain = generate(target, PROMPTS, DecodeOptions(mode=Mode.DFLASH, max_new_tokens=MAX_NEW, block_size=8),
                     drafter=drafter)
    assert chain.output_ids == hybrid_ar


def test_correct_recurrence_is_back_after_the_negative_control(hybrid_pair, hybrid_ar):
    target, drafter = hybrid_pair
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.DDTREE, max_new_tokens=MAX_NEW, block_size=8,
                                                   budget=16), drafter=drafter)
    assert spec.output_ids == hybrid_ar


# ---- the pieces


def test_tree_verify_states_equal_running_each_root_path(hybrid_pair):
    """A verify forward over a small tree: every node's hidden state and recurrent state equal a plain
    chain forward over its root path (from the same committed cache; the path right-padded to the longest, 5
    tokens, with `valid` its length: padding leaves the recurrent states alone, `ForwardMeta.valid`)."""
    target, _ = hybrid_pair
    config = target.config
    prompt = jnp.asarray([[5, 1, 7, 2, 9]])
    cache = qwen3_5.create_cache(config, 1, 32, jnp.float32)
    out = jax.jit(lambda t, c: qwen3_5.forward(t, prompt, ForwardMeta.prompt(jnp.asarray([5]), 5), c))(target, cache)
    cache = advance(out.cache, jnp.asarray([5]))
    parents = np.array([0, 0, 0, 1, 2, 3, 3, 5])  # root; two children; grandchildren; a depth-4 branch
    depths = np.array([0, 1, 1, 2, 2, 3, 3, 4])
    tokens = jnp.asarray([[4, 11, 3, 8, 8, 1, 14, 6]])
    from ddtree_jax.tree import ancestor_mask

    from ddtree_jax.cache import commit_recurrent

    mask = ancestor_mask(jnp.asarray(parents), jnp.ones(8, bool), 8)[None]
    meta = ForwardMeta.tree(cache.lengths, jnp.asarray(parents)[None], jnp.asarray(depths)[None], mask)
    tree_out = jax.jit(lambda t, c: qwen3_5.forward(t, tokens, meta, c))(target, cache)
    assert isinstance(tree_out.cache, HybridCache) and len(tree_out.nodes) == len(config.linear_layers)

    longest = 5

    @jax.jit
    def chain_forward(t, path_tokens, n, c):  # the first n of `longest` tokens
        return qwen3_5.forward(t, path_tokens, ForwardMeta(positions=5 + jnp.arange(longest)[None],
                                                           new_mask=jnp.tril(jnp.ones((1, longest, longest), bool)),
                                                           valid=n), c)

    commit = jax.jit(lambda nodes, committed, path, n: [commit_recurrent(c, nd, path, n)
                                                        for nd, c in zip(nodes, committed)])
    for node in range(8):
        path = [node]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        path = path[::-1]
        n = len(path)
        chain = chain_forward(target, tokens[:, np.array(path + [path[-1]] * (longest - n))], jnp.asarray([n]), cache)
        # Two float32 orders of the same sums (the WY tree form against the chunked chain): hidden states of size
        # ~3 agree to ~1e-5 (1.4e-5 seen on one CPU, within 1e-5 on another); a wrong root path is off by ~0.1.
        np.testing.assert_allclose(np.asarray(tree_out.hidden[0, node]), np.asarray(chain.hidden[0, n - 1]),
                                   atol=5e-5, rtol=0, err_msg=f"node {node}")
        # The state (`cache.path_state`) and conv window after committing this root path equal the chain's.
        path_arr = jnp.asarray([path + [path[-1]] * (8 - n)])
        for got, rec in zip(commit(tree_out.nodes, cache.recurrent, path_arr, jnp.asarray([n])),
                            chain.cache.recurrent):
            np.testing.assert_allclose(np.asarray(got.conv), np.asarray(rec.conv), atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(got.state), np.asarray(rec.state), atol=1e-5, rtol=0,
                                       err_msg=f"node {node}")


def test_ddtree_on_two_devices_equals_ar_under_dp(hybrid_pair, hybrid_ar):
    """The hybrid caches under dp: rows over devices."""
    from ddtree_jax.parallel import make_parallel

    target, drafter = hybrid_pair
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.DDTREE, max_new_tokens=MAX_NEW, block_size=8, budget=16,
                                                   parallel=make_parallel(2, "dp")), drafter=drafter)
    assert spec.output_ids == hybrid_ar


# ---- tensor parallelism: the Gated DeltaNet layers split by key heads (4: 2 or 1 per device, each with its 2
# value heads), the gated attention by heads (2 KV heads: split on 2 devices, replicated on 4). AR, DFlash and
# DDTree on 2 devices; AR and DDTree on 4 (DFlash's verify is DDTree's code path on a chain).

TP_RUNS = [(Mode.AR, 2), (Mode.DFLASH, 2), (Mode.DDTREE, 2), (Mode.AR, 4), (Mode.DDTREE, 4)]


def _tp_options(mode: Mode, parallel=None) -> DecodeOptions:
    from ddtree_jax.parallel import Parallel

    return DecodeOptions(mode=mode, max_new_tokens=MAX_NEW, block_size=8, budget=16, parallel=parallel or Parallel())


@pytest.fixture(scope="module")
def tp_run(hybrid_pair):
    """(mode, devices) -> (GenerationResult, HLO text of the compiled decode loop) of a tp run, each run once."""
    from ddtree_jax.parallel import make_parallel, shard_params

    runs = {}

    def run(mode: Mode, devices: int):
        if (mode, devices) not in runs:
            parallel = make_parallel(devices, "tp")
            target, drafter = (shard_params(p, parallel) for p in hybrid_pair)
            options = _tp_options(mode, parallel)
            result = generate(target, PROMPTS, options, drafter=drafter)
            loops = [c for key, c in engine._COMPILED.items()
                     if key[0] == "decode_loop" and dict(key[3])["options"].parallel == parallel
                     and dict(key[3])["options"].mode is mode]
            runs[mode, devices] = result, loops[-1].as_text()
        return runs[mode, devices]

    return run


@pytest.mark.parametrize("mode,devices", [pytest.param(m, n, id=f"{m.value}-{n}") for m, n in TP_RUNS])
def test_tp_equals_one_device(tp_run, hybrid_spec, hybrid_ar, mode, devices):
    """Token-identical to one device, round for round (AR: one token a round; DFlash and DDTree: the rounds of the
    greedy one-device runs above, same options)."""
    split, _ = tp_run(mode, devices)
    assert split.output_ids == hybrid_ar
    one_device = [[1] * (MAX_NEW - 1)] * len(PROMPTS) if mode is Mode.AR else hybrid_spec(mode).acceptance_lengths
    assert split.acceptance_lengths == one_device


def _collectives_by_layer(hlo: str) -> dict[int, collections.Counter]:
    """Collective ops of a compiled program per target decoder layer (the `layer_{i}` named scope of its op)."""
    found = collections.defaultdict(collections.Counter)
    for line in hlo.splitlines():
        op = re.search(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", line)
        layer = re.search(r'op_name="[^"]*/layer_(\d+)/', line)
        if op and layer:
            found[int(layer.group(1))][op.group(1)] += 1
    return found


@pytest.mark.parametrize("mode,devices", [pytest.param(m, n, id=f"{m.value}-{n}") for m, n in TP_RUNS
                                          if m is not Mode.DFLASH])
def test_tp_loop_has_one_all_reduce_after_each_projection_out(tp_run, hybrid_pair, mode, devices):
    """In the compiled tp decode loop, each layer all-reduces twice: after its attention or Gated DeltaNet
    output projection, and after its MLP. A Gated DeltaNet layer adds one all-gather (the conv output, from
    the weight's contiguous channel blocks to each device's heads) and nothing else. Replicated GDN layers
    would have one all-reduce (the MLP's) and none of the all-gather."""
    config = hybrid_pair[0].config
    layers = _collectives_by_layer(tp_run(mode, devices)[1])
    for i in config.linear_layers:
        assert layers[i] == {"all-reduce": 2, "all-gather": 1}, (i, layers[i])
    for i in config.attention_layers:
        assert layers[i]["all-reduce"] == 2, (i, layers[i])


def test_tp_devices_hold_their_share_of_every_gdn_weight_and_state(hybrid_pair):
    """Each of N devices holds 1/N of every Gated DeltaNet weight (whole key-head groups: rows of in_proj_qkv
    and conv channels in contiguous blocks, value heads of z/b/a/A_log/dt_bias, input features of out_proj),
    of every recurrent state and conv window, and of the per-node records a tree verify returns. The gated
    norm's weight (Dv values shared by every head) stays whole."""
    from ddtree_jax.parallel import constrain_cache, make_parallel, shard_params
    from ddtree_jax.tree import ancestor_mask

    config = hybrid_pair[0].config
    split_dim = {"in_proj_qkv.weight": 0, "in_proj_z.weight": 0, "in_proj_b.weight": 0, "in_proj_a.weight": 0,
                 "conv1d.weight": 0, "A_log": 0, "dt_bias": 0, "out_proj.weight": 1, "norm.weight": None}

    def assert_split(array, dim, n, what):
        shards = array.addressable_shards
        assert len({s.device for s in shards}) == n, what
        for shard in shards:
            expected = list(array.shape)
            if dim is not None:
                expected[dim] //= n
            assert list(shard.data.shape) == expected, what
        if dim is not None:  # together the shards are the whole array, without overlap
            assert sorted(s.index[dim].start or 0 for s in shards) == [i * array.shape[dim] // n for i in range(n)]

    for n in (2, 4):
        parallel = make_parallel(n, "tp")
        flat = shard_params(hybrid_pair[0], parallel).flat()
        gdn = {name: a for name, a in flat.items() if ".linear_attn." in name}
        assert len(gdn) == len(split_dim) * len(config.linear_layers)
        for name, array in gdn.items():
            assert_split(array, split_dim[name.split(".linear_attn.")[1]], n, name)
        cache = jax.jit(lambda: constrain_cache(qwen3_5.create_cache(config, 2, 32, jnp.float32), parallel))()
        for r in cache.recurrent:
            assert_split(r.state, 1, n, "state")  # [b, Hv, Dk, Dv]
            assert_split(r.conv, 1, n, "conv")  # [b, C, K - 1]

    # The per-node records of a tree verify on 2 devices: keys/values/log decay by value heads, inputs by channels.
    parallel = make_parallel(2, "tp")
    target = shard_params(hybrid_pair[0], parallel)
    parents, depths = jnp.asarray([[0, 0, 0, 1, 2]]), jnp.asarray([[0, 1, 1, 2, 2]])
    meta = ForwardMeta.tree(jnp.zeros((1,), jnp.int32), parents, depths,
                            ancestor_mask(parents[0], jnp.ones(5, bool), 5)[None])
    runtime = _tp_options(Mode.DDTREE, parallel).runtime
    nodes = jax.jit(lambda t: qwen3_5.forward(t, jnp.zeros((1, 5), jnp.int32), meta, constrain_cache(
        qwen3_5.create_cache(config, 1, 32, jnp.float32), parallel), runtime=runtime).nodes)(target)
    for layer in nodes:
        for field in ("keys", "values", "log_decay", "inputs"):
            assert_split(getattr(layer, field), 2, 2, field)


def test_tp_warns_once_when_key_heads_do_not_divide(hybrid_pair):
    """4 key heads over 3 devices: every Gated DeltaNet weight stays whole, and one warning says so."""
    from ddtree_jax.parallel import make_parallel, param_shardings

    with pytest.warns(UserWarning, match="--parallel tp") as caught:
        shardings = param_shardings(hybrid_pair[0], make_parallel(3, "tp"))
    messages = [str(w.message) for w in caught if "--parallel tp" in str(w.message)]
    assert len(messages) == 1 and "on 3 devices" in messages[0]
    assert "model.layers.*.linear_attn (4 heads)" in messages[0], messages[0]
    gdn = [s for name, s in shardings.items() if ".linear_attn." in name]
    assert gdn and all(s.is_fully_replicated for s in gdn)
    assert not shardings["model.layers.0.mlp.gate_up_proj.weight"].is_fully_replicated  # 48 MLP features: split


# ---- sampling (T > 0): DFlash and DDTree samples follow the hybrid target's own distribution

# A quarter of the Qwen3 tests' 4000: the cost here is the prefill of every row through the chunked delta rule,
# which on a busy CPU took from 1 to 45 s per 2000 rows. The chain-ordered negative control below runs at this
# same size and is rejected far below its p < 1e-6 (p 5e-79 to 4e-68 over three seeds at 1000 samples, measured
# 2026-12-04), so this size sees a hybrid's state bug; test_dflash_decoding shows the power of the same check
# against a wrong sampler at 4000.
SAMPLES = 1000


@pytest.fixture(scope="module")
def hybrid_sampling_pair(tmp_path_factory):
    """A peaked random hybrid target on an 8-token vocabulary (larger weights: tokens depend strongly on their
    prefix, through the Gated DeltaNet layers as well as the attention layer), a random drafter, a prompt and
    the exact p(x1, x2, x3 | prompt) flattened [512] (as test_dflash_decoding.sampling_pair for Qwen3)."""
    root = tmp_path_factory.mktemp("hybrid_sampling")
    build_hf_hybrid(root / "t", vocab_size=VOCAB8, seed=5, std=0.4)
    target = load_target(root / "t", jnp.float32)
    drafter = load_drafter(write_random_dflash(root / "d", text_config(VOCAB8), seed=6, head_dim=8), target.config,
                           jnp.float32)
    prompt = [1, 2, 3]
    exact = _exact_three_token_distribution(target, prompt, VOCAB8).ravel()
    return target, drafter, prompt, exact / exact.sum()  # renormalised: float32 softmax rounding


def _sample(pair, options, seed, n=SAMPLES):
    """n samples (x1, x2, x3) [n, 3] and the number of accepted drafts over all rounds."""
    target, drafter, prompt, _ = pair
    result = generate(target, [prompt] * n, options, drafter=drafter, seed=seed)
    accepted = sum(m - 1 for row in result.acceptance_lengths for m in row)
    return np.array(result.output_ids), accepted


def test_dflash_sampling_follows_the_hybrid_distribution(hybrid_sampling_pair):
    """Chi-square of DFlash samples (x1, x2, x3) at T = 1 against the exact distribution: 512 cells, cells
    expecting < 5 pooled, alpha 1e-3, fixed seed."""
    options = DecodeOptions(mode=Mode.DFLASH, max_new_tokens=3, block_size=4, sampling=SamplingConfig(temperature=1.0))
    samples, accepted = _sample(hybrid_sampling_pair, options, seed=123)
    assert accepted > SAMPLES // 8, "drafts were rarely accepted; the test would not exercise the match rule"
    assert chi2_pvalue(samples, hybrid_sampling_pair[3]) > 1e-3


DDTREE_SAMPLING = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=3, block_size=4, budget=6,
                                sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))


def test_ddtree_sampling_follows_the_hybrid_distribution(hybrid_sampling_pair):
    """As the DFlash test, for DDTree (budget 6: branching trees, whose node states must come from their parents,
    as the negative control below shows)."""
    samples, accepted = _sample(hybrid_sampling_pair, DDTREE_SAMPLING, seed=321)
    assert accepted > SAMPLES // 4
    assert chi2_pvalue(samples, hybrid_sampling_pair[3]) > 1e-3


def test_chain_ordered_recurrence_fails_the_sampling_check(hybrid_sampling_pair, chain_ordered_recurrence):
    """Negative control (last in this module: it drops every compilation): with each node starting from the
    previous node index's state instead of its parent's, DDTree samples no longer follow the target, and the
    chi-square check above rejects them at p < 1e-6 with the same number of samples."""
    samples, _ = _sample(hybrid_sampling_pair, DDTREE_SAMPLING, seed=321)
    assert chi2_pvalue(samples, hybrid_sampling_pair[3]) < 1e-6
