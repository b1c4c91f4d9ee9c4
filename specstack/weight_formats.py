"""The weight formats as one table (DESIGN §3): what each format is, read by everything that needs to know.

A format is a row here and a linear method in models/linear_methods.py (how a layer stores, fills and
runs it: vLLM's `LinearMethodBase`, ggml's type traits). This module holds no torch, so the light command
line and the throughput model read it too. A model is asked for one of the `requested` formats; the
others are *layer formats* a GGUF file's types give some of its layers under a requested one
(models/gguf_quants.py: w4a8's Q4_K layers are k4a8, its Q6_K layers k6a8, its wider ones q8a8).

Adding a format: one `WeightFormat` row below and one method class (ARCHITECTURE.md, "Where to add
things"); every reader of the table (CLI choices, the loader's plan and cache names, the throughput
model's bytes, batch invariance, the head's format, CUDA refusals) follows.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from specstack.errors import SpecstackError


@dataclass(frozen=True)
class WeightFormat:
    """One weight format: what a layer in it stores and reads, and what the model around it must do."""

    name: str
    method: str  # its linear method: "module:Class" (models/linear_methods.py), imported when a layer is built
    bytes_per_weight: float  # what a one-token step reads per weight: codes and their scales
    activation: Literal["fp32", "bf16"]  # the dtype its layers take and return (and the model computes in)
    summary: str  # how a weight is stored, for docs and --help
    requested: bool = True  # a model may be asked for it; False: a layer format a GGUF type gives
    floats: bool = False  # stores the weight as floats (fp32, bf16): what training and pruning need
    batch_invariant: bool = False  # a row's numbers do not depend on the rows beside it (DESIGN §3)
    cpu_only: bool = False  # its kernels are CPU code: refused on CUDA
    takes_codes: bool = False  # stores a GGUF tensor's codes as they are (QLinear.set_codes)
    # raised whenever what its built models hold changes (the cache's file name). int4 r1 and int8 r1: the
    # dense copy is derived at load, not stored; int4's codes are stored in a layout every CPU loads.
    # w4a8 r2: its wider layers and head in 8-bit groups; r3: its Q4_K layers in super-blocks (k4a8);
    # r4: its Q6_K layers in 6-bit groups (k6a8); r5: its Q5_0 layers in 5-bit groups (q5a8)
    revision: int | None = None
    head: str | None = None  # the unembedding's format under this one, where it differs
    # rows from which a layer multiplies by a dense copy of its weight in the activation dtype instead
    # of its own kernel (CPU); the copy is resident beside the codes (QLinear.resident_bytes). None: no copy
    wide_rows: int | None = None
    whole_only: str | None = None  # in a layer fused with parts of other GGUF types: this format instead

    @property
    def kv_bytes(self) -> float:
        """Bytes per cached key or value element: the model's activation dtype (fp32 for the batch-invariant
        formats under their fixed-order attention, float64 where that kernel does not build:
        models/fixed_attention.py)."""
        return 4.0 if self.activation == "fp32" else 2.0


# narrowest first: a layer fused from parts of several GGUF types takes the widest part's format
_TABLE = (
    WeightFormat("int4", "specstack.models.dense_copy_methods:Int4Method", 0.5 + 4 / 32, "bf16",
                 "4-bit codes, a bf16 scale and zero per 32 inputs (torch's int4 kernels)",
                 takes_codes=True, revision=1, head="int8", wide_rows=10),
    WeightFormat("k4a8", "specstack.models.group_methods:K4A8Method", 0.5 + 8 / 256 + 2 / 32, "fp32",
                 "GGUF Q4_K: 4-bit codes, 6-bit scale and min per 32, fp32 D and M per 256; int8 activations",
                 requested=False, batch_invariant=True, cpu_only=True, takes_codes=True),
    WeightFormat("w4a8", "specstack.models.group_methods:W4A8Method", 0.5 + 8 / 32, "fp32",
                 "4-bit codes, an fp32 scale and min per 32 inputs; activations in int8 per 32 at run time",
                 batch_invariant=True, cpu_only=True, takes_codes=True, revision=5, head="q8a8"),
    WeightFormat("q5a8", "specstack.models.group_methods:Q5A8Method", 5 / 8 + 4 / 32, "fp32",
                 "GGUF Q5_0: 5-bit codes, an fp32 scale per 32 inputs (fp16 where exact, wide layout); int8 activations",
                 requested=False, batch_invariant=True, cpu_only=True, takes_codes=True, whole_only="q8a8"),
    WeightFormat("k6a8", "specstack.models.group_methods:K6A8Method", 0.75 + 1 / 16 + 4 / 256, "fp32",
                 "GGUF Q6_K: 6-bit codes, an int8 scale per 16, fp32 D per 256; int8 activations",
                 requested=False, batch_invariant=True, cpu_only=True, takes_codes=True, whole_only="q8a8"),
    WeightFormat("int8", "specstack.models.dense_copy_methods:Int8Method", 1.0, "bf16",
                 "int8 codes, a scale per output row (torch's int8 kernel)", revision=1, wide_rows=5),
    WeightFormat("q8a8", "specstack.models.group_methods:Q8A8Method", 1.0 + 4 / 32, "fp32",
                 "int8 codes, an fp32 scale per 32 inputs (GGUF Q8_0); int8 activations",
                 requested=False, batch_invariant=True, cpu_only=True),
    WeightFormat("w8a8", "specstack.models.linear_methods:W8A8Method", 1.0, "fp32",
                 "int8 codes, an fp32 scale per output row; activations in int8 per row at run time",
                 batch_invariant=True, cpu_only=True),
    WeightFormat("bf16", "specstack.models.linear_methods:FloatMethod", 2.0, "bf16", "bf16 floats", floats=True),
    WeightFormat("fp32", "specstack.models.linear_methods:FloatMethod", 4.0, "fp32", "fp32 floats", floats=True),
)
FORMATS: Mapping[str, WeightFormat] = {f.name: f for f in _TABLE}
# the formats a model may be asked for (--dtype), narrowest first
WEIGHT_FORMATS: tuple[str, ...] = tuple(f.name for f in _TABLE if f.requested)


# the format a model gets by default per device where nothing better is found: int4 on CPU (where w4a8's
# kernels do not build: models/quant.default_format), bf16 (the plain fast format) on CUDA
FALLBACK_FORMAT = {"cpu": "int4", "cuda": "bf16"}


def weight_format(name: str) -> WeightFormat:
    """The row of `name`, or a clear error naming the formats there are."""
    try:
        return FORMATS[name]
    except KeyError:
        raise SpecstackError(f"unsupported weight format {name!r}; choose from {', '.join(WEIGHT_FORMATS)}") from None


def requested_format(name: str, what: str = "weight format") -> WeightFormat:
    """The row of a format a model (or a draft: `what`) may be asked for, or a clear error."""
    spec = FORMATS.get(name)
    if spec is None or not spec.requested:
        raise SpecstackError(f"unsupported {what} {name!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    return spec


def head_format(name: str) -> str:
    """The unembedding's format in a model asked for `name`: a 4-bit head costs visible logit fidelity,
    so GGUF files keep it in 8 bits (Q8_0 / Q6_K) and so do int4 (int8) and w4a8 (its 8-bit groups)."""
    return weight_format(name).head or name


def widest(names: set[str]) -> str:
    """The widest of these formats (the table's order): what a fused layer of several GGUF types takes."""
    order = list(FORMATS)
    return max(names, key=order.index)
