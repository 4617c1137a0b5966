"""The training corpus: the Python standard library's own `.py` files.

Every machine with Python has it, so the demo needs no download. Files are listed in sorted order of
their path relative to the stdlib folder (site-packages and dist-packages are never included; test
folders only on request), and split by file: a file is held out when a stable hash of its relative path
falls under `held_out_fraction`, so the split does not depend on the file list, the machine or the
order of reading. The corpus differs between Python versions (3.11 here, 3.12 on the GPU machine); it
is deterministic for one version.

Held-out prompts are the signatures and docstrings of the functions defined in held-out files (via
`ast`): text the target never saw, in the style it was trained on.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

HELD_OUT_FRACTION = 0.02
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """The folder of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: str | Path | None = None, *, include_tests: bool = False) -> list[str]:
    """Relative POSIX paths of the `.py` files under `root` (default: the stdlib), sorted.

    Folders named site-packages, dist-packages or __pycache__ are skipped, and test folders (`test`,
    `tests`, `idle_test`) unless `include_tests`."""
    root = Path(root) if root is not None else stdlib_root()
    skip = EXCLUDED_DIRS if include_tests else EXCLUDED_DIRS | TEST_DIRS
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_held_out(rel_path: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Whether a file (relative POSIX path) is held out: the first 8 bytes of sha256(path), as a fraction
    of 2**64, fall under `fraction`. Stable across machines, runs and Python versions."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def split_files(files: Iterable[str], fraction: float = HELD_OUT_FRACTION) -> tuple[list[str], list[str]]:
    """(train, held_out), each in the order given."""
    train, held = [], []
    for rel in files:
        (held if is_held_out(rel, fraction) else train).append(rel)
    return train, held


def read_text(root: str | Path | None, rel_path: str) -> str | None:
    """A file's text as UTF-8, or None if it is not valid UTF-8 (a few stdlib files are not)."""
    root = Path(root) if root is not None else stdlib_root()
    try:
        return (root / rel_path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def iter_texts(files: Iterable[str], root: str | Path | None = None) -> Iterator[str]:
    """The texts of `files` in order, skipping unreadable and empty ones."""
    for rel in files:
        text = read_text(root, rel)
        if text and text.strip():
            yield text


def function_prompts(source: str, max_chars: int = 600) -> list[str]:
    """Each function's signature plus docstring (decorators dropped, dedented), in source order.

    Example: `def f(x):\\n    \"\"\"Double x.\"\"\"\\n    return 2 * x` gives `def f(x):\\n    \"\"\"Double x.\"\"\"`.
    Functions without a docstring, and prompts longer than `max_chars`, are skipped.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc = node.body[0]
        text = textwrap.dedent("\n".join(lines[node.lineno - 1:doc.end_lineno]))
        if text.strip() and len(text) <= max_chars:
            out.append((node.lineno, text))
    return [text for _, text in sorted(out)]


def held_out_prompts(root: str | Path | None = None, *, fraction: float = HELD_OUT_FRACTION,
                     include_tests: bool = False, max_prompts: int | None = None,
                     max_chars: int = 600) -> list[str]:
    """Function signatures plus docstrings from the held-out files, file by file in sorted order."""
    _, held = split_files(list_files(root, include_tests=include_tests), fraction)
    prompts: list[str] = []
    for text in iter_texts(held, root):
        prompts.extend(function_prompts(text, max_chars))
        if max_prompts is not None and len(prompts) >= max_prompts:
            return prompts[:max_prompts]
    return prompts


def write_prompts_jsonl(prompts: Iterable[str], path: str | Path) -> Path:
    """One `{"prompt": ...}` object per line (the doctor's and the benchmark's prompt format)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return path
