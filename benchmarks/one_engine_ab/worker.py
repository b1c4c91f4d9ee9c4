"""A/B worker for benchmarks/one_engine_ab/driver.py: loads the default model (int4) once, then answers
lines on stdin, printing 'seconds tokens' for each:
    one METHOD I        prompt I decoded alone, greedy, 64 tokens
    batch METHOD B      the first B prompts decoded as one batch of B rows, greedy, 64 tokens each
The same script runs the old code and the new (PYTHONPATH names the source tree): it calls whichever API
that tree has."""
import sys
import time

import torch


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    from specstack.bench.datasets import humaneval_prompts
    from specstack.config import GenerationConfig, SamplingParams
    from specstack.engine.batched import generate_batch
    from specstack.engine.methods import DraftSources, drafter_factory, length_rule, parse_method
    from specstack.models.loading import load_model
    from specstack.prompts import encode_prompt

    try:  # one engine: generate(lm, ids, gen, drafter=, length=)
        from specstack.engine.batched import generate

        def run_one(lm, drafter, ids, gen, length):
            return generate(lm, ids, gen, drafter=drafter, length=length)
    except ImportError:  # before: run_method(lm, drafter, ids, gen, length=)
        from specstack.engine.methods import run_method

        def run_one(lm, drafter, ids, gen, length):
            return run_method(lm, drafter, ids, gen, length=length)

    lm = load_model("smollm2-135m", dtype="int4")
    prompts = [encode_prompt(lm.tokenizer, p) for p in humaneval_prompts(20)]
    sources = DraftSources.for_model(lm.name)
    gen = GenerationConfig(max_new_tokens=64, stop_on_eos=False, sampling=SamplingParams(temperature=0))
    built = {}
    print("ready", flush=True)
    for line in sys.stdin:
        kind, method, n = line.split()
        rows = int(n) if kind == "batch" else 1
        if (method, rows) not in built:  # drafters and rules (and any cost curve they measure) before timing
            spec = parse_method(method)
            built[method, rows] = spec, drafter_factory(spec, lm, sources)
        spec, factory = built[method, rows]
        length = length_rule(spec, lm, rows)  # a fresh rule per run, as a new request or batch gets
        drafter = None if factory is None or kind != "one" else factory()
        t0 = time.perf_counter()
        if kind == "one":
            out = run_one(lm, drafter, prompts[int(n)], gen, length)
            tokens = len(out.tokens)
        else:
            outs = generate_batch(lm, prompts[:rows], gen, batch_size=rows, drafters=factory, length=length)
            tokens = sum(len(o.tokens) for o in outs)
        print(f"{time.perf_counter() - t0:.4f} {tokens}", flush=True)


if __name__ == "__main__":
    main()
