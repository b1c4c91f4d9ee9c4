"""The peers of `specstack bench`, written once: what people would otherwise use, each as a row that
says what runs it, the parameters it takes (with their defaults) and whether it decodes batches.
bench/plan.py checks a method list against it; bench/peer_runners.py runs each row through the runner
of its `runs`. Torch-free, so the command line parses a method list without loading anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerKind:
    runs: str  # what runs it: transformers, llama-cpp-python, llama-server, llama-batched-bench, openvino-genai
    about: str  # one line for --help and the docs
    params: dict[str, int] = field(default_factory=dict)  # its parameters and their defaults
    batch: bool = False  # decodes many sequences at once (--batch-sizes)
    batch_only: bool = False  # and only that
    lookup: bool = False  # drafts by prompt lookup (`tokens` a step)
    draft: bool = False  # speculates with --draft, a model
    ir: bool = False  # reads OpenVINO's own IR of the model (and of the draft), not the GGUF


PEERS: dict[str, PeerKind] = {
    "hf": PeerKind("transformers", "transformers' `generate` (bf16 or fp32)", batch=True),
    "hf-pld": PeerKind("transformers", "transformers' prompt lookup", {"tokens": 10}, lookup=True),
    "hf-assisted": PeerKind("transformers", "transformers with --draft as its assistant model", draft=True),
    "llamacpp": PeerKind("llama-cpp-python", "llama-cpp-python on the same GGUF"),
    "llamacpp-pld": PeerKind("llama-cpp-python", "llama-cpp-python's prompt lookup", {"tokens": 10}, lookup=True),
    "llamacpp-batched": PeerKind("llama-batched-bench", "llama.cpp's llama-batched-bench on the same GGUF",
                                 batch=True, batch_only=True),
    # plain decoding through llama-server (the binaries of benchmarks/build_llama_cpp.sh, no llama-cpp-python)
    "llamacpp-server": PeerKind("llama-server", "llama-server on the same GGUF, plain decoding"),
    # llama-server with the draft model (bench/llama_server.py): draft max, p-min in percent
    "llamacpp-spec": PeerKind("llama-server", "llama-server with --draft as its draft model", {"max": 16, "pmin": 80},
                              draft=True),
    # llama-server's draft-free n-gram speculation: lookup n-gram size, tokens drafted
    "llamacpp-ngram": PeerKind("llama-server", "llama-server's n-gram speculation", {"n": 3, "max": 16}),
    "openvino": PeerKind("openvino-genai", "OpenVINO GenAI reading the same GGUF"),
    # prompt lookup: tokens drafted a step, the longest n-gram matched
    "openvino-pld": PeerKind("openvino-genai", "OpenVINO GenAI's prompt lookup on the GGUF", {"tokens": 10, "n": 3},
                             lookup=True),
    "openvino-ir": PeerKind("openvino-genai", "OpenVINO GenAI on its own int4 IR of the model", ir=True),
    # draft-model speculation on the IRs of the model and --draft: tokens drafted a step
    "openvino-spec": PeerKind("openvino-genai", "OpenVINO GenAI's speculation with --draft's int4 IR", {"tokens": 5},
                              draft=True, ir=True),
}
BATCH_PEERS = tuple(name for name, kind in PEERS.items() if kind.batch)
