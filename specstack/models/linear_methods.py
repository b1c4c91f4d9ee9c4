"""How a layer in each weight format stores, fills and runs its weight: one method object per format
(vLLM's `LinearMethodBase`), named by the format's row in specstack/weight_formats.py.

A method registers the layer's tensors (`create`: persistent buffers, which is what the built-model cache
stores), fills them from floats (`set_float`) or from a GGUF tensor's own codes (`set_codes`, for the
formats that take codes; the others receive the codes dequantised), and builds the layer's forward
(`bind`). `QLinear` (models/quant.py) is the module around them and holds no format's knowledge.

Here: the base class, the float formats and w8a8; int8 and int4 (torch's kernels, with a dense copy for
wide inputs) are in models/dense_copy_methods.py, w4a8's layer formats in models/group_methods.py.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from specstack.models import w8a8
from specstack.models.bound import Forward
from specstack.models.coded import CodedWeight
from specstack.models.kernel_table import LinearKernels
from specstack.weight_formats import WeightFormat, weight_format


class QLinear(Protocol):
    """What a method sees of its layer (models/quant.py's QLinear): the module its tensors are registered on."""

    weight: torch.Tensor
    scales: torch.Tensor
    scales_zeros: torch.Tensor
    mins: torch.Tensor
    subscales: torch.Tensor
    dense: torch.Tensor | None
    wide_layout: bool
    act_dtype: torch.dtype
    out_features: int
    in_features: int

    @property
    def wide_rows(self) -> int | None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...

    def dequantized(self) -> torch.Tensor: ...

    def unbind(self) -> None: ...



ACTIVATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 / AMX). Without it (AVX2), a bf16 GEMM
    is emulated and costs several times fp32 (docs/bench-history, "Batched decoding"): wide inputs
    then multiply in fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def activation_dtype(fmt: str) -> torch.dtype:
    """The dtype a format's layers take and return (the model around them computes in it)."""
    return ACTIVATION_DTYPES[weight_format(fmt).activation]


class LinearMethod:
    """One weight format's storage and forward. Subclasses register their tensors in `create` and
    say how to fill and run them; `spec` is the format's row of the table."""

    # the activation dtypes a layer may take besides the format's own (int8/int4's kernels take fp32 too)
    other_activations: tuple[torch.dtype, ...] = ()
    # the tensors a one-token forward reads, besides the bias (QLinear.step_bytes)
    step_tensors: tuple[str, ...] = ("weight",)
    # a format with several kernel paths: its table (models/kernel_table.py), one path chosen per process
    kernel_table: Callable[[torch.device], LinearKernels] | None = None

    def __init__(self, spec: WeightFormat) -> None:
        self.spec = spec

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        raise NotImplementedError

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        """Quantise a float weight [out, in] (fp32, on the layer's device) into the layer's tensors."""
        raise NotImplementedError

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        """A GGUF tensor's codes: stored as they are by the formats that take them, dequantised otherwise."""
        self.set_float(layer, coded.dequantize().to(layer.weight.device))

    def kernel(self, layer: QLinear) -> Forward:
        """x [M, in] -> y [M, out] without the bias, by the format's own kernel."""
        raise NotImplementedError

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        mm = self.kernel(layer)
        return mm if bias is None else (lambda x: mm(x) + bias)

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        """The weight as floats [out, in], as the kernel sees it, without a forward."""
        raise NotImplementedError

    def slow_layer_formats(self) -> frozenset[str]:
        """Layer formats a model asked for in this format plans as their `whole_only` instead in this
        process (its kernel path runs them slowly)."""
        return frozenset()

    def take_rows(self, layer: QLinear, out: QLinear, rows: torch.Tensor) -> None:
        """Fill `out` (a layer of this format with len(rows) outputs) with `layer`'s output rows `rows`:
        the very codes and scales. Here every stored tensor holds an output row per index of its first
        axis; a format whose layout does not says how instead."""
        for name in self.step_tensors:
            getattr(out, name).copy_(getattr(layer, name).index_select(0, rows))
        self.after_load(out)

    # -- the built-model cache: it stores what any CPU can load, a method repacks for the running one --
    def to_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Rewrite the layer's entries of a state dict being saved into the form the cache stores."""

    def from_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Rewrite the cache's form of the layer's entries, before they are loaded, into this CPU's layout."""

    def after_load(self, layer: QLinear) -> None:
        """Derive what the cache does not store (a dense copy) once the stored tensors are loaded."""


class FloatMethod(LinearMethod):
    """fp32 and bf16: the weight itself, torch's matmul."""

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=layer.act_dtype, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        layer.weight.copy_(w)

    def kernel(self, layer: QLinear) -> Forward:
        w = layer.weight
        return lambda x: F.linear(x, w)

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        w = layer.weight
        return lambda x: F.linear(x, w, bias)

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return layer.weight


class W8A8Method(LinearMethod):
    """int8 codes per output channel times activations quantised per row at run time (models/w8a8.py)."""

    step_tensors = ("weight", "scales")
    kernel_table = staticmethod(w8a8.kernel_for)

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
        layer.register_buffer("scales", torch.empty(n, dtype=torch.float32, device=device))

    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, scale = w8a8.quantize_weight(w)
        layer.weight.copy_(codes)
        layer.scales.copy_(scale)

    def kernel(self, layer: QLinear) -> Forward:
        return w8a8.kernel_for(layer.weight.device).build(layer.weight, layer.scales)

    def bind(self, layer: QLinear, bias: torch.Tensor | None, wide: bool) -> Forward:
        mm = self.kernel(layer)  # the same kernel at every width: that is what keeps rows invariant
        return mm if bias is None else (lambda x: mm(x).add_(bias))

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return layer.weight.float() * layer.scales[:, None]


@functools.cache
def method_for(fmt: str) -> LinearMethod:
    """The method object of a format's row (weight_formats.FORMATS), its class imported on first use."""
    spec = weight_format(fmt)
    module, _, name = spec.method.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(spec)
