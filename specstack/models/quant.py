"""The linear layer every model is built of, in any weight format of the table
(specstack/weight_formats.py); what each format stores and runs is its method's
(models/linear_methods.py), so this module holds no format's knowledge.

Also here: the stats line's name of a format, and the rule w4a8's plan follows on this CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from specstack.models.bound import BoundModule, Forward
from specstack.models.coded import CodedWeight, Q4Weight, Q6Weight
from specstack.models.linear_methods import activation_dtype, method_for, native_bf16
from specstack.weight_formats import FALLBACK_FORMAT, weight_format

__all__ = ["QLinear", "Q4Weight", "Q6Weight", "CodedWeight", "activation_dtype", "native_bf16",
           "weights_label", "slow_layer_formats", "layout_variant", "default_format"]


def weights_label(fmt: str, device: torch.device) -> str:
    """The weight format as a stats line names it: with its kernel path where it has a table of them
    (the batch-invariant formats: the path a process runs is its numbers' last bit)."""
    table = method_for(fmt).kernel_table
    return fmt if table is None or device.type != "cpu" else f"{fmt} ({table(device).name} kernels)"


def slow_layer_formats(fmt: str) -> frozenset[str]:
    """The layer formats a model asked for in `fmt` plans as their `whole_only` format instead, because
    this process's kernel path runs them slowly (w4a8's narrow groups: w4a8.NARROW_PATHS)."""
    return method_for(fmt).slow_layer_formats()


def default_format(device: str) -> str:
    """The weight format when none is asked for, a target's or a draft model's: on CPU the exact format
    this CPU has a native path for, w4a8 (batch-invariant, so every method's greedy output equals ar's;
    its AVX-512-VNNI or AVX2 kernel, built once per machine on first use; its one-token step beat
    int4's where measured: docs/bench-history, "The target step"), and int4 where there is none (no
    AVX2, no compiler, a build that failed); bf16 on CUDA."""
    if device != "cpu":
        return FALLBACK_FORMAT[device]
    from specstack.models import native

    return "w4a8" if native.available("w4a8") else FALLBACK_FORMAT["cpu"]


def layout_variant(fmt: str) -> str:
    """What a built model's layout depends on besides its format's revision: whether some of its layers
    are q8a8 where the file's types would have them narrower (`slow_layer_formats`)."""
    return "q8" if slow_layer_formats(fmt) else ""


class QLinear(BoundModule):
    """y = x W^T (+ b) with W stored in a weight format (bound: see models/bound.py)."""

    # the buffers formats register, declared for the type checker: a format registers only its own
    weight: torch.Tensor  # floats, int8 codes, int4's packed layout, or w4a8's nibbles
    scales: torch.Tensor  # per row (int8, w8a8), per group of 32 (w4a8, q8a8), (D, M) or D per 256 (k4a8, k6a8)
    scales_zeros: torch.Tensor  # int4: [in / 32, out padded to 16, (scale, zero)]
    mins: torch.Tensor  # w4a8's group minimums
    subscales: torch.Tensor  # k4a8's 6-bit (sc, mn) [out, 2, in / 32], k6a8's int8 scales [out, in / 16]
    dense: torch.Tensor | None  # int8/int4: the dequantised copy wide inputs multiply by
    wide_layout: bool  # w4a8's formats: the tensors are in the wide layout (models/w4a8_wide.py)
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False,
                 device: torch.device | str | None = None, activation: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.spec = weight_format(fmt)
        self.method = method_for(fmt)
        own = activation_dtype(fmt)
        act = activation or own
        if act != own and act not in self.method.other_activations:
            raise ValueError(f"{fmt} weights compute in {own}")
        self.act_dtype = act
        self._wide_rows: int | None = self.spec.wide_rows
        self.method.create(self, out_features, in_features, device)
        if "dense" not in self._buffers:  # only the formats with a wide path keep a dense copy
            self.register_buffer("dense", None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=act, device=device) if bias else None)

    def step_bytes(self) -> int:
        """Bytes this layer's one-token kernel reads: the stored weight in its format, its scales and bias
        (not a dense copy, which only wide inputs read)."""
        parts = [getattr(self, name) for name in self.method.step_tensors]
        return sum(t.nbytes for t in (*parts, self.bias) if t is not None)

    def resident_bytes(self) -> int:
        """Bytes this layer holds in memory: everything it stores, a dense copy for wide inputs included."""
        return sum(t.nbytes for t in self.buffers())

    # -- construction -------------------------------------------------------------------------------
    @staticmethod
    def of_float(w: torch.Tensor, b: torch.Tensor | None, fmt: str, activation: torch.dtype | None = None) -> QLinear:
        """A layer in format `fmt` holding the float weight w [out, in] (and bias b), on w's device."""
        layer = QLinear(w.shape[1], w.shape[0], fmt, bias=b is not None, device=w.device, activation=activation)
        return layer.set_float(w, b)

    @torch.no_grad()
    def set_float(self, w: torch.Tensor, b: torch.Tensor | None = None) -> QLinear:
        """Quantise a float weight [out, in] into this layer's format."""
        self.method.set_float(self, w.to(self.weight.device, torch.float32))
        return self._set_bias(b)

    @torch.no_grad()
    def set_codes(self, coded: CodedWeight, b: torch.Tensor | None = None) -> QLinear:
        """Set from a GGUF tensor's own codes (models/coded.py): stored as they are by the formats that
        take them (weight_formats.WeightFormat.takes_codes), dequantised for the others."""
        self.method.set_codes(self, coded)
        return self._set_bias(b)

    def set_int4(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, sup: torch.Tensor | None = None,
                 sub: torch.Tensor | None = None) -> QLinear:
        """Set from 4-bit codes q [out, in] (0..15) with w = d * q + m per group of 32 (GGUF Q4_1), and for
        GGUF Q4_K also the super-blocks d and m come from (sup, sub: see Q4Weight)."""
        return self.set_codes(Q4Weight(q, d, m, sup, sub))

    def set_int6(self, q: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> QLinear:
        """Set from GGUF Q6_K's codes q [out, in] (0..63), int8 scales s [out, in / 16] and D [out, in / 256]."""
        return self.set_codes(Q6Weight(q, s, d))

    @torch.no_grad()
    def take_rows(self, rows: torch.Tensor) -> QLinear:
        """A layer of the same format over output rows `rows` of this one: the very codes and scales, so
        each kept output is what this layer computes for it (bit for bit in the batch-invariant formats)."""
        out = QLinear(self.in_features, rows.numel(), self.fmt, bias=self.bias is not None, device=self.weight.device,
                      activation=self.act_dtype)
        self.method.take_rows(self, out, rows.to(self.weight.device))
        out.wide_rows = self.wide_rows
        return out._set_bias(None if self.bias is None else self.bias.index_select(0, rows))

    def _set_bias(self, b: torch.Tensor | None) -> QLinear:
        if b is not None:
            if self.bias is None:
                raise ValueError("a bias given to a layer built without one (bias=False)")
            self.bias.copy_(b.to(self.bias.device, self.bias.dtype))
        self.unbind()  # a binding holds the tensors it was made from (see bind)
        return self

    # -- the built-model cache: it stores what any CPU loads (the method's portable form) ------------
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self.method.to_portable(self, destination, prefix)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        self.method.from_portable(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "weight" in state_dict:
            with torch.no_grad():
                self.method.after_load(self)

    # -- use ----------------------------------------------------------------------------------------
    @property
    def wide_rows(self) -> int | None:
        """Rows from which a format with a dense copy multiplies by it (None: its own kernel at every width)."""
        return self._wide_rows

    @wide_rows.setter
    def wide_rows(self, rows: int | None) -> None:
        self._wide_rows = rows
        self.unbind()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return super().forward(x)
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)

    def bind(self, bias: bool = True, wide: bool = True) -> Forward:
        """x [M, in] -> y [M, out]: the format's kernel, or a dense copy from `wide_rows` rows."""
        return self.method.bind(self, self.bias if bias else None, wide)

    def float_weight(self) -> torch.Tensor:
        """The weight as floats [out, in], as the kernel sees it, without a forward where the format can."""
        return self.method.float_weight(self)

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] the small-format kernel computes with (for tests and conversions)."""
        eye = torch.eye(self.in_features, dtype=self.act_dtype, device=self.weight.device)
        return self.bind(bias=False, wide=False)(eye).float().t().contiguous()

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fmt={self.fmt}, bias={self.bias is not None}"
