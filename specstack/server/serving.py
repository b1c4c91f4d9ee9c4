"""`POST /v1/completions` and `POST /v1/chat/completions`, the parts they share (vLLM's serving_engine.py);
what sets them apart is their Route (serving_chat.py's CHAT, serving_completion.py's COMPLETIONS), asked
here, never branched on by name. The body read (protocol.py), the prompts
encoded (a chat's tools in its template, or described in its system message where the template
writes none; a FIM prompt for `suffix`) and checked against a row's context,
the request's logits rules checked here (a grammar that does not compile, a bias on a token the model
does not have: 400), one job per choice, and the answer whole or streamed: text, log-probabilities
(logprobs.py) and tool calls (tools.py) in OpenAI's shapes."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specstack.config import GrammarSpec
from specstack.engine.stats import GenerationResult
from specstack.engine.stopping import Span
from specstack.errors import SpecstackError
from specstack.fim import encode_fim
from specstack.processing import TokenLogprob
from specstack.prompts import check_text, encode_prompt
from specstack.server.jobs import ClientGone, Events, collect, engine_failure, prepare, sink_into, submit
from specstack.server.logprobs import TokenText
from specstack.server.protocol import CompletionRequest, Prompt, Route, bad, parse_request
from specstack.server.responses import DONE, Choice, Reply, cached_tokens, sse
from specstack.server.state import ServerState, authorize, check_model, fim_budget, fim_template, loaded, read_json
from specstack.server.tools import ToolStream, encode_with_tools, forced_call_grammar, parse_calls, tag_terminals
from specstack.server.worker import EngineWorker, Event, finish_reason


def encode(state: ServerState, prompt: Prompt, new_tokens: int | None = None,
           tools: list[dict[str, Any]] | None = None, choice: str | dict[str, Any] = "auto") -> list[int]:
    try:
        if prompt.suffix is not None:
            check_text(prompt.suffix)
            return encode_fim(state.tokenizer, fim_template(state, "suffix"), prompt.text or "", prompt.suffix,
                              budget=fim_budget(state, new_tokens)).ids
        if prompt.messages is not None:
            return encode_with_tools(state.tokenizer, prompt.messages, tools, choice)
        if prompt.text is not None:
            return encode_prompt(state.tokenizer, prompt.text)
    except SpecstackError as e:
        raise bad(str(e), "messages" if prompt.messages is not None else "prompt") from None
    ids = prompt.ids or []
    if any(t >= state.vocab_size for t in ids):
        raise bad(f"prompt: token ids must be below the vocabulary size {state.vocab_size}", "prompt")
    return ids


def new_tokens(state: ServerState, req: CompletionRequest, prompt_len: int) -> int:
    """The tokens a choice may generate: max_tokens, which must fit the row's context with the prompt;
    without it the route's default, capped by the room left."""
    room = state.max_context - prompt_len
    if room < 1:
        raise bad(f"This model's maximum context length is {state.max_context} tokens; the prompt has "
                  f"{prompt_len} tokens, which leaves no room for the completion", "prompt", "context_length_exceeded")
    if req.max_tokens is None:
        default = req.route.default_max_tokens
        return room if default is None else min(room, default)
    if req.max_tokens > room:
        raise bad(f"This model's maximum context length is {state.max_context} tokens; you requested "
                  f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the prompt, {req.max_tokens} for the "
                  "completion)", "max_tokens", "context_length_exceeded")
    return req.max_tokens


async def check_rules(state: ServerState, worker: EngineWorker, req: CompletionRequest,
                      grammar: GrammarSpec | None) -> None:
    """What the engine would refuse only once queued, refused now (400): a bias on a token the model
    does not have, a grammar that does not compile (compiled off the event loop: the first grammar of a
    model reads its vocabulary, seconds)."""
    for token, _ in req.logit_bias:
        if token >= state.vocab_size:
            raise bad(f"logit_bias: token id {token} is not below the vocabulary size {state.vocab_size}", "logit_bias")
    if grammar is not None:
        try:
            await asyncio.to_thread(lambda: worker.engine.grammars.matcher(grammar))
        except SpecstackError as e:
            param = "tools" if req.tool_choice not in ("none", "auto") else req.grammar_param
            raise bad(str(e), param, "invalid_grammar") from None


class Answer:
    """How one choice's result reads in the response: its text (the prompt first, for `echo`), its
    log-probabilities in the route's shape, its tool calls."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompt_ids: list[int]) -> None:
        self.req, self.prompt_ids = req, prompt_ids
        self.text = TokenText(state.tokenizer)
        self.prompt_text = state.tokenizer.decode(prompt_ids, skip_special_tokens=False) if req.echo else ""

    def logprobs(self, lps: list[TokenLogprob], prompt: list[TokenLogprob] | None = None,
                 offset: int = 0) -> dict[str, Any] | None:
        req = self.req
        if req.logprobs is None:
            return None
        return req.route.logprobs_body(self.text, lps, req.logprobs, offset,
                                       None if prompt is None else (self.prompt_ids, prompt))

    def choice(self, result: GenerationResult) -> Choice:
        reason = finish_reason(result)
        if self.req.tools and self.req.tool_choice != "none":  # only a chat reads tools (Route.read_tools)
            content, calls = parse_calls(result.text, self.req.tool_names)
            if calls:
                return Choice(content, "tool_calls", self.logprobs(result.logprobs or []), [c.body() for c in calls])
        return Choice(self.prompt_text + result.text, reason,
                      self.logprobs(result.logprobs or [], result.prompt_logprobs if self.req.echo else None))


async def complete(state: ServerState, request: Request, route: Route) -> Response:
    authorize(state, request)
    worker = loaded(state)
    req = parse_request(route, await read_json(request))
    check_model(state, req.model)
    tools = req.tools if req.tool_choice != "none" else None
    encoded = [encode(state, p, req.max_tokens, tools, req.tool_choice) for p in req.prompts]
    limits = [new_tokens(state, req, len(ids)) for ids in encoded]
    grammar = forced_call_grammar(tools, req.tool_choice, tag_terminals(state.tokenizer)) if tools else None
    await check_rules(state, worker, req, grammar or req.grammar)
    # a FIM middle also ends at its template's end tokens (the model would go on to another file)
    stops = fim_template(state, "suffix").end_ids(state.tokenizer) if req.prompts[0].suffix is not None else ()
    reply = Reply(req.route, state.model_id, sum(len(ids) for ids in encoded))
    events: Events = asyncio.Queue()
    sink = sink_into(events)
    if len(encoded) * req.n > worker.capacity:  # would wait for room forever
        raise bad(f"{len(encoded) * req.n} choices (prompts x n) are more than this server holds at once "
                  f"({worker.capacity})", "n")
    await prepare(worker, req.method)
    jobs = [(ids, req.generation(limit, j, stops, grammar), sink(p * req.n + j))
            for p, (ids, limit) in enumerate(zip(encoded, limits, strict=True)) for j in range(req.n)]
    answers = [Answer(state, req, ids) for ids in encoded for _ in range(req.n)]
    ids = submit(worker, jobs, req.method, req.origins)
    if req.stream:
        return StreamingResponse(stream(worker, reply, req, events, ids, answers), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    spans: dict[int, list[Span]] | None = {} if req.origins else None
    try:
        finals = await collect(worker, request, events, ids, spans)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    choices = [answers[i].choice(finals[i]) for i in range(len(ids))]
    return JSONResponse(reply.response(choices, sum(len(r.tokens) for r in finals.values()),
                                       cached_tokens(finals, req.n), spans))


async def stream(worker: EngineWorker, reply: Reply, req: CompletionRequest, events: asyncio.Queue[tuple[int, Event]],
                 ids: list[int], answers: list[Answer]) -> AsyncIterator[str]:
    """SSE: each choice's text as its row releases it (with its tokens' log-probabilities, and with tools,
    the calls as each closes), one last chunk per choice with its finish reason, the usage chunk if
    asked, then [DONE]. Closing the stream cancels what has not finished: Starlette's StreamingResponse
    watches for the disconnect itself (ASGI spec 2.3, as uvicorn speaks it) and cancels this generator,
    or (spec 2.4) its next write fails; either way `finally` runs."""
    usage = req.include_usage
    tokens: dict[int, int] = {}
    results: dict[int, GenerationResult] = {}
    calls = {i: ToolStream(req.tool_names) for i in range(len(ids))} if req.tools and req.tool_choice != "none" else {}
    offsets = {i: 0 for i in range(len(ids))}  # completions' text_offset: characters sent so far
    try:
        if reply.route.role_first:  # the assistant's role first, as OpenAI streams chat
            for i in range(len(ids)):
                yield reply.chunk(i, None, first=True, usage_field=usage)
        elif req.echo:  # the prompt first (completions only: Route.read_echo)
            for i in range(len(ids)):
                yield reply.chunk(i, answers[i].prompt_text, usage_field=usage)
                offsets[i] = len(answers[i].prompt_text)
        while len(tokens) < len(ids):
            index, event = await events.get()
            if event.error is not None:
                yield sse(engine_failure(event).body())
                return
            text, deltas = event.text, None
            if index in calls and text:
                text, done = calls[index].feed(text)
                deltas = calls[index].deltas(done) or None
            lps = answers[index].logprobs(list(event.logprobs), offset=offsets[index]) if event.logprobs else None
            if text or deltas or lps:
                yield reply.chunk(index, text, usage_field=usage, spans=event.spans if req.origins else None,
                                  logprobs=lps, tool_calls=deltas)
                offsets[index] += len(text or "")
            if event.result is not None:
                tokens[index] = len(event.result.tokens)
                results[index] = event.result
                reason = finish_reason(event.result)
                if index in calls:
                    rest, late = calls[index].finish()
                    if rest or late:
                        yield reply.chunk(index, rest or None, usage_field=usage,
                                          tool_calls=calls[index].deltas(late) or None)
                    reason = "tool_calls" if calls[index].calls else reason
                yield reply.chunk(index, None, reason, usage_field=usage)
        if usage:
            yield reply.usage_chunk(sum(tokens.values()), cached_tokens(results, req.n))
        yield DONE
    finally:
        worker.cancel(ids)
