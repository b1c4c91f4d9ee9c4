"""Loading a server's engine from its command-line options: the model, the method, the engine thread.

Shared by `specstack serve` (cli/serve.py, in a loader thread while /health answers 503) and each Ray
Serve replica (cluster/replica.py, in the replica's constructor), so one server and N replicas build
exactly the same engine from the same flags.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from specstack.config import DEFAULT_MAX_CONTEXT
from specstack.errors import SpecstackError
from specstack.fim import FimTemplate

if TYPE_CHECKING:
    from specstack.server.app import ServerState


def load_engine(args: argparse.Namespace, dtype: str, state: ServerState) -> None:
    """Load the model and the method, start the engine thread, and open the routes (the loader thread)."""
    import torch

    from specstack.engine.batched import BatchEngine, BatchRequest
    from specstack.engine.draft_sources import DraftShelf
    from specstack.engine.methods import DraftSources, describe, drafter_factory, length_rule, parse_method
    from specstack.models.loading import load_model
    from specstack.prefix_cache import PrefixCache
    from specstack.server.worker import EngineWorker

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=dtype, device=args.device)
    max_context = min(args.max_context or DEFAULT_MAX_CONTEXT, lm.config.max_seq_len)
    if args.max_context is not None and args.max_context > lm.config.max_seq_len:
        raise SpecstackError(f"--max-context {args.max_context} is over the model's context of "
                             f"{lm.config.max_seq_len} tokens")
    cache_bytes = 0 if args.no_prefix_cache else args.prefix_cache_mb << 20
    sources = dataclasses.replace(DraftSources.for_model(lm.name, args.draft, args.draft_dtype, args.ngram,
                                                         args.draft_vocab), prefix_cache_bytes=cache_bytes,
                                  shelf=DraftShelf())  # the methods requests pick load nothing twice
    method = parse_method(args.method)
    engine = BatchEngine(lm, max_rows=args.max_batch, max_context=max_context, step_tokens=args.step_tokens,
                         length=length_rule(method, lm, args.max_batch),
                         drafters=drafter_factory(method, lm, sources, args.device),
                         prefix_cache=PrefixCache(cache_bytes) if cache_bytes else None)
    # one short request before the first client's: the first forwards of a fresh process are slow
    engine.run([BatchRequest([lm.config.bos_token_id or 0] * 2)])

    def build(name: str):
        return drafter_factory(parse_method(name), lm, sources, args.device)

    worker = EngineWorker(engine, state.metrics, args.max_batch + args.max_queue, str(method), build)
    worker.start()
    state.ready(worker, lm.tokenizer, lm.config.vocab_size, engine.max_context, describe(method, lm.name),
                fim=fim_of(lm))


def fim_of(lm: Any) -> FimTemplate | str:
    """The model's fill-in-the-middle template, or why it has none (what /infill and `suffix` answer)."""
    from specstack.models.registry import fim_template

    try:
        return fim_template(lm.name, lm.tokenizer)
    except SpecstackError as e:
        return str(e)
