"""`generate` as researchers use it: chat options as the published drafters expect, many prompts from a file."""

from __future__ import annotations

import json
import shutil

import pytest

import ddtree_jax.engine
from ddtree_jax.demo_pair import demo_prompts
from ddtree_jax.generate import main

# A Qwen3-like template with a thinking switch: `enable_thinking=False` closes an empty think block.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")


def with_template(random_target, folder, template):
    from transformers import AutoTokenizer

    shutil.copytree(random_target, folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = template
    tok.save_pretrained(str(folder))
    return folder, AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def chat_target(random_target, tmp_path_factory):
    return with_template(random_target, tmp_path_factory.mktemp("chat") / "target", THINKING_TEMPLATE)


class Handed(Exception):
    """Raised by the spy once it has seen what the CLI hands the engine."""


def prompts_handed_to_engine(monkeypatch, *args) -> list[list[int]]:
    seen = []

    def spy(params, prompts, options, **kwargs):
        seen.extend(list(p) for p in prompts)
        raise Handed

    monkeypatch.setattr(ddtree_jax.engine, "generate", spy)
    with pytest.raises(Handed):
        main(["--mode", "ar", "--max-new-tokens", "4", *args])
    return seen


@pytest.mark.parametrize("flags,messages,kwargs", [
    ([], [("user", "hi")], {}),
    (["--no-thinking"], [("user", "hi")], {"enable_thinking": False}),
    (["--thinking"], [("user", "hi")], {"enable_thinking": True}),
    (["--chat-template-kwargs", '{"enable_thinking": false}'], [("user", "hi")], {"enable_thinking": False}),
    (["--system", "Be brief.", "--no-thinking"], [("system", "Be brief."), ("user", "hi")],
     {"enable_thinking": False}),
])
def test_chat_flags_give_the_templates_ids(chat_target, monkeypatch, flags, messages, kwargs):
    folder, tok = chat_target
    expected = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
                                       tokenize=True, **kwargs)["input_ids"]
    assert prompts_handed_to_engine(monkeypatch, "--target", str(folder), "--prompt", "hi", "--chat", *flags) == \
        [expected]


def test_no_thinking_changes_the_prompt(chat_target):
    """The switch matters (so the test above could fail): thinking off appends an empty think block."""
    _, tok = chat_target
    on, off = (tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False, **kw) for kw in ({}, {"enable_thinking": False}))
    assert off == on + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("flags,message", [
    (["--no-thinking"], "--thinking/--no-thinking: needs --chat"),
    (["--system", "x"], "--system: needs --chat"),
    (["--chat", "--thinking", "--chat-template-kwargs", '{"enable_thinking": false}'],
     "--thinking contradicts --chat-template-kwargs enable_thinking=false"),
    (["--chat", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object"),
    (["--chat", "--chat-template-kwargs", "{nope"], "--chat-template-kwargs: not JSON"),
])
def test_chat_flag_errors(chat_target, capsys, flags, message):
    assert main(["--target", str(chat_target[0]), "--mode", "ar", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_a_switch_the_template_lacks_is_warned(random_target, tmp_path, monkeypatch, capsys):
    folder, tok = with_template(random_target, tmp_path / "t", THINKING_TEMPLATE.replace("enable_thinking", "x"))
    prompts_handed_to_engine(monkeypatch, "--target", str(folder), "--prompt", "hi", "--chat", "--no-thinking")
    assert f"warning: the chat template in {folder} never reads 'enable_thinking'" in capsys.readouterr().err


def test_prompts_file_in_batches_equals_per_prompt_ar(tmp_path, capsys):
    """Greedy DDTree on the demo pair through --prompts, in batches of 3 (the 4 runnable prompts: a batch of 3 rows
    of unequal length, then a batch of 1), equals AR run one prompt at a time, row by row; bad lines are reported
    by number and the others still written."""
    held_out = [json.loads(line) for line in demo_prompts().read_text().splitlines()[:3]]
    good = [{**held_out[0], "id": "first"}, held_out[1], {"prompt_ids": [266, 392, 1062]}, held_out[2]]
    file = tmp_path / "prompts.jsonl"
    file.write_text("\n".join([json.dumps(good[0]), json.dumps(good[1]), "", '{"prompt": ""}', json.dumps(good[2]),
                               '{"prompt_ids": [1, 99999]}', "not json", json.dumps(good[3])]) + "\n")
    bad_lines = {4: "the prompt is empty", 6: "token id 99999 is outside the vocabulary", 7: "not JSON"}

    def run(*args):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.jsonl"
        code = main(["--prompts", str(file), "--out", str(out), "--max-new-tokens", "24", *args])
        err = capsys.readouterr().err
        assert code == 1, err  # some lines failed
        for n, message in bad_lines.items():
            assert f"error: {file}:{n}: {message}" in err
        assert err.strip().splitlines()[-1].startswith(f"[{args[1]}")  # the summary line
        assert "4 prompts (3 failed)" in err
        return [json.loads(line) for line in out.read_text().splitlines()]

    ar = run("--mode", "ar", "--batch-size", "1")
    assert [r["line"] for r in ar] == [1, 2, 4, 5, 6, 7, 8] and [r["index"] for r in ar] == list(range(7))
    assert [r["id"] for r in ar] == ["first", None, None, None, None, None, None]
    assert [r["line"] for r in ar if "error" in r] == sorted(bad_lines)
    ok = [r for r in ar if "error" not in r]
    assert len({tuple(r["output_ids"]) for r in ok}) == 4 and all(len(r["output_ids"]) > 0 for r in ok)
    # 4 prompts: a batch of 3 rows, then one of a single row
    tree = run("--mode", "ddtree", "--budget", "63", "--batch-size", "3")
    assert [r.get("error") for r in tree] == [r.get("error") for r in ar]
    for a, t in zip(ok, [r for r in tree if "error" not in r]):
        assert t["output_ids"] == a["output_ids"] and t["text"] == a["text"], a["index"]
        assert t["mode"] == "ddtree" and t["budget"] == 63 and t["id"] == a["id"]
    assert max(r["tau"] for r in tree if "error" not in r) > 1.5  # the drafter did the work


def test_prompts_file_errors(tmp_path, capsys):
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": ""}\n')
    assert main(["--prompts", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"error: {file}:1: the prompt is empty" in err and f"error: {file}: none of its 1 prompts can run" in err
    assert main(["--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: cannot be read (No such file or directory)" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--out: needs --prompts" in capsys.readouterr().err
    assert main(["--prompts", str(file), "--out", str(tmp_path)]) == 2
    assert "--out " in capsys.readouterr().err


def test_doctor_takes_the_chat_options(capsys):
    from ddtree_jax.doctor import main as doctor

    assert doctor(["--no-thinking"]) == 2
    assert "--thinking/--no-thinking: needs --chat" in capsys.readouterr().err
    assert doctor(["--chat", "--no-thinking"]) == 2  # the demo tokenizer has no chat template
    assert "has no chat template" in capsys.readouterr().err


def test_prompt_file_lines(chat_target, tmp_path):
    """Each kind of line, read as `generate --prompts` and the doctor read it."""
    from ddtree_jax.cli import ChatOptions, read_prompt_file

    folder, tok = chat_target
    messages = [{"role": "user", "content": "hi"}]
    file = tmp_path / "p.jsonl"
    file.write_text("\n".join(json.dumps(x) for x in [
        {"messages": messages, "id": 3}, {"prompt": "hi"}, {"prompt_ids": [5, 6]}, {"prompt": "a", "prompt_ids": [1]},
        {"messages": "hi"}, {"prompt_ids": [True]}]))
    chat = ChatOptions(chat=True, system="S", template_kwargs={"enable_thinking": False})
    lines = read_prompt_file(file, tok, folder, chat, vocab_size=320)
    with_system = tok.apply_chat_template([{"role": "system", "content": "S"}, *messages], add_generation_prompt=True,
                                          tokenize=True, enable_thinking=False)["input_ids"]
    assert [(line.index, line.line, line.id) for line in lines][:2] == [(0, 1, 3), (1, 2, None)]
    assert lines[0].ids == lines[1].ids == with_system  # a chat prompt and its messages form agree
    assert lines[2].ids == [5, 6]
    assert [line.error.split(": ", 1)[1] for line in lines[3:]] == [
        "expected a JSON object with one of 'prompt', 'messages' or 'prompt_ids'",
        "'messages' must be a list of {\"role\": ..., \"content\": ...} objects",
        "'prompt_ids' must be a list of integers"]
    plain = read_prompt_file(file, tok, folder, ChatOptions(), vocab_size=320)
    assert plain[1].ids == tok("hi", add_special_tokens=False)["input_ids"]  # no --chat: the text as it is
    assert plain[0].ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
