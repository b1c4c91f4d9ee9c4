"""Fill-in-the-middle prompts (fim.py) on hand-made prefixes, suffixes and extra files: the token ids laid out
as the template says, special-token text in code read as text, fitting a budget, and a model without FIM
tokens refused by name."""
from __future__ import annotations

import pytest
from tiny_checkpoints import fim_tokenizer

from specstack.errors import SpecstackError
from specstack.fim import FIM_TEMPLATES, ExtraFile, detect, encode_fim, template
from specstack.models.registry import fim_template


@pytest.fixture(scope="module")
def tok():
    return fim_tokenizer()


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def special(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


def test_plain_fim_layout(tok):
    t = template(tok, None, "tiny")
    assert t == FIM_TEMPLATES["qwen"]
    p = encode_fim(tok, t, "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")
    assert p.ids == [special(tok, "<|fim_prefix|>"), *ids(tok, "def add(a, b):\n    "),
                     special(tok, "<|fim_suffix|>"), *ids(tok, "\n\nprint(add(1, 2))\n"),
                     special(tok, "<|fim_middle|>")]
    assert not p.truncated


def test_repository_layout_with_extra_files_and_the_typed_line(tok):
    t = template(tok, "qwen", "tiny")
    extra = [ExtraFile("util.py", "def helper():\n    return 1\n"), ExtraFile("b.py", "X = 2\n")]
    p = encode_fim(tok, t, "import util\n", "\n", extra, prompt="y = util.")
    sep, repo = special(tok, "<|file_sep|>"), special(tok, "<|repo_name|>")
    assert p.ids == [repo, *ids(tok, "myproject\n"),
                     sep, *ids(tok, "util.py\n"), *ids(tok, "def helper():\n    return 1\n"),
                     sep, *ids(tok, "b.py\n"), *ids(tok, "X = 2\n"),
                     sep, *ids(tok, "filename\n"),
                     special(tok, "<|fim_prefix|>"), *ids(tok, "import util\n"), *ids(tok, "y = util."),
                     special(tok, "<|fim_suffix|>"), *ids(tok, "\n"), special(tok, "<|fim_middle|>")]


def test_special_token_text_in_code_is_text(tok):
    t = template(tok, None, "tiny")
    p = encode_fim(tok, t, "s = '<|fim_middle|><|endoftext|>'\n", "")
    assert p.ids.count(special(tok, "<|fim_middle|>")) == 1  # only the template's own, at the end
    assert p.ids[-1] == special(tok, "<|fim_middle|>")
    assert tok.eos_token_id not in p.ids[:-1]


def test_budget_drops_extra_files_then_the_far_ends(tok):
    t = template(tok, None, "tiny")
    prefix = "".join(f"line_{i} = {i}\n" for i in range(60))
    suffix = "".join(f"after_{i} = {i}\n" for i in range(60))
    extra = [ExtraFile("big.py", "z = 0\n" * 200)]
    whole = encode_fim(tok, t, prefix, suffix, extra)
    fits = encode_fim(tok, t, prefix, suffix, extra, budget=len(whole.ids))
    assert fits == whole
    # a budget that holds the code but not all the extra file: the file's start goes, the code stays
    code = encode_fim(tok, t, prefix, suffix)
    p = encode_fim(tok, t, prefix, suffix, extra, budget=len(code.ids) + 10)
    assert p.truncated and len(p.ids) == len(code.ids) + 10
    assert p.ids[-len(code.ids):] == code.ids
    # a budget smaller than the code: the prefix keeps its end (nearest the cursor), the suffix its start
    p = encode_fim(tok, t, prefix, suffix, budget=120)
    assert p.truncated and len(p.ids) == 120
    text = tok.decode(p.ids)
    assert "line_59 = 59\n<|fim_suffix|>after_0 = 0\n" in text
    assert "line_0 = 0" not in text and "after_59" not in text
    before = p.ids.index(special(tok, "<|fim_suffix|>")) - 1
    assert before >= 3 * (len(p.ids) - 3) // 4 - 1  # three parts prefix to one part suffix


def test_a_model_without_fim_tokens_is_refused_by_name():
    from specstack.models.loading import load_tokenizer
    from specstack.models.registry import DEFAULT_MODEL, resolve

    plain = load_tokenizer(resolve(DEFAULT_MODEL), None)
    assert detect(plain) is None  # it has <file_sep> and <reponame>, not the FIM three
    with pytest.raises(SpecstackError, match="no fill-in-the-middle tokens"):
        fim_template(DEFAULT_MODEL, plain)
    with pytest.raises(SpecstackError, match="'my-model' has no fill-in-the-middle tokens"):
        template(plain, None, "my-model")


def test_registered_qwen_names_its_template_and_end_tokens(tok):
    assert fim_template("qwen2.5-coder-1.5b", tok) == FIM_TEMPLATES["qwen"]  # the registry's row, checked on tok
    ends = FIM_TEMPLATES["qwen"].end_ids(tok)
    assert special(tok, "<|file_sep|>") in ends and special(tok, "<|fim_pad|>") in ends
    assert special(tok, "<|fim_prefix|>") not in ends
