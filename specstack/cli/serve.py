"""`specstack serve`: an OpenAI-compatible HTTP server over the batched engine (DESIGN §8).

FastAPI on uvicorn: the stack the Python serving projects (vLLM, SGLang's HTTP front end) use, well
kept, with SSE streaming and ASGI disconnect events that let a closed stream cancel its request. The
socket is bound first, so a port in use fails at once with one error line and `/health` answers 503
while the model loads in a thread; the engine then runs in its own thread (server/worker.py) and the
event loop never waits on a forward.

Continuous batching: requests join the running batch between steps and leave when done, each row
decoding as it would alone. `--method` speculates in every row under its draft-length rule: the
default `auto` is cost-aware, so it drafts only while the measured cost of a wider forward at the
step's batch size pays, and turns drafting off under load by itself.
"""
from __future__ import annotations

import argparse
import os
import threading
from typing import Any

from specstack import validate
from specstack.cli.common import (
    add_checked,
    add_draft_args,
    add_model_args,
    check_model_args,
)
from specstack.cluster.deploy import parse_replicas, serve_replicas
from specstack.config import DEFAULT_MAX_CONTEXT, DEFAULT_STEP_TOKENS
from specstack.errors import SpecstackError
from specstack.server.listen import bind, note, url_of
from specstack.server.loader import load_engine

DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_QUEUE = 256
DEFAULT_PREFIX_CACHE_MB = 1024
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="Serve the model over an OpenAI-compatible HTTP API (completions, chat, "
                                          "streaming, models, health, Prometheus metrics) with continuous batching "
                                          "and speculation that adapts to load.")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    add_checked(g, "--port", validate.ints(0, 65535), default=8000, help="default: 8000; 0 picks a free port")
    add_checked(g, "--max-batch", validate.ints(1, validate.MAX_BATCH_SIZE, "each row holds a KV cache of its context"),
                default=DEFAULT_MAX_BATCH, metavar="B", help=f"rows decoding at once (default {DEFAULT_MAX_BATCH})")
    add_checked(g, "--max-queue", validate.ints(0, validate.MAX_COUNT), default=DEFAULT_MAX_QUEUE, metavar="Q",
                help=f"requests waiting for a row beyond the batch; more are refused with 503 (default "
                     f"{DEFAULT_MAX_QUEUE})")
    add_checked(g, "--max-context", validate.ints(2, validate.MAX_CONTEXT), default=None, metavar="N",
                help=f"tokens a request may hold, prompt and completion (default: {DEFAULT_MAX_CONTEXT} or the "
                     "model's context if shorter)")
    add_checked(g, "--step-tokens", validate.ints(1, validate.MAX_CONTEXT), default=DEFAULT_STEP_TOKENS,
                metavar="N", help=f"tokens one step may carry, prompt chunks and draft tokens together (default "
                                  f"{DEFAULT_STEP_TOKENS}): every running stream's root comes first, then prompts, "
                                  "oldest first, then drafts; smaller keeps the running streams' inter-token latency "
                                  "even when requests join, larger gives a lower time to first token")
    add_checked(g, "--prefix-cache-mb", validate.ints(1, validate.MAX_COUNT), default=DEFAULT_PREFIX_CACHE_MB,
                metavar="N", help=f"memory for the prefix cache, MiB (default {DEFAULT_PREFIX_CACHE_MB}): the keys and "
                                  "values of prompts (and answers) already read, so a request that starts the same "
                                  "way (a chat's next turn, an editor's context, n samples) reads only what is new; "
                                  "least recently used first out. A draft model keeps a cache of its own of this "
                                  "size at most")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="read every prompt whole (no prefix cache)")
    g.add_argument("--api-key", default=os.environ.get("SPECSTACK_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $SPECSTACK_API_KEY, else none)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the --model value)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="uvicorn's log level (default warning)")
    g = p.add_argument_group("replicas (Ray Serve: pip install 'specstack[cluster]')")
    add_checked(g, "--replicas", parse_replicas, default=None, metavar="N|MIN:MAX",
                help="serve N engines behind one endpoint as a Ray Serve deployment, each with --threads CPU "
                     "threads pinned to cores of its own (default 1); MIN:MAX autoscales on requests in flight")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (`ray start --head` prints it; 'auto': the one on this machine) "
                        "instead of starting a local one; implies --replicas 1 unless given")
    add_checked(g, "--target-ongoing", validate.ints(1, validate.MAX_COUNT), default=None, metavar="N",
                help="with --replicas MIN:MAX: requests in flight per replica the autoscaler aims at "
                     "(default: half of --max-batch)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--method", default="auto", metavar="NAME[:k=v,...]",
                   help="every request's method unless its body picks another (as `specstack generate --method`; "
                        "default auto: the cost-aware n-gram chain)")
    add_draft_args(g)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    # 1. cheap checks and the socket, before anything heavy
    dtype = check_model_args(args)
    from specstack.engine.methods import parse_method

    parse_method(args.method)  # a bad name fails here (the draft flags also serve requests' own methods)
    if args.api_key is not None and not args.api_key.strip():
        raise SpecstackError("--api-key is empty")
    if args.target_ongoing is not None and (args.replicas is None or args.replicas.fixed):
        raise SpecstackError("--target-ongoing needs --replicas MIN:MAX (autoscaling)")
    if args.replicas is not None or args.ray_address is not None:
        return serve_replicas(args, dtype)
    sock = bind(args.host, args.port)

    import uvicorn

    from specstack.server.app import ServerState, create_app
    from specstack.server.metrics import ServerMetrics

    # 2. answer at once (health 503) while the model loads in a thread
    model_id = args.served_model_name or args.model
    state = ServerState(model_id, args.api_key, ServerMetrics(model_id))
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level=args.log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    failed: list[SpecstackError] = []

    def loader() -> None:
        try:
            load_engine(args, dtype, state)
            note(f"ready: {model_id} (method {state.method}, up to {args.max_batch} rows of "
                 f"{state.max_context} tokens) on {url_of(sock)}/v1")
        except SpecstackError as e:
            failed.append(e)
            state.load_error = str(e)
            server.should_exit = True
        except BaseException as e:  # a bug: stop the server, keep the traceback
            state.load_error = "the model failed to load"
            server.should_exit = True
            raise e

    note(f"listening on {url_of(sock)} (loading {args.model}; /health answers 503 until it is ready)")
    threading.Thread(target=loader, name="specstack-loader", daemon=True).start()
    # 3. serve until Ctrl-C / SIGTERM (uvicorn drains open streams for up to 5 s)
    try:
        server.run(sockets=[sock])
    finally:
        if state.worker is not None:
            state.worker.stop()
        sock.close()
    if failed:
        raise failed[0]
    return 0
