"""Greedy tree acceptance: the argmax kernel against jnp.argmax; the kernel path (argmax + `tree_walk`, the walk
the engine runs for every decoding rule, through `ddtree_jax.accept.accept_tree`) against the independent
reference (ancestor matrix), and both against literal little trees with their expected paths.

Every kernel test class runs interpreted on CPU and compiled on a GPU (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.accept import accept_tree
from ddtree_jax.tree import DraftTree, ancestor_mask
from pallas_kernels import tree_accept as tac
from pallas_kernels import ENV_VAR

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def argmax_with_partials(logits, *, config, interpret):
    maxes, idxs, _ = tac._argmax_partials(logits, config=config, interpret=interpret)
    return tac._merge_argmax(maxes, idxs, logits.shape[1]), maxes, idxs


@dataclasses.dataclass(frozen=True)
class ArgmaxCase:
    b: int
    t: int
    v: int
    dtype: str
    config: tac.TreeAcceptConfig

    def __str__(self):
        c = self.config
        return f"b{self.b}-t{self.t}-v{self.v}-{self.dtype}-bt{c.block_t}-bv{c.block_v}-splits{c.num_splits}"


ARGMAX_CASES = [
    # V = 37 is not a multiple of the 16-wide tile; 2 splits: ties across tiles and across splits.
    ArgmaxCase(2, 2, 37, "float32", tac.TreeAcceptConfig(block_t=2, block_v=16, num_splits=2)),
    ArgmaxCase(1, 17, 300, "bfloat16", tac.TreeAcceptConfig(block_t=8, block_v=32)),
    ArgmaxCase(2, 65, 100, "float32", tac.TreeAcceptConfig(block_t=16, block_v=16, num_splits=3)),
    ArgmaxCase(1, 513, 24, "float32", tac.TreeAcceptConfig()),
]


@pytest.mark.parametrize("interpret", INTERPRET)
class TestArgmaxKernel:
    @pytest.mark.parametrize("case", ARGMAX_CASES, ids=str)
    def test_first_maximum_with_ties(self, case: ArgmaxCase, interpret: bool):
        rng = np.random.default_rng(zlib.crc32(str(case).encode()))
        # Few distinct values: most rows have their maximum at several indices.
        logits = rng.integers(0, 4, size=(case.b, case.t, case.v)).astype(np.float32)
        logits[0, 0, :] = -np.inf  # all -inf: argmax is 0
        logits[0, -1, :] = 0.0
        logits[0, -1, -1] = 5.0  # the maximum in the last, partial tile
        logits = jnp.asarray(logits).astype(case.dtype)
        decoded, maxes, idxs = argmax_with_partials(logits, config=case.config, interpret=interpret)
        expected = np.argmax(np.asarray(logits, np.float32), axis=-1)
        assert decoded.shape == (case.b, case.t) and decoded.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(decoded), expected)
        # The interpreter poisons outputs (NaN, int32 min): none left means every partial was written.
        assert not np.isnan(np.asarray(maxes)).any()
        assert (np.asarray(idxs) != np.iinfo(np.int32).min).all()

    def test_public_entry(self, interpret: bool):
        logits = jnp.asarray(np.random.default_rng(5).normal(size=(3, 9, 50)), jnp.bfloat16)
        decoded = tac.greedy_tokens_pallas(logits, config=tac.TreeAcceptConfig(block_v=16), interpret=interpret)
        np.testing.assert_array_equal(np.asarray(decoded), np.asarray(jnp.argmax(logits, axis=-1)))


def random_trees(rng: np.random.Generator, b: int, budget: int, path_len: int, vocab: int):
    """Random trees of T = budget + 1 nodes (depth < path_len, parents precede children, distinct sibling
    tokens, a padded tail) and logits under which a random root path is accepted to a random depth.
    Returns (logits [b, T, V] f32, tokens, parents, depths, valid)."""
    t = budget + 1
    tokens = np.zeros((b, t), np.int32)
    parents = np.zeros((b, t), np.int32)
    depths = np.zeros((b, t), np.int32)
    valid = np.zeros((b, t), bool)
    decoded = rng.integers(0, vocab, size=(b, t))
    for r in range(b):
        real = t if r % 2 == 0 else int(rng.integers(1, t + 1))  # odd rows end in padding nodes
        valid[r, :real] = True
        tokens[r, 0] = rng.integers(0, vocab)
        used = {0: set()}
        for i in range(1, real):
            while True:
                p = int(rng.integers(0, i))
                if depths[r, p] < path_len - 1 and len(used[p]) < vocab:
                    break
            tok = int(rng.choice([x for x in range(vocab) if x not in used[p]]))
            used[p].add(tok)
            used[i] = set()
            parents[r, i], depths[r, i], tokens[r, i] = p, depths[r, p] + 1, tok
        # Accept along the root path of a random real node, then maybe reject below a random depth.
        node = int(rng.integers(0, real))
        chain = [node]
        while chain[-1] != 0:
            chain.append(int(parents[r, chain[-1]]))
        for child in chain[:-1]:
            decoded[r, parents[r, child]] = tokens[r, child]
        if rng.random() < 0.5 and len(chain) > 1:
            child = chain[int(rng.integers(0, len(chain) - 1))]
            decoded[r, parents[r, child]] = (tokens[r, child] + 1) % vocab
        # Padding nodes hang under the root at depth 1 with the token the root asks for: still refused.
        for i in range(real, t):
            tokens[r, i], depths[r, i] = decoded[r, 0], 1
    logits = rng.integers(0, 3, size=(b, t, vocab)).astype(np.float32)
    logits[np.arange(b)[:, None], np.arange(t)[None, :], decoded] = 3.0
    # A tie: a second maximum after the decoded token must not win.
    later = np.minimum(decoded + 1 + rng.integers(0, vocab, size=(b, t)), vocab - 1)
    logits[np.arange(b)[:, None], np.arange(t)[None, :], later] = 3.0
    return logits, tokens, parents, depths, valid


def accept_tree_from_arrays(logits, tokens, parents, depths, valid, path_len):
    """The library's own acceptance on the same tree (ancestor mask from ddtree_jax.tree)."""
    ancestor = jax.vmap(lambda p, v: ancestor_mask(p, v, path_len - 1))(jnp.asarray(parents), jnp.asarray(valid))
    tree = DraftTree(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), depths=jnp.asarray(depths),
                     valid=jnp.asarray(valid), ancestor=ancestor, scores=jnp.zeros(tokens.shape, jnp.float32))
    return accept_tree(tree, jnp.argmax(jnp.asarray(logits), axis=-1).astype(jnp.int32), path_len)


def assert_same(got: tac.Accepted, want) -> None:
    for name in ("path", "count", "bonus", "tokens"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert g.dtype == np.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)


# Budgets 1..512; the tree is T = B + 1 nodes, the path P = block size slots.
BUDGETS = [(1, 2), (3, 4), (16, 6), (64, 16), (512, 16)]


@pytest.mark.parametrize("interpret", INTERPRET)
class TestTreeAcceptKernel:
    @pytest.mark.parametrize("budget,path_len", BUDGETS, ids=[f"B{b}-P{p}" for b, p in BUDGETS])
    def test_matches_accept_tree(self, budget: int, path_len: int, interpret: bool):
        rng = np.random.default_rng(budget)
        vocab = 12 if budget < 64 else 40
        logits, tokens, parents, depths, valid = random_trees(rng, 4, budget, path_len, vocab)
        args = (jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(depths),
                jnp.asarray(valid))
        want = accept_tree_from_arrays(logits, tokens, parents, depths, valid, path_len)
        got = tac.tree_accept_pallas(*args, path_len=path_len, config=tac.TreeAcceptConfig(block_v=16),
                                     interpret=interpret)
        assert_same(got, want)
        assert_same(tac.tree_accept_reference(*args, path_len=path_len), want)
        if budget >= 16:  # the generator must produce paths longer than the root alone
            assert int(np.max(np.asarray(want.count))) >= 3

    @pytest.mark.parametrize("reject_at", [None, 1, 9, 15])
    def test_chain(self, reject_at, interpret: bool):
        """DFlash's chain: 16 nodes, depth 15 (the deepest walk: every doubling step matters)."""
        p = 16
        rng = np.random.default_rng(p if reject_at is None else reject_at)
        tokens = rng.integers(0, 20, size=(1, p)).astype(np.int32)
        decoded = np.append(tokens[0, 1:], 3)[None]  # every draft is what its parent's decoded token asks
        if reject_at is not None:
            decoded[0, reject_at - 1] = (tokens[0, reject_at] + 1) % 20
        logits = np.where(np.arange(20)[None, None, :] == decoded[..., None], 1.0, 0.0).astype(np.float32)
        parents = np.maximum(np.arange(p) - 1, 0)[None].astype(np.int32)
        depths = np.arange(p)[None].astype(np.int32)
        valid = np.ones((1, p), bool)
        got = tac.tree_accept_pallas(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
                                     jnp.asarray(depths), jnp.asarray(valid), path_len=p,
                                     config=tac.TreeAcceptConfig(block_v=16), interpret=interpret)
        count = p if reject_at is None else reject_at
        assert int(got.count[0]) == count
        np.testing.assert_array_equal(np.asarray(got.path[0]), np.minimum(np.arange(p), count - 1))
        assert_same(got, accept_tree_from_arrays(logits, tokens, parents, depths, valid, p))

    def test_literal_trees(self, interpret: bool):
        got = tac.tree_accept_pallas(*LITERAL_INPUTS, path_len=4, config=tac.TreeAcceptConfig(block_v=16),
                                     interpret=interpret)
        assert_same(got, LITERAL_EXPECTED)


# Literal little trees, one per row, padded to 5 nodes with invalid nodes; decoded tokens listed per node.
#   row 0 (the accept.py example): tokens [9 1 2 3], parents [0 0 1 0], decoded [1 2 7 5]
#          -> nodes 0, 1, 2 accepted; node 3 wants 3 but the root decoded 1.
#   row 1: the root's decoded token (4) is no child's token -> only the root.
#   row 2: first child refused, its sibling's chain accepted to depth 3.
#   row 3: a padding node carries the token the root asks for -> refused; so is its valid sibling.
#   row 4: the root's logits tie between tokens 1 and 3 -> the first maximum (1) decides.
LITERAL_ROWS = [
    # tokens, parents, depths, valid, decoded (tie: extra maximum index or None)
    ([9, 1, 2, 3, 0], [0, 0, 1, 0, 0], [0, 1, 2, 1, 0], [1, 1, 1, 1, 0], [1, 2, 7, 5, 0], None),
    ([9, 1, 2, 3, 5], [0, 0, 0, 1, 2], [0, 1, 1, 2, 2], [1, 1, 1, 1, 1], [4, 2, 3, 8, 8], None),
    ([9, 1, 2, 3, 4], [0, 0, 0, 2, 3], [0, 1, 1, 2, 3], [1, 1, 1, 1, 1], [2, 8, 3, 4, 6], None),
    ([9, 7, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 5, 6, 0, 0], None),
    ([9, 3, 1, 6, 0], [0, 0, 0, 2, 0], [0, 1, 1, 2, 0], [1, 1, 1, 1, 0], [1, 0, 6, 2, 0], 3),
]
LITERAL_EXPECTED = tac.Accepted(
    path=np.array([[0, 1, 2, 2], [0, 0, 0, 0], [0, 2, 3, 4], [0, 0, 0, 0], [0, 2, 3, 3]], np.int32),
    count=np.array([3, 1, 4, 1, 3], np.int32),
    bonus=np.array([7, 4, 6, 1, 2], np.int32),
    tokens=np.array([[1, 2, 7, 7], [4, 4, 4, 4], [2, 3, 4, 6], [1, 1, 1, 1], [1, 6, 2, 2]], np.int32),
)


def _literal_inputs():
    vocab = 10
    logits = np.zeros((len(LITERAL_ROWS), 5, vocab), np.float32)
    cols = [[], [], [], [], []]
    for r, (tokens, parents, depths, valid, decoded, tie) in enumerate(LITERAL_ROWS):
        logits[r, np.arange(5), decoded] = 1.0
        if tie is not None:
            logits[r, 0, tie] = 1.0
        for c, x in zip(cols, (tokens, parents, depths, valid)):
            c.append(x)
    tokens, parents, depths = (jnp.asarray(np.array(c), jnp.int32) for c in cols[:3])
    return jnp.asarray(logits), tokens, parents, depths, jnp.asarray(np.array(cols[3], bool))


LITERAL_INPUTS = _literal_inputs()


class TestReference:
    def test_literal_trees(self):
        assert_same(tac.tree_accept_reference(*LITERAL_INPUTS, path_len=4), LITERAL_EXPECTED)

    def test_literal_trees_match_accept_tree(self):
        logits, tokens, parents, depths, valid = (np.asarray(x) for x in LITERAL_INPUTS)
        assert_same(tac.tree_accept_reference(*LITERAL_INPUTS, path_len=4),
                    accept_tree_from_arrays(logits, tokens, parents, depths, valid, 4))


class TestDispatchAndConfig:
    def test_dispatcher(self, monkeypatch):
        monkeypatch.delenv(ENV_VAR, raising=False)
        assert_same(tac.tree_accept(*LITERAL_INPUTS, path_len=4, implementation="reference"), LITERAL_EXPECTED)
        monkeypatch.setenv(ENV_VAR, "pallas")  # on CPU the dispatcher interprets the kernel
        assert_same(tac.tree_accept(*LITERAL_INPUTS, path_len=4, config=tac.TreeAcceptConfig(block_v=16)),
                    LITERAL_EXPECTED)
        monkeypatch.setenv(ENV_VAR, "fast")
        with pytest.raises(ValueError, match=ENV_VAR):
            tac.tree_accept(*LITERAL_INPUTS, path_len=4)

    @pytest.mark.parametrize("field,value", [("block_t", 3), ("block_t", 0), ("block_v", 8), ("block_v", 100),
                                             ("num_splits", 0), ("num_warps", 5), ("num_stages", -1)])
    def test_bad_config_names_the_value(self, field, value):
        with pytest.raises(ValueError, match=rf"TreeAcceptConfig\.{field}={value!r}"):
            tac.TreeAcceptConfig(**{field: value})

    def test_bad_shapes(self):
        logits, tokens, parents, depths, valid = LITERAL_INPUTS
        with pytest.raises(ValueError, match="parents"):
            tac.tree_accept_pallas(logits, tokens, parents[:, :4], depths, valid, path_len=4, interpret=True)
        with pytest.raises(ValueError, match="path_len=0"):
            tac.tree_accept_reference(logits, tokens, parents, depths, valid, path_len=0)
