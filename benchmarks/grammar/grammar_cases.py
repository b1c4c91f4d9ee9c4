"""The grammars of benchmarks/grammar/engines.py and a valid document for each: six JSON schemas (nested
objects, enums, arrays, patterned strings, numbers, booleans) whose documents grow to a token count, an
any-JSON-object grammar, an ISO-date regex, and a Lark grammar embedding ``%json{...}``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SEP = (", ", ": ")  # json.dumps' default separators; both engines are told to emit exactly these


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string", "pattern": r"^[a-z0-9._]+@[a-z0-9]+\.[a-z]{2,4}$"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": _obj({"street": {"type": "string"}, "city": {"type": "string"},
                         "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}}),
        "tags": {"type": "array", "items": {"type": "string"}},
    }),
    "order": _obj({
        "order_id": {"type": "string", "pattern": r"^ORD-[0-9]{8}$"},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "items": {"type": "array", "minItems": 1, "items": _obj({
            "sku": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{4}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 1000},
            "price": {"type": "number"},
            "gift": {"type": "boolean"},
        })},
    }),
    "tool_call": _obj({
        "name": {"enum": ["search_code", "read_file", "run_tests"]},
        "arguments": _obj({
            "query": {"type": "string"},
            "paths": {"type": "array", "items": {"type": "string"}},
            "max_results": {"type": "integer", "minimum": 1},
            "case_sensitive": {"type": "boolean"},
        }),
    }),
    "event": _obj({
        "title": {"type": "string"},
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "start": {"type": "string", "pattern": r"^[0-2][0-9]:[0-5][0-9]$"},
        "location": {"type": ["string", "null"]},
        "attendees": {"type": "array", "items": _obj({
            "name": {"type": "string"},
            "status": {"enum": ["accepted", "declined", "tentative"]},
        })},
    }),
    "matrix": _obj({
        "label": {"enum": ["weights", "bias", "scale"]},
        "rows": {"type": "integer"},
        "cols": {"type": "integer"},
        "data": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    }),
    "config": _obj({
        "version": {"enum": ["1.0", "1.1", "2.0"]},
        "server": _obj({
            "host": {"type": "string"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "tls": _obj({"enabled": {"type": "boolean"}, "cert": {"type": "string"}}),
        }),
        "limits": _obj({"rps": {"type": "number"}, "burst": {"type": "integer"}}),
        "features": {"type": "array", "items": {"enum": ["cache", "metrics", "tracing", "auth"]}},
    }),
}


def _doc(name: str, n: int) -> dict[str, Any]:
    """A valid instance of SCHEMAS[name] whose arrays hold `n`-ish items (the knob for its length)."""
    if name == "person":
        return {"id": 4217, "name": "Ada Lovelace", "email": "ada.l@example.org", "active": True, "role": "editor",
                "address": {"street": "12 St James's Square", "city": "London", "zip": "02139"},
                "tags": [f"tag{i}" for i in range(n)]}
    if name == "order":
        return {"order_id": "ORD-20240517", "currency": "EUR",
                "items": [{"sku": f"ABC-{1000 + i}", "qty": i + 1, "price": 9.99 + i, "gift": i % 2 == 0}
                          for i in range(max(n, 1))]}
    if name == "tool_call":
        return {"name": "search_code", "arguments": {"query": "def apply_token_bitmask",
                                                     "paths": [f"src/pkg{i}/module.py" for i in range(n)],
                                                     "max_results": 20, "case_sensitive": False}}
    if name == "event":
        return {"title": "Design review", "date": "2024-05-17", "start": "14:30", "location": None,
                "attendees": [{"name": f"person {i}", "status": ["accepted", "declined", "tentative"][i % 3]}
                              for i in range(n)]}
    if name == "matrix":
        rows = max(n, 1)
        return {"label": "weights", "rows": rows, "cols": 4,
                "data": [[0.25 * (r % 3), -1.5 + r, 3.0, r * 0.125] for r in range(rows)]}
    if name == "config":
        feats = ["cache", "metrics", "tracing", "auth"]
        return {"version": "1.1", "server": {"host": "localhost", "port": 8080,
                                             "tls": {"enabled": True, "cert": "/etc/ssl/server.pem"}},
                "limits": {"rps": 250.5, "burst": 40}, "features": [feats[i % 4] for i in range(n)]}
    raise KeyError(name)


@dataclass
class Case:
    name: str
    kind: str  # "json_schema" | "regex" | "lark"
    source: Any  # schema dict, regex string, or lark text
    text: str  # a valid document


LARK_PREFIX = "Result: "


def build_cases(tok: Any, n_schemas: int, target_tokens: int) -> list[Case]:
    def sized(name: str) -> str:
        text = ""
        for n in range(0, 65):
            text = json.dumps(_doc(name, n), separators=SEP)
            if len(tok.encode(text, add_special_tokens=False)) >= target_tokens:
                break
        return text

    names = list(SCHEMAS)[:n_schemas]
    cases = [Case(n, "json_schema", SCHEMAS[n], sized(n)) for n in names]
    person = sized("person")
    cases.append(Case("json_object", "json_schema", {"type": "object"}, person))
    # \d is Unicode-aware in llguidance (Rust regex: full-width and other digits pass) and ASCII in
    # xgrammar; kept as written to show it, [0-9] is what a grammar should say.
    cases.append(Case("regex_date", "regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"))
    # %json{...} takes a JSON schema inline; "x-guidance" carries the compile options a JSON grammar
    # gets from overrides= elsewhere (the lark text has nowhere else to put them).
    embedded = dict(SCHEMAS["person"], **{"x-guidance": {"whitespace_flexible": False,
                                                          "item_separator": SEP[0], "key_separator": SEP[1]}})
    lark = f'start: "{LARK_PREFIX}" obj "\\n"\nobj: %json{json.dumps(embedded)}\n'
    cases.append(Case("lark_json", "lark", lark, LARK_PREFIX + person + "\n"))
    return cases
