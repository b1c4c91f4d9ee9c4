"""One case generator per command: a valid baseline on the tiny fixtures, then one or two malformations
drawn from the command's menu; `make_case` draws case `index` of a seed (the commands take turns)."""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

from fuzz.case import Builder, Case
from fuzz.damage import damage_bytes, damaged_copy, damaged_json_file, input_file, output_path, random_bytes
from fuzz.damaged_inputs import draft_spec, model_spec, prompts_file, run_folder, sequences_file, trigram_file
from fuzz.fixtures import Fixtures
from fuzz.values import (
    ODD_STRINGS,
    bad_float,
    bad_int,
    data_spec,
    int_list_text,
    method_list,
    method_text,
    odd_choice,
    shape_text,
    tau_text,
)

COMMANDS = ("generate", "bench", "bench-forward", "bench-ties", "ngram train", "throughput",
            "throughput-calibrate", "throughput-check", "train-draft", "draft-acceptance")


Menu = Sequence[tuple[int, Callable[[Builder], None]]]


def apply(b: Builder, menu: Menu) -> None:
    """Zero (rarely: the valid baseline), one or two different malformations drawn from `menu`."""
    left = list(menu)
    for _ in range(b.rng.choices((0, 1, 2), weights=(1, 14, 5))[0]):
        entry = b.rng.choices(left, weights=[w for w, _ in left])[0]
        left.remove(entry)
        entry[1](b)
    if not b.notes:
        b.note("valid baseline")


def _method(b: Builder) -> None:
    text = method_text(b.rng)
    b.opt("--method", text)
    b.note(f"--method {text!r}")
    if b.rng.random() < 0.7:
        b.opt("--ngram", str(b.fx.trigram))
    if b.rng.random() < 0.5:
        b.opt("--draft", b.pick(("self:1", str(b.fx.draft), "magicdec:8")))


def _prompt_file(b: Builder) -> None:
    b.drop("--prompt")
    b.opt("--prompt-file", input_file(b, b.fx.corpus / "m1.py", damaged_copy, ".txt"))


def _prompt_text(b: Builder) -> None:
    text = b.pick(("", " \n", "\udcff\udcfe", "x" * 5000, "\x1b[31m", "<|im_end|>", "\u202e", "hello " * 70))
    b.opt("--prompt", text)
    b.note(f"--prompt {text[:20]!r}")


def _sampling(b: Builder) -> None:
    """Sampling on, with a bad top-p, top-k or seed."""
    b.opt("--temperature", b.pick(("0.7", "1e308", "5e-324")))
    bad_float(b, ["--top-p"]) if b.rng.random() < 0.5 else bad_int(b, ["--top-k", "--seed"])


def gen_generate(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    b.opt("--prompt", "def add(a, b):")
    b.opt("--max-new-tokens", "3")
    b.opt("--dtype", "fp32")
    apply(b, (
        (3, lambda b: bad_int(b, ["--max-new-tokens", "--top-k", "--seed", "--threads"])),
        (2, lambda b: bad_float(b, ["--temperature", "--top-p"])),
        (2, _sampling),
        (5, _method),
        (4, lambda b: b.opt("--model", model_spec(b))),
        (3, lambda b: (b.opt("--method", b.pick(("chain:k=2", "tree:budget=4,depth=2"))), b.opt("--draft", draft_spec(b)))),
        (2, lambda b: (b.opt("--method", b.pick(("ngram", "staged:budget=4,depth=2"))), b.opt("--ngram", trigram_file(b)))),
        (2, _prompt_file),
        (1, _prompt_text),
        (2, lambda b: b.opt("--html", output_path(b, ".html"))),
        (1, lambda b: odd_choice(b, b.pick(("--dtype", "--device", "--draft-dtype")))),
        (1, lambda b: (b.add("--stop", b.pick(ODD_STRINGS)), b.note("--stop odd"))),
        (1, lambda b: (b.opt("--chat"), b.opt("--show-origins"), b.note("--chat --show-origins"))),
    ))


def _bench_read(b: Builder) -> None:
    """--compare, --ratios or --phases on damaged runs."""
    for flag in ("--out", "--prompts", "--methods"):
        b.drop(flag)
    mode = b.pick(("--compare", "--ratios", "--phases"))
    b.note(mode)
    if mode == "--compare":
        other = b.pick((lambda: str(b.fx.run), lambda: b.path("missing"), lambda: run_folder(b)))
        b.opt(mode, (run_folder(b), other()))
    elif mode == "--ratios":
        pairs = b.pick(("chain:k=2/ar", "ar/ar", "x/y", "ar", "/", "ar/", "chain:k=2/ar/ngram", "ngram/chain:k=2",
                        "ar/hf"))
        b.opt(mode, (run_folder(b), pairs))
        b.note(f"pairs {pairs!r}")
    else:
        b.opt(mode, run_folder(b))


def _bench_resume(b: Builder) -> None:
    """--resume on a damaged copy of the fixture run, with its settings."""
    b.note("--resume")
    b.opt("--out", b.output(run_folder(b)))
    b.opt("--resume")
    b.opt("--methods", "ar;chain:k=2;ngram")
    b.opt("--ngram", str(b.fx.trigram))
    b.opt("--max-new-tokens", "4")
    b.opt("--draft-dtype", "fp32")


def gen_bench(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    b.opt("--prompts", str(b.fx.prompts))
    b.opt("--methods", "ar;chain:k=2")
    b.opt("--dtype", "fp32")
    b.opt("--draft", "self:1")
    b.opt("--max-new-tokens", "3")
    b.opt("--limit", "1")
    b.opt("--out", b.output(b.path("bench")))
    apply(b, (
        (3, lambda b: bad_int(b, ["--limit", "--repeats", "--max-new-tokens", "--top-k", "--seed", "--threads"])),
        (1, lambda b: bad_float(b, ["--temperature", "--top-p"])),
        (4, lambda b: (b.opt("--methods", method_list(b.rng)), b.opt("--ngram", str(b.fx.trigram)),
                       b.note(f"--methods {b.get('--methods')!r}"))),
        (2, lambda b: b.opt("--model", model_spec(b))),
        (3, lambda b: b.opt("--prompts", prompts_file(b))),
        (2, lambda b: b.opt("--out", output_path(b, "", folder=True))),
        (4, _bench_read),
        (3, _bench_resume),
        (1, lambda b: b.opt("--draft", draft_spec(b))),
        (1, lambda b: (b.opt("--methods", "ar;ngram"), b.opt("--ngram", trigram_file(b)))),
    ))


def gen_bench_forward(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    for flag, value in (("--formats", "fp32"), ("--tokens", "1,2"), ("--context", "8"), ("--repeats", "1"),
                        ("--warmup", "0"), ("--prompts", "0"), ("--new-tokens", "2"), ("--threads", "1")):
        b.opt(flag, value)
    b.opt("--skip-hf")
    b.opt("--out", b.output(b.path("forward.json")))
    b.output(b.path("bench_out"))  # the default --out, under the working folder
    apply(b, (
        (5, lambda b: bad_int(b, ["--context", "--repeats", "--warmup", "--prompts", "--new-tokens", "--threads"])),
        (2, lambda b: (b.opt("--tokens", int_list_text(b.rng, (1, 2, 4))), b.note(f"--tokens {b.get('--tokens')!r}"))),
        (1, lambda b: (b.opt("--formats", b.pick(("fp16", "int4,,", "", ",", "fp32,fp32,bf16"))), b.note("--formats"))),
        (1, lambda b: (b.drop("--skip-hf"), b.opt("--hf-dtypes", b.pick(("fp16", "", ",", "bf16,bf16", "int4"))),
                       b.note("--hf-dtypes"))),
        (3, lambda b: b.opt("--model", model_spec(b))),
        (2, lambda b: b.opt("--out", output_path(b, ".json"))),
        (1, lambda b: (b.drop("--out"), b.note("default --out"))),
    ))


def gen_bench_ties(b: Builder) -> None:
    b.positionals.append(str(b.fx.run))
    b.opt("--threads", "1")
    b.codes = {0, 1, 2}  # 1: a divergence that is no near-tie (documented)

    def dir_kind(b: Builder) -> None:
        kind = b.pick(("missing", "file", "empty", "proc"))
        b.positional(0, {"missing": lambda: b.path("nope"), "file": lambda: b.put("f", data=b"x"),
                            "empty": lambda: b.put("e", folder=True), "proc": lambda: "/proc/self"}[kind]())
        b.note(f"DIR -> {kind}")

    apply(b, (
        (8, lambda b: b.positional(0, run_folder(b))),
        (2, dir_kind),
        (1, lambda b: bad_int(b, ["--threads"])),
    ))


def gen_ngram_train(b: Builder) -> None:
    b.opt("--model", str(b.fx.model))
    b.opt("--corpus", str(b.fx.corpus))
    b.opt("--out", b.output(b.path("tri.npz")))
    b.opt("--max-files", "3")

    def corpus(b: Builder) -> None:
        kind = b.pick(("bytes", "bytes", "empty", "missing", "dev-null", "file-bytes"))
        if kind == "bytes":
            rel = b.name("corpus")
            for i in range(3):
                b.put(f"{rel}/x{i}.py", data=damage_bytes(b.rng, (b.fx.corpus / "m1.py").read_bytes())[0])
            b.opt("--corpus", b.path(rel))
        elif kind == "empty":
            b.opt("--corpus", b.put(b.name("corpus"), folder=True))
        elif kind == "missing":
            b.opt("--corpus", b.path("none"))
        elif kind == "dev-null":
            b.opt("--corpus", "/dev/null")
        else:
            b.opt("--corpus", b.put(b.name("c") + ".py", data=random_bytes(b.rng)))
        b.note(f"corpus -> {kind}")

    apply(b, (
        (4, lambda b: bad_int(b, ["--k", "--min-count", "--min-count-bigram", "--max-files"])),
        (3, corpus),
        (2, lambda b: b.opt("--model", model_spec(b))),
        (3, lambda b: b.opt("--out", output_path(b, ".npz"))),
        (1, lambda b: (b.add("--ext", b.pick(ODD_STRINGS)), b.add("--exclude-dir", b.pick(ODD_STRINGS)),
                       b.note("--ext/--exclude-dir odd"))),
    ))


def gen_throughput(b: Builder) -> None:
    tiny = b.rng.random() < 0.3
    b.opt("--target", str(b.fx.model) if tiny else "spire-67m")
    if tiny:
        b.opt("--draft", "self:1")
    b.opt("--tau", "2")
    b.opt("--batch", "1,8")
    b.opt("--context", "512")
    b.opt("--plot", b.output(b.path("p.png")))
    b.output(b.path("throughput.png"))  # the default --plot, in the working folder

    def auto(b: Builder) -> None:
        b.opt("--target", str(b.fx.model))
        b.opt("--draft", "self:1")
        b.opt("--tau", "auto")
        b.opt("--k", "2")
        b.opt("--limit", "1")
        b.opt("--max-new-tokens", "3")
        b.opt("--engine-dtype", "fp32")
        b.opt("--prompts", str(b.fx.prompts))
        b.note("--tau auto")
        b.rng.choice((lambda: b.opt("--prompts", prompts_file(b)),
                      lambda: bad_int(b, ["--limit", "--max-new-tokens", "--threads", "--k"]),
                      lambda: b.opt("--target", model_spec(b)), lambda: b.opt("--draft", draft_spec(b))))()

    apply(b, (
        (3, lambda b: bad_int(b, ["--k", "--spire-layers", "--sparse-window"])),
        (2, lambda b: (b.opt(f := b.pick(("--batch", "--context")), int_list_text(b.rng, (1, 8, 512))),
                       b.note(f"{f} {b.get(f)!r}"))),
        (4, lambda b: (b.opt("--tau", tau_text(b.rng)), b.note(f"--tau {b.get('--tau')!r}"))),
        (3, lambda b: (b.opt(f := b.pick(("--target", "--draft")), shape_text(b.rng)), b.note(f"{f} {b.get(f)!r}"))),
        (2, lambda b: b.opt(b.pick(("--target", "--draft")), model_spec(b))),
        (2, lambda b: b.opt("--hardware", input_file(b, b.fx.hardware, damaged_json_file, ".json")
                            if b.rng.random() < 0.8 else b.pick(("", "local", "h100", "H100-FP8")))),
        (3, lambda b: b.opt(b.pick(("--plot", "--json")), output_path(b, b.pick((".png", ".json"))))),
        (1, lambda b: (b.drop("--plot"), b.note("default --plot"))),
        (1, lambda b: (b.opt("--designs", b.pick(("", ",", "spire,spire", "eagle"))), b.note("--designs"))),
        (2, auto),
        (1, lambda b: odd_choice(b, b.pick(("--dtype", "--draft-dtype", "--conventions")))),
    ))


def gen_throughput_calibrate(b: Builder) -> None:
    for flag, value in (("--model", str(b.fx.model)), ("--dtype", "fp32"), ("--draft", "self:1"),
                        ("--draft-dtype", "fp32"), ("--contexts", "8"), ("--tokens", "1,2"), ("--repeats", "1"),
                        ("--warmup", "0"), ("--threads", "1")):
        b.opt(flag, value)
    b.opt("--out", b.output(b.path("cal.json")))
    apply(b, (
        (3, lambda b: bad_int(b, ["--repeats", "--warmup", "--threads"])),
        (3, lambda b: (b.opt(f := b.pick(("--contexts", "--tokens")), int_list_text(b.rng, (1, 8, 16))),
                       b.note(f"{f} {b.get(f)!r}"))),
        (3, lambda b: b.opt("--model", model_spec(b))),
        (2, lambda b: b.opt("--draft", draft_spec(b))),
        (2, lambda b: b.opt("--out", output_path(b, ".json"))),
    ))


def gen_throughput_check(b: Builder) -> None:
    b.positionals.append(str(b.fx.run))
    b.opt("--hardware", "h100-fp8")
    apply(b, (
        (6, lambda b: b.positional(0, run_folder(b))),
        (2, lambda b: b.opt("--hardware", input_file(b, b.fx.hardware, damaged_json_file, ".json"))),
        (2, lambda b: bad_int(b, ["--context"])),
        (1, lambda b: odd_choice(b, "--conventions")),
    ))


def gen_train_draft(b: Builder) -> None:
    b.opt("--target", str(b.fx.model))
    if b.rng.random() < 0.7:
        b.opt("--sequences", str(b.fx.sequences))
    else:
        b.opt("--data", f"code={b.fx.corpus}:1")
    for flag, value in (("--seq-len", "16"), ("--train-sequences", "2"), ("--heldout-sequences", "1"),
                        ("--steps", "1"), ("--vocab", "64"), ("--layers", "1"), ("--batch-size", "1"),
                        ("--eval-every", "1"), ("--device", "cpu"), ("--threads", "1")):
        b.opt(flag, value)
    b.opt("--out", b.output(b.path("train")))

    def sequences(b: Builder) -> None:
        kind = b.pick(("damaged", "damaged", "new", "folder"))
        if kind == "damaged":
            b.opt("--sequences", sequences_file(b))
        elif kind == "new":  # written from --data
            b.opt("--sequences", b.output(b.path("new-seq.safetensors")))
            b.opt("--data", data_spec(b))
            b.note(f"--data {b.get('--data')!r}")
            if b.rng.random() < 0.5:
                b.opt("--prepare-only")
        else:
            b.opt("--sequences", b.put(b.name("s"), folder=True))
            b.note("--sequences a folder")

    def teacher(b: Builder) -> None:
        kind = b.pick(("file", "proc", "empty"))
        value = {"file": lambda: b.put("teacher-file", data=b"x"), "proc": lambda: "/proc/teacher",
                 "empty": lambda: b.output(b.put(b.name("teacher"), folder=True))}[kind]()
        b.opt("--teacher", value)
        b.note(f"--teacher -> {kind}")

    apply(b, (
        (5, lambda b: bad_int(b, ["--steps", "--train-sequences", "--heldout-sequences", "--seq-len", "--layers",
                                     "--vocab", "--window", "--batch-size", "--accumulate", "--draft-steps",
                                     "--eval-every", "--threads"])),
        (3, lambda b: bad_float(b, ["--omega", "--lr"])),
        (2, lambda b: (b.drop("--sequences"), b.opt("--data", data_spec(b)), b.note(f"--data {b.get('--data')!r}"))),
        (3, sequences),
        (2, lambda b: (b.opt("--contexts", int_list_text(b.rng, (8, 16))), b.note(f"--contexts {b.get('--contexts')!r}"))),
        (2, lambda b: b.opt("--target", model_spec(b))),
        (2, lambda b: b.opt("--out", output_path(b, "", folder=True))),
        (1, teacher),
        (1, lambda b: (b.opt("--resume"), b.note("--resume without a checkpoint"))),
        (1, lambda b: (b.opt("--recipe", "vanilla"), b.opt(b.pick(("--feature-input", "--no-target-acts",
                                                                   "--pruned-init"))), b.note("recipe flags"))),
    ))


def gen_draft_acceptance(b: Builder) -> None:
    b.positionals += [str(b.fx.draft), "magicdec:4"]
    for flag, value in (("--target", str(b.fx.model)), ("--sequences", str(b.fx.sequences)),
                        ("--heldout-sequences", "1"), ("--k", "2"), ("--contexts", "8,16"), ("--device", "cpu")):
        b.opt(flag, value)

    def design(b: Builder) -> None:
        b.positional(b.rng.randrange(len(b.positionals)), draft_spec(b))

    apply(b, (
        (2, lambda b: bad_int(b, ["--k", "--heldout-sequences"])),
        (2, lambda b: (b.opt("--contexts", int_list_text(b.rng, (8, 16))), b.note(f"--contexts {b.get('--contexts')!r}"))),
        (4, design),
        (3, lambda b: b.opt("--sequences", sequences_file(b))),
        (2, lambda b: b.opt("--target", model_spec(b))),
        (2, lambda b: b.opt("--json", output_path(b, ".json"))),
    ))


GENERATORS: dict[str, Callable[[Builder], None]] = {
    "generate": gen_generate, "bench": gen_bench, "bench-forward": gen_bench_forward, "bench-ties": gen_bench_ties,
    "ngram train": gen_ngram_train, "throughput": gen_throughput, "throughput-calibrate": gen_throughput_calibrate,
    "throughput-check": gen_throughput_check, "train-draft": gen_train_draft, "draft-acceptance": gen_draft_acceptance,
}


def make_case(seed: int, index: int, fx: Fixtures, ws: Path) -> Case:
    """Case `index` of the run with `seed`: the commands take turns, everything else is drawn."""
    rng = random.Random(f"{seed}:{index}")
    command = COMMANDS[(index + seed) % len(COMMANDS)]
    b = Builder(rng, fx, ws, command)
    GENERATORS[command](b)
    return Case(seed, index, str(ws), command, b.argv(), tuple(b.puts), tuple(b.outputs), "; ".join(b.notes),
                frozenset(b.codes))
