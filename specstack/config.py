"""Frozen configuration dataclasses shared by every layer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specstack import validate
from specstack.errors import SpecstackError

DEVICES = ("cpu", "cuda")
# The engine's sizes (engine/batched.py, engine/plan.py), here so the light CLI can show them without torch.
# Tokens one step's forward may carry, prompt chunks and draft nodes together (vLLM's max_num_batched_tokens):
# wide enough that a burst of prompts is read in few steps and one row's largest tree fits.
DEFAULT_STEP_TOKENS = 256
# Tokens a row holds (prompt + output) unless the caller says otherwise: the KV cache is allocated up front
# for every row at this length.
DEFAULT_MAX_CONTEXT = 2048


@dataclass(frozen=True)
class BlockFeatures:
    """What a decoder block is made of (DESIGN §3): the model is assembled from these, never from its
    family's name. Defaults are Llama's. A family's features are in models/architectures.py."""

    norm: Literal["rms", "layer"] = "rms"  # layer: LayerNorm with a bias
    activation: Literal["swiglu", "gelu_tanh"] = "swiglu"  # swiglu: a gate and an up projection
    position: Literal["rope", "learned"] = "rope"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and k before the rotation (Qwen3)

    def __post_init__(self) -> None:
        for name, value, allowed in (("norm", self.norm, ("rms", "layer")),
                                     ("activation", self.activation, ("swiglu", "gelu_tanh")),
                                     ("position", self.position, ("rope", "learned"))):
            if value not in allowed:
                raise SpecstackError(f"block feature {name} must be one of {', '.join(allowed)}, got {value!r}")

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of one decoder. `arch` names its family (models/architectures.py); `block` says what its
    blocks are made of (DESIGN §3)."""

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    head_dim: int = 0  # 0 -> d_model // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    block: BlockFeatures = field(default_factory=BlockFeatures)

    def __post_init__(self) -> None:
        if isinstance(self.block, dict):  # from a JSON record (asdict of a config)
            object.__setattr__(self, "block", BlockFeatures(**self.block))
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise SpecstackError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class WindowSpec:
    """Sliding-window attention: every query sees the first `sink` positions and the last `window`."""

    sink: int
    window: int

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 1:
            raise SpecstackError(f"invalid sliding window sink={self.sink} window={self.window}")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 disable those filters. The rules are
    validate's, as the command line checks its flags."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        validate.temperature("temperature", self.temperature)
        validate.top_k("top_k", self.top_k)
        validate.top_p("top_p", self.top_p)
        if self.seed is not None:
            validate.seed("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class EditorStops:
    """An editor's stops, as llama.cpp's /infill takes them (`t_max_predict_ms`, `n_indent`): a completion
    shown while the user types is cut at a line, not mid-line. They only end the text early, so every
    method stays lossless under them."""

    seconds: float | None = None  # once generation has run this long, stop at the next line break
    # a line after the first indented less than this ends the text, cut before its code; a blank line too,
    # as in llama.cpp (a block's end, for an editor)
    indent: int = 0

    def __post_init__(self) -> None:
        if self.seconds is not None and not self.seconds >= 0:
            raise SpecstackError(f"the time limit must be a number of seconds >= 0, got {self.seconds!r}")
        if self.indent < 0:
            raise SpecstackError(f"the indent must be >= 0, got {self.indent}")

    def cut(self, text: str, elapsed: float, fresh: str) -> int | None:
        """Where the text ends under these stops (None: it goes on). `fresh` is the text the last tokens
        added: the time limit acts when a line break arrives after it has passed, as llama.cpp's does."""
        if self.indent > 0:
            at = text.find("\n")
            while at >= 0:
                start = at + 1
                end = start
                while end < len(text) and text[end] in " \t":
                    end += 1
                if end < len(text) and end - start < self.indent:
                    return end  # the line's indentation is kept, its code (or a blank line's break) is not
                at = text.find("\n", start)
        if self.seconds is not None and elapsed > self.seconds and "\n" in fresh:
            return len(text)
        return None


MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit for chat; completions allow 5)
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range)
GrammarKind = Literal["json_object", "json_schema", "regex", "lark"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence and frequency penalties over the tokens generated so far, and vLLM's
    repetition penalty (CTRL's) over the prompt and the tokens generated: they change the target's
    logits before the warp, at every position from the tokens before it (processing.py)."""

    presence: float = 0.0  # subtracted once from the logit of every token already generated
    frequency: float = 0.0  # subtracted per occurrence
    repetition: float = 1.0  # a seen token's positive logit divided by it, a negative one multiplied

    def __post_init__(self) -> None:
        validate.bounded_float("presence_penalty", self.presence, -2.0, 2.0)
        validate.bounded_float("frequency_penalty", self.frequency, -2.0, 2.0)
        validate.bounded_float("repetition_penalty", self.repetition, 0.0, 2.0, low_open=True)

    @property
    def off(self) -> bool:
        return self.presence == 0 and self.frequency == 0 and self.repetition == 1


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: the text must match this grammar (processing.py compiles it with llguidance).
    json_object: any JSON object; json_schema: `text` is a JSON schema; regex: a regular expression;
    lark: a Lark grammar (llguidance's dialect, which may embed `%json{...}` schemas)."""

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise SpecstackError(f"unknown grammar kind {self.kind!r}: choose from {', '.join(GRAMMAR_KINDS)}")
        if self.kind != "json_object" and not self.text.strip():
            raise SpecstackError(f"a {self.kind} grammar needs its text")


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_on_eos: bool = True
    editor: EditorStops | None = None
    stop_ids: tuple[int, ...] = ()  # tokens that end the text as EOS does (a FIM middle's end tokens)
    # the target's log-probability of every emitted token and its `logprobs` most likely alternatives
    # (None: none; 0: the emitted token's alone), read from the forward that verified it
    logprobs: int | None = None
    prompt_logprobs: bool = False  # also every prompt token's (but the first), from the forward that read it
    penalties: Penalties = field(default_factory=Penalties)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        validate.new_tokens("max_new_tokens", self.max_new_tokens)
        for stop in self.stop_strings:
            validate.stop_string("stop_strings", stop)
        if self.logprobs is not None:
            validate.bounded_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for token, bias in self.logit_bias:
            validate.bounded_int("logit_bias token", token, 0)
            validate.bounded_float("logit_bias", bias, -MAX_BIAS, MAX_BIAS)

    @property
    def processed(self) -> bool:
        """The target's logits are changed before the warp (penalties, a bias, a grammar)."""
        return not self.penalties.off or bool(self.logit_bias) or self.grammar is not None
