"""The stdlib corpus: file list, held-out split by file, held-out prompts."""

from __future__ import annotations

import hashlib
import json

from ddtree_jax.train import corpus


def test_file_list_is_sorted_and_excludes_site_packages_and_tests():
    files = corpus.list_files()
    assert files == sorted(files) and len(files) > 300
    assert "os.py" in files and "json/decoder.py" in files
    assert not any(part in ("site-packages", "dist-packages", "__pycache__", "test", "tests")
                   for f in files for part in f.split("/")[:-1])
    with_tests = corpus.list_files(include_tests=True)
    assert set(files) < set(with_tests) and any(f.startswith("test/") for f in with_tests)


def test_held_out_split_is_a_stable_hash_of_the_path():
    digest = hashlib.sha256(b"json/decoder.py").digest()
    expected = int.from_bytes(digest[:8], "big") < 0.02 * 2.0**64
    assert corpus.is_held_out("json/decoder.py") == expected
    files = corpus.list_files()
    train, held = corpus.split_files(files)
    assert sorted(train + held) == files and not set(train) & set(held)
    assert 0.005 < len(held) / len(files) < 0.05
    # The split of a file does not depend on which other files are listed, nor on their order.
    subset = files[::7][::-1]
    assert corpus.split_files(subset)[1] == [f for f in subset if f in set(held)]
    assert corpus.split_files(files, 0.0) == (files, []) and corpus.split_files(files, 1.0) == ([], files)


def test_function_prompts_keep_signature_and_docstring_only():
    source = '''
import functools

@functools.cache
def add(a, b=1):
    """Add two numbers.

    More text."""
    return a + b

def no_doc(x):
    return x

class C:
    async def run(self, *args) -> None:
        """Run it."""
        await other()
'''
    assert corpus.function_prompts(source) == [
        'def add(a, b=1):\n    """Add two numbers.\n\n    More text."""',
        'async def run(self, *args) -> None:\n    """Run it."""',
    ]
    assert corpus.function_prompts("def broken(:\n") == []
    assert corpus.function_prompts(source, max_chars=55) == ['async def run(self, *args) -> None:\n    """Run it."""']


def test_held_out_prompts_jsonl(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "b.py").write_text('def g():\n    """G."""\n')
    (root / "pkg" / "a.py").write_text('def f(x):\n    """F."""\n    return x\n')
    (root / "site-packages").mkdir()
    (root / "site-packages" / "c.py").write_text('def h():\n    """H."""\n')
    prompts = corpus.held_out_prompts(root, fraction=1.0)
    assert prompts == ['def g():\n    """G."""', 'def f(x):\n    """F."""']
    path = corpus.write_prompts_jsonl(prompts, tmp_path / "out" / "prompts.jsonl")
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": p} for p in prompts]
    assert corpus.held_out_prompts(root, fraction=0.0) == []


def test_stdlib_held_out_prompts_are_deterministic():
    first = corpus.held_out_prompts(max_prompts=20)
    assert first == corpus.held_out_prompts(max_prompts=20)
    assert 0 < len(first) <= 20 and all(p.lstrip().startswith(("def ", "async def ")) for p in first)
