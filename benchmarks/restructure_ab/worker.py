"""A/B worker: loads the default model once, then for each line 'METHOD TASK_INDEX' on stdin generates
64 greedy tokens and prints 'seconds tokens'. The driver alternates two workers (old code, new code)."""
import sys
import time

import torch


def main() -> None:
    torch.set_num_threads(1)
    # specstack from whichever source tree PYTHONPATH names (old or new code): the same script serves both
    from specstack.bench.datasets import humaneval_prompts
    from specstack.config import GenerationConfig, SamplingParams
    from specstack.engine.methods import DraftSources, build_drafter, length_rule, parse_method
    try:  # one engine: generate(lm, ids, gen, drafter=, length=)
        from specstack.engine.batched import generate

        def run(lm, drafter, ids, gen, length):
            return generate(lm, ids, gen, drafter=drafter, length=length)
    except ImportError:  # before it: run_method(lm, drafter, ids, gen, length=)
        from specstack.engine.methods import run_method

        def run(lm, drafter, ids, gen, length):
            return run_method(lm, drafter, ids, gen, length=length)
    from specstack.models.loading import load_model
    from specstack.prompts import encode_prompt

    lm = load_model("smollm2-135m", dtype="int4")
    prompts = [encode_prompt(lm.tokenizer, p) for p in humaneval_prompts(10)]
    try:
        sources = DraftSources.for_model(lm.name)
    except AttributeError:
        from specstack.engine.methods import DEFAULT_SOURCES
        sources = DEFAULT_SOURCES[lm.name]
    gen = GenerationConfig(max_new_tokens=64, stop_on_eos=False, sampling=SamplingParams(temperature=0))
    drafters = {}
    print("ready", flush=True)
    for line in sys.stdin:
        method, i = line.split()
        if method not in drafters:
            spec = parse_method(method)
            drafters[method] = build_drafter(spec, lm, sources), length_rule(spec, lm, 1)
        drafter, length = drafters[method]
        t0 = time.perf_counter()
        out = run(lm, drafter, prompts[int(i)], gen, length)
        print(f"{time.perf_counter() - t0:.4f} {len(out.tokens)}", flush=True)


if __name__ == "__main__":
    main()
