"""Bad option values: integers and floats out of bounds or oddly spelled, odd strings, and the small
languages of the options (method strings and lists, integer lists, throughput shapes, --tau, --data)
with one thing wrong."""
from __future__ import annotations

import random
from collections.abc import Sequence

from fuzz.case import Builder
from fuzz.damage import random_bytes

# integers argparse takes (out of bounds, or odd spellings of small ones) and text it rejects
BAD_INTS = ("0", "-1", str(2**70), str(-2**70), "99999999999", str(2**63), "-0", " 3", "1_0", "\u0663")
NOT_INTS = ("1e400", "nan", "", "x", "1.5", "inf", "0x10")
BAD_FLOATS = ("0", "-1", "1e400", "nan", "inf", "-inf", "", "x", "1e-300", "5e-324", str(2**70), "-0", "1e308",
              "0x1p3", "1_0")
HUGE = ("65", "100", "10000", "100000", str(2**31), str(2**63), str(2**70))
METHOD_VALUES = ("0", "-1", "", "x", "nan", "1.5", " 2", "1e3", *HUGE)
ODD_STRINGS = ("", " ", ":", ",", ";", "=", "/", "::", ",,", "\udcff", "\u00e9", "a" * 300, "-", "--", "\t\n")


def _engine_params() -> dict[str, list[str]]:
    from specstack.engine.methods import METHODS

    return {name: [p.name for p in m.params] for name, m in METHODS.items()}


def method_text(rng: random.Random, peers: bool = False) -> str:
    """A method string with odd names, values, separators and duplicates."""
    params = _engine_params()
    names = [*params, "medusa", "CHAIN", "", " chain", "tree "] + (["hf", "hf-pld", "llamacpp", "hf-assisted"] if peers else [])
    name = rng.choice(names)
    keys = params.get(name.strip(), []) or ["k"]
    items = []
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        key = rng.choice([*keys, *keys, "kk", "", "dtype" if peers else "K", "tokens"])
        value = rng.choice([*METHOD_VALUES, "1", "2", "3"]) if key != "dtype" else rng.choice(("fp16", "", "int4"))
        form = rng.choice(("{k}={v}", "{k}={v}", "{k}={v}", "{k}", "{k}=={v}", "={v}", "{k}={v}={v}", "{k}:{v}"))
        items.append(form.format(k=key, v=value))
    sep = rng.choice((",", ",", ",,", ", ", ":"))
    text = name + (":" + sep.join(items) if items or rng.random() < 0.2 else "")
    return rng.choice(("{}", "{}", "{}", "{}", "{}:", ":{}", "{},", "{}::k=2")).format(text)


def method_list(rng: random.Random) -> str:
    parts = [method_text(rng, peers=True) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        parts.append(parts[0])  # listed twice
    return rng.choice((";", ";", "; ", ";;", ",")).join(parts)


def int_list_text(rng: random.Random, valid: Sequence[int]) -> str:
    items = [str(v) for v in rng.sample(list(valid), rng.randint(1, len(valid)))]
    items.insert(rng.randrange(len(items) + 1), rng.choice(BAD_INTS + HUGE + NOT_INTS))
    return rng.choice((",", ",", ", ", ",,", ";")).join(items)


def shape_text(rng: random.Random) -> str:
    """A throughput model description with one bad value (or a missing or unknown key)."""
    keys = {"layers": "8", "d_model": "512", "kv_heads": "8", "head_dim": "64", "d_ff": "2048", "heads": "8",
            "vocab": "32000"}
    key = rng.choice(sorted(keys))
    kind = rng.choice(("value", "value", "drop", "unknown", "dup"))
    if kind == "value":
        keys[key] = rng.choice(BAD_INTS + HUGE + NOT_INTS)
    elif kind == "drop":
        del keys[key]
    elif kind == "unknown":
        keys["wings"] = "2"
    text = ",".join(f"{k}={v}" for k, v in keys.items())
    return text + (f",{key}=3" if kind == "dup" else "")


def tau_text(rng: random.Random) -> str:
    value = lambda: rng.choice((*BAD_FLOATS, "1", "2.5", "5", "auto"))  # noqa: E731
    return rng.choice((value(), f"vanilla={value()},spire={value()}", f"spire={value()},spire=2", f"={value()}",
                       f"magicdec:{value()}", f"auto,{rng.choice(('spire', 'x', ''))}={value()}", "auto,auto",
                       f"vanilla={value()};magicdec=2"))


def data_spec(b: Builder) -> str:
    """A train-draft --data value with odd sources, folders and weights."""
    w = lambda: b.pick((*BAD_FLOATS, "1", "0.5"))  # noqa: E731
    corpus = str(b.fx.corpus)
    return b.pick((
        lambda: f"code={corpus}:{w()}", lambda: f"code={corpus}:1,code={corpus}:1", lambda: f"code={b.path('nope')}:1",
        lambda: "code=/dev/null:1", lambda: f"sharegpt={b.fx.prompts}:1", lambda: f"code={corpus}",
        lambda: f"code={corpus}:1:2", lambda: f"code={corpus}:1,", lambda: b.pick((":", "", ",", "code=:1")),
        lambda: f"sharegpt={b.put(b.name('sg'), data=random_bytes(b.rng))}:1",
        lambda: f"code={b.put(b.name('c'), folder=True)}:1"))()


def odd_choice(b: Builder, flag: str) -> None:
    b.opt(flag, b.pick(("fp16", "FP32", "", "int3", "cuda:0", "tpu", "x")))
    b.note(f"{flag} odd")


def bad_int(b: Builder, flags: Sequence[str]) -> None:
    """One of `flags` set to a bad integer: mostly one argparse takes, so that the command's own checks
    are reached."""
    flag = b.pick(flags)
    value = b.pick(NOT_INTS if b.rng.random() < 0.25 else BAD_INTS + HUGE)
    b.opt(flag, value)
    b.note(f"{flag} {value!r}")


def bad_float(b: Builder, flags: Sequence[str]) -> None:
    flag = b.pick(flags)
    value = b.pick(BAD_FLOATS)
    b.opt(flag, value)
    b.note(f"{flag} {value!r}")
