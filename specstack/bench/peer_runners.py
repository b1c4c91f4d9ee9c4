"""The peers of a `specstack bench` run made ready: each row of bench/peer_table.py run by the runner of
its `runs`, every model or process started once and stopped by `close`, and for each peer one line
saying exactly what ran (`about`: the package or binary, its version, its build flags or precision).

transformers runs in the bench's process (torch, as ours); llama-cpp-python and OpenVINO GenAI each in a
child process (bench/peer_child.py), llama-server as a server process (bench/llama_server.py): a native
peer that crashes or hangs fails alone, as one line of the report.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specstack.bench import llama_cpp_peer, openvino_peer
from specstack.bench.llama_build import binary_about
from specstack.bench.llama_server import LlamaServer, server_binary, spec_flags
from specstack.bench.outputs import Output, Runner
from specstack.bench.peer_child import PeerChild
from specstack.bench.peer_table import PEERS
from specstack.bench.peers import ForwardCounter, hf_about, hf_dtype, hf_generate, load_hf
from specstack.bench.plan import BenchMethod
from specstack.config import SamplingParams
from specstack.engine.methods import DraftSources
from specstack.models.drafts import DraftKind, DraftSpec
from specstack.models.registry import resolve


class Peers:
    """The peers of one run, each model loaded and each process started once (by its settings)."""

    def __init__(self, model: str, sources: DraftSources, sampling: SamplingParams, device: str, threads: int,
                 pad_id: int | None, bin_dir: Path | None = None) -> None:
        self.model, self.src, self.sources, self.sampling = model, resolve(model), sources, sampling
        self.device, self.threads, self.pad_id, self.bin_dir = device, threads, pad_id, bin_dir
        self.hf: dict[str, tuple[Any, ForwardCounter]] = {}
        self.assistants: dict[str, Any] = {}
        self.children: dict[tuple, PeerChild] = {}
        self.servers: list[LlamaServer] = []
        self.about: dict[str, str] = {}  # label -> what ran it

    # -- the table's dispatch --------------------------------------------------------------------------
    def unavailable(self, m: BenchMethod) -> str | None:
        """Why the peer cannot run here (None when it can); nothing is loaded."""
        return self._kinds()[PEERS[m.name].runs][0](m)

    def runner(self, m: BenchMethod, n_ctx: int) -> Runner:
        """The peer made ready (raises SpecstackError when it cannot start); `about[m.label]` says what runs it."""
        return self._kinds()[PEERS[m.name].runs][1](m, n_ctx)

    def _kinds(self) -> dict[str, tuple[Callable[[BenchMethod], str | None], Callable[[BenchMethod, int], Runner]]]:
        return {"transformers": (self._hf_unavailable, self._hf_runner),
                "llama-cpp-python": (self._llama_unavailable, self._llama_runner),
                "llama-server": (self._server_unavailable, self._server_runner),
                "openvino-genai": (self._openvino_unavailable, self._openvino_runner)}

    def close(self) -> None:
        for server in self.servers:
            server.close()
        for child in self.children.values():
            child.close()

    def _draft_gguf(self) -> Path | None:
        if self.sources.draft is None or DraftSpec.parse(self.sources.draft).kind is not DraftKind.MODEL:
            return None
        src = resolve(self.sources.draft)
        return src.path if src.kind == "gguf" else None

    def _child(self, library: str, **load: Any) -> PeerChild:
        key = (library, *sorted(load.items()))
        if key not in self.children:
            self.children[key] = PeerChild(library, **load)
        return self.children[key]

    # -- transformers, in this process -----------------------------------------------------------------
    def _hf_unavailable(self, m: BenchMethod) -> str | None:
        if PEERS[m.name].draft and self._draft_model() is None:
            return (f"unavailable: the draft {self.sources.draft or 'self:N'} is not a model transformers can load "
                    "as an assistant; pass --draft MODEL (a small model with the same tokenizer)")
        return None

    def _draft_model(self) -> str | None:
        draft = self.sources.draft
        return draft if draft is not None and DraftSpec.parse(draft).kind is DraftKind.MODEL else None

    def hf_model(self, dtype: str) -> tuple[Any, ForwardCounter]:
        """transformers' model in `dtype` (bf16 or fp32), loaded once, and its forward counter."""
        if dtype not in self.hf:
            model = load_hf(self.src, dtype, self.device)
            self.hf[dtype] = (model, ForwardCounter(model))
        return self.hf[dtype]

    def _hf_runner(self, m: BenchMethod, n_ctx: int) -> Runner:
        dt = hf_dtype(m.dtype)
        model, counter = self.hf_model(dt)
        extra: dict[str, Any] = {}
        kind = PEERS[m.name]
        if kind.lookup:
            extra["prompt_lookup_num_tokens"] = m.params["tokens"]
        elif kind.draft:
            if dt not in self.assistants:
                self.assistants[dt] = load_hf(resolve(self.sources.draft), dt, self.device)
            extra["assistant_model"] = self.assistants[dt]
        self.about[m.label] = hf_about(dt, self.device)

        def go(ids: list[int], n: int) -> Output:
            before = counter.calls
            tokens = hf_generate(model, ids, n, self.sampling, self.pad_id, **extra)
            calls = counter.calls - before  # the prefill forward emits the first token
            return Output(tokens, dt, max(0, calls - 1), len(tokens) / calls if calls else None)

        return go

    # -- llama-cpp-python, in a child process ----------------------------------------------------------
    def _llama_unavailable(self, m: BenchMethod) -> str | None:
        return llama_cpp_peer.unavailable(self.src.kind == "gguf")

    def _llama_runner(self, m: BenchMethod, n_ctx: int) -> Runner:
        child = self._child("llama-cpp-python", gguf=str(self.src.path), threads=self.threads, n_ctx=n_ctx,
                            prompt_lookup=m.params["tokens"] if PEERS[m.name].lookup else 0)
        self.about[m.label] = child.about
        return lambda ids, n: Output(child.generate(ids, n, self.sampling), "gguf")

    # -- llama-server ------------------------------------------------------------------------------------
    def _server_unavailable(self, m: BenchMethod) -> str | None:
        if self.src.kind != "gguf":
            return "the model is not a GGUF file"
        if PEERS[m.name].draft and self._draft_gguf() is None:
            return "needs a GGUF draft: pass --draft MODEL (the draft the engine uses)"
        return server_binary(self.bin_dir)[1] or None

    def _server_runner(self, m: BenchMethod, n_ctx: int) -> Runner:
        binary, _ = server_binary(self.bin_dir)
        assert binary is not None  # unavailable() said so first
        server = LlamaServer(binary, self.src.path, self.threads, n_ctx, spec_flags(m.name, m.params, self._draft_gguf()))
        self.servers.append(server)  # closed with the others, even when it fails to start
        server.start()
        self.about[m.label] = binary_about(binary)

        def go(ids: list[int], n: int) -> Output:
            drafted, accepted = server.drafted, server.accepted
            tokens = server.generate(ids, n, self.sampling)
            d, a = server.drafted - drafted, server.accepted - accepted
            # every target forward (the prefill's included) yields one token of its own, after the
            # drafts it accepted: forwards = tokens - accepted, as the engine counts them
            forwards = len(tokens) - a
            return Output(tokens, "gguf", target_forwards=forwards, tau=len(tokens) / forwards if forwards else None,
                          origins={"draft": a, "target": forwards}, drafted=d)

        return go

    # -- OpenVINO GenAI, in a child process --------------------------------------------------------------
    def _openvino_paths(self, m: BenchMethod) -> tuple[Path | None, Path | None]:
        """The IR folders a method reads: the model's (openvino-ir, openvino-spec) and the draft's (openvino-spec)."""
        kind = PEERS[m.name]
        if not kind.ir:
            return None, None
        draft = self._draft_model() if kind.draft else None
        return openvino_peer.ir_dir(self.model), (openvino_peer.ir_dir(draft) if draft else None)

    def _openvino_unavailable(self, m: BenchMethod) -> str | None:
        if PEERS[m.name].draft and self._draft_model() is None:
            return "needs a draft model: pass --draft MODEL (its int4 IR from benchmarks/peers/export_openvino.sh)"
        ir, draft = self._openvino_paths(m)
        return (openvino_peer.unavailable(self.src.kind == "gguf", ir)
                or (openvino_peer.unavailable(True, draft) if draft is not None else None))

    def _openvino_runner(self, m: BenchMethod, n_ctx: int) -> Runner:
        ir, draft = self._openvino_paths(m)
        load: dict[str, Any] = {"model": str(ir or self.src.path), "threads": self.threads}
        if PEERS[m.name].lookup:
            load |= {"prompt_lookup": m.params["tokens"], "ngram": m.params["n"]}
        if draft is not None:
            load |= {"draft": str(draft), "draft_tokens": m.params["tokens"]}
        child = self._child("openvino-genai", **load)
        self.about[m.label] = child.about
        fmt = "int4-ir" if ir else "gguf"
        return lambda ids, n: Output(child.generate(ids, n, self.sampling), fmt)
