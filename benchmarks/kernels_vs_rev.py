"""Our native decoder against the one of another git revision, paired in one process: that revision's
layer, w4a8-wide and attention kernels are built beside today's under renamed op libraries (`*_rev`), one
loaded model gets a native decoder on each, and their forwards alternate in rounds at the same context,
so the host's drifting speed falls on both alike. What differs is the blocks only: the embedding, the
final norm and the head run today's code in both. Prints each T's median step for both and the median of
the rounds' ratios (today / the revision). Needs an AVX-512 CPU (the wide kernels) and a revision whose
Decoder takes today's `add_layer` arguments.

    python benchmarks/kernels_vs_rev.py --rev HEAD --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --t 1,8
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from specstack.engine.timing import forward_steps, random_context
from specstack.models import native
from specstack.models import native_decoder as nd
from specstack.models.loading import load_model

KERNELS = ("w4a8_wide", "attention", "layer")  # the libraries a native decoder calls (layer last: it finds the others' ops)
ROOT = Path(__file__).resolve().parents[1]


def build_rev(rev: str, out: Path) -> None:
    """That revision's kernel sources, their op libraries renamed to `<name>_rev`, built and loaded."""
    src = "specstack/models/kernels"
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{src}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{src}/{name}"], check=True,
                              capture_output=True, text=True).stdout
        for k in KERNELS:  # the libraries' names, and the op names the layer library looks up
            text = re.sub(rf"\bspecstack_{k}\b", f"specstack_{k}_rev", text)
        (out / name).write_text(text)
    for k in KERNELS:
        build = out / k
        build.mkdir()
        cpp_extension.load(name=f"specstack_{k}_rev", sources=[str(out / f"{k}.cpp")], extra_cflags=list(native.CFLAGS),
                           extra_ldflags=list(native.LDFLAGS), build_directory=str(build), is_python_module=False)


def rev_decoder(model) -> nd.NativeDecoder:
    """A NativeDecoder of `model` on the revision's Decoder class and its ops."""
    return nd.NativeDecoder(model, torch.classes.specstack_layer_rev.Decoder(),
                            lambda op: op.replace("specstack_w4a8_wide::", "specstack_w4a8_wide_rev::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--t", default="1,8", help="tokens a forward, comma-separated")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for k in KERNELS:
        if not native.load(k):
            raise SystemExit(f"specstack: error: the {k} kernel does not build here")
    with tempfile.TemporaryDirectory() as tmp:
        build_rev(args.rev, Path(tmp))
        for name in args.models.split(","):
            lm = load_model(name, dtype="w4a8")
            model = lm.model
            for t in (int(v) for v in args.t.split(",")):
                step = forward_steps(lm, random_context(args.context, model.config.vocab_size), t)["specstack w4a8 chain"]
                tok = torch.full((1, t), 5)
                step(tok)
                decoders = {"today": model._native, args.rev: rev_decoder(model)}
                times: dict[str, list[float]] = {k: [] for k in decoders}
                for r in range(args.rounds + 1):  # round 0 warms both
                    for key, dec in decoders.items():
                        model._native = dec
                        ts = []
                        for _ in range(15):
                            t0 = time.perf_counter()
                            step(tok)
                            ts.append(time.perf_counter() - t0)
                        if r:
                            times[key].append(1e3 * statistics.median(ts))
                model._drop_native()
                ratios = [a / b for a, b in zip(times["today"], times[args.rev], strict=True)]
                print(f"{name} T={t}: {args.rev} {statistics.median(times[args.rev]):.2f} ms, today "
                      f"{statistics.median(times['today']):.2f} ms; today / {args.rev} per round: median "
                      f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
