"""`specstack generate` with structured output, penalties, a bias and log-probabilities: the output of a
--json-schema run is valid for the schema whichever method runs (and the same for all), --regex output
matches, --logprobs rows carry each token's, and bad values are one error line, exit 2, before any model
loads where they can be (a schema file that is not a JSON object, a bias that is not ID=BIAS)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9}},
          "required": ["colour", "n"], "additionalProperties": False}


def test_json_schema_output_is_valid_and_the_same_for_every_method(run_cli, tiny_model, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    rows = {}
    for method in ("ar", "chain:k=3", "tree:width=2,budget=6,depth=3"):
        r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "30", "--dtype", "fp32",
                    "--json-schema", str(schema), "--method", method, "--draft", "self:1", "--jsonl", "--logprobs", "2")
        assert r.code == 0, r.err
        rows[method] = json.loads(r.out)
    ar = rows["ar"]
    jsonschema.validate(json.loads(ar["text"]), SCHEMA)
    assert ar["finish_reason"] == "eos"  # the grammar ended it
    assert len(ar["logprobs"]) == ar["new_tokens"] and all(len(lp["top"]) == 2 for lp in ar["logprobs"])
    for method, row in rows.items():
        assert row["text"] == ar["text"], method
        assert [lp["id"] for lp in row["logprobs"]] == [lp["id"] for lp in ar["logprobs"]], method


def test_regex_and_penalties(run_cli, tiny_model):
    r = run_cli("generate", "--model", tiny_model, "--prompt", "hello", "--max-new-tokens", "12", "--dtype", "fp32",
                "--regex", "[a-c]{3}-[0-9]{2}", "--frequency-penalty", "1.5", "--logit-bias", "64=2")
    assert r.code == 0, r.err
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.out.strip()), r.out


@pytest.mark.parametrize(("argv", "message"), [
    (["--json-schema", "{dir}/nope.json"], "--json-schema file not found"),
    (["--json-schema", "{dir}/list.json"], "a JSON schema is an object"),
    (["--regex", ""], "--regex is empty"),
    (["--logit-bias", "5"], "--logit-bias is ID=BIAS"),
    (["--logit-bias", "5=101"], "--logit-bias"),
    (["--presence-penalty", "3"], "--presence-penalty"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--logprobs", "21"], "--logprobs"),
])
def test_bad_values_are_one_error_line_before_loading(run_cli, no_model, tmp_path, argv, message):
    (tmp_path / "list.json").write_text("[1]", encoding="utf-8")
    r = run_cli("generate", "--prompt", "x", *[a.format(dir=tmp_path) for a in argv])
    assert r.code == 2 and message in r.err and "Traceback" not in r.err, r.err


def test_a_grammar_that_does_not_compile_is_a_clear_error(run_cli, tiny_model):
    r = run_cli("generate", "--model", tiny_model, "--prompt", "x", "--dtype", "fp32", "--regex", "a(b")
    assert r.code == 2 and r.err.startswith("specstack: error: invalid regex grammar") and "Traceback" not in r.err
