"""w4a8's layer formats (models/w4a8.py: w4a8, q8a8, k4a8, q5a8, k6a8) as methods of
models/linear_methods.py: codes in groups of 32 times activations rounded per row and group at run time,
on the kernel path this process chose."""
from __future__ import annotations

import torch

from specstack.errors import SpecstackError
from specstack.models import w4a8, w4a8_codes, w4a8_wide
from specstack.models.bound import Forward
from specstack.models.coded import CodedWeight, Q4Weight, Q5Weight, Q6Weight
from specstack.models.linear_methods import QLinear, W8A8Method


class GroupMethod(W8A8Method):
    """One of w4a8's layer formats (models/w4a8.py): codes in groups of 32 times activations quantised per
    row and group at run time; its op (w4a8.OPS) takes the codes, the scales and a third tensor (mins or
    sub-block scales) where the format has one."""

    third: str | None = None  # the name of the third tensor
    block = w4a8.GROUP  # in_features must be a multiple of it
    kernel_table = staticmethod(w4a8.kernel_for)

    @property
    def step_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("weight", "scales") + ((self.third,) if self.third else ())

    def create(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        if k % self.block:
            raise SpecstackError(f"{self.spec.name} needs in_features divisible by {self.block}, got {k}")
        self.create_tensors(layer, n, k, device)
        layer.wide_layout = False  # whether the tensors are in the wide layout now (models/w4a8_wide.py)

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        raise NotImplementedError

    # -- filling: the layers' own layout first, then the running path's (`after_load`) -------------------
    def set_float(self, layer: QLinear, w: torch.Tensor) -> None:
        self._own_layout(layer)
        self.fill_float(layer, w)
        self.after_load(layer)

    def set_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        self._own_layout(layer)
        self.fill_codes(layer, coded)
        self.after_load(layer)

    @staticmethod
    def _own_layout(layer: QLinear) -> None:
        """Ready to be filled in the layers' own layout: fp32 scales again where the wide layout held fp16
        (w4a8_wide.HALF_SCALES; filling them as they are would round the new scales to fp16)."""
        layer.wide_layout = False
        if layer.scales.dtype != torch.float32:
            layer.scales = torch.empty_like(layer.scales, dtype=torch.float32)

    def fill_float(self, layer: QLinear, w: torch.Tensor) -> None:
        raise NotImplementedError

    def fill_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        self.fill_float(layer, coded.dequantize().to(layer.weight.device))

    def after_load(self, layer: QLinear) -> None:
        """Rearrange the tensors into the wide layout where this process's path keeps them so."""
        if layer.wide_layout or not self._wide_here(layer):
            return
        self._put(layer, w4a8_wide.to_wide(self.spec.name, *self.stored(layer)))
        layer.wide_layout = True
        layer.unbind()

    def _wide_here(self, layer: QLinear) -> bool:
        dev = layer.weight.device
        return (dev.type == "cpu" and w4a8.kernel_for(dev).name in w4a8.WIDE_PATHS
                and w4a8_wide.fits(self.spec.name, layer.out_features, layer.in_features))

    @staticmethod
    def _wide_suffix(layer: QLinear) -> str:
        """The suffix of the wide ops this process's path runs (a layer in the wide layout is on one)."""
        return w4a8.WIDE_PATHS.get(w4a8.kernel_for(layer.weight.device).name, "")

    def _named(self, tensors: tuple[torch.Tensor | None, ...]) -> list[tuple[str, torch.Tensor]]:
        """(buffer name, tensor) of the format's tensors (the third is None in the formats without one)."""
        return [(name, t) for name, t in zip(self.step_tensors, tensors, strict=False) if t is not None]

    def _put(self, layer: QLinear, tensors: tuple[torch.Tensor | None, ...]) -> None:
        for name, t in self._named(tensors):
            if getattr(layer, name).dtype == t.dtype:
                getattr(layer, name).copy_(t)
            else:  # the wide layout's fp16 scales (w4a8_wide.HALF_SCALES) take the buffer's place
                setattr(layer, name, t.contiguous())

    # -- reading ---------------------------------------------------------------------------------------
    def stored(self, layer: QLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's tensors as they are (the wide layout where `layer.wide_layout`)."""
        return layer.weight, layer.scales, None if self.third is None else getattr(layer, self.third)

    def tensors(self, layer: QLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer's tensors in the layers' own layout (models/w4a8.py), whatever the running path's."""
        if not layer.wide_layout:
            return self.stored(layer)
        return w4a8_wide.from_wide(self.spec.name, *self.stored(layer), layer.in_features)

    def op(self, layer: QLinear) -> tuple[str | None, list[torch.Tensor]]:
        """The qualified name of the C++ op that runs this layer here and its tensors (None: no one op does,
        the reference or a wide path's padded copy)."""
        tensors = [t for t in self.stored(layer) if t is not None]
        if layer.wide_layout:
            return w4a8_wide.op_name(self.spec.name, self._wide_suffix(layer)), tensors
        if w4a8.kernel_for(layer.weight.device).name in w4a8.WIDE_PATHS:
            return None, tensors
        return w4a8.op_name(self.spec.name, layer.weight.device), tensors

    def kernel(self, layer: QLinear) -> Forward:
        if layer.wide_layout:
            return w4a8_wide.kernel(self.spec.name, *self.stored(layer), self._wide_suffix(layer))
        return w4a8.kernel_for(layer.weight.device).build(self.spec.name, *self.stored(layer))

    def float_weight(self, layer: QLinear) -> torch.Tensor:
        return w4a8.dequantize(self.spec.name, *self.tensors(layer))

    def take_rows(self, layer: QLinear, out: QLinear, rows: torch.Tensor) -> None:
        self._own_layout(out)
        self._put(out, tuple(None if t is None else t.index_select(0, rows) for t in self.tensors(layer)))
        self.after_load(out)

    # -- the built-model cache stores the layers' own layout ----------------------------------------------
    def to_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        if layer.wide_layout:
            for name, t in self._named(self.tensors(layer)):
                state[prefix + name] = t

    def from_portable(self, layer: QLinear, state: dict[str, torch.Tensor], prefix: str) -> None:
        if prefix + "weight" in state:
            self._own_layout(layer)  # the load writes the layers' own layout; after_load rearranges it


class W4A8Method(GroupMethod):
    """4-bit codes with an fp32 step and minimum per group (GGUF Q4_0, Q4_1 and Q4_K as they are)."""

    third = "mins"

    def slow_layer_formats(self) -> frozenset[str]:
        return w4a8.slow_layer_formats()

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))
        layer.register_buffer("mins", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))

    def fill_float(self, layer: QLinear, w: torch.Tensor) -> None:
        self.fill_codes(layer, Q4Weight(*w4a8.quantize_weight(w)))

    def fill_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q4Weight):
            return super().fill_codes(layer, coded)
        # the codes as they are, d and m in fp32 (exact for GGUF's fp16 and 6-bit scales)
        layer.weight.copy_(w4a8_codes.pack_codes(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.d.float())
        layer.mins.copy_(coded.m.float())


class Q8A8Method(GroupMethod):
    """8-bit codes with an fp32 scale per group (GGUF Q8_0's layout): w4a8's wider layers and its head."""

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k, dtype=torch.int8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // w4a8.GROUP, dtype=torch.float32, device=device))

    def fill_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, d = w4a8.quantize_weight8(w)
        layer.weight.copy_(codes)
        layer.scales.copy_(d)


class Q5A8Method(GroupMethod):
    """GGUF Q5_0's 5-bit codes with an fp32 scale per 32 (fp16 in the wide layout where exact): w = d (c - 16)."""

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        groups = k // w4a8.GROUP
        layer.register_buffer("weight", torch.empty(n, w4a8_codes.five_row_bytes(groups), dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, groups, dtype=torch.float32, device=device))

    def fill_float(self, layer: QLinear, w: torch.Tensor) -> None:
        self.fill_codes(layer, Q5Weight(*w4a8.quantize_weight5(w)))

    def fill_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q5Weight):
            raise ValueError("q5a8 takes 5-bit codes with their scales (GGUF Q5_0)")
        layer.weight.copy_(w4a8_codes.pack_codes5(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.d.float())


class K4A8Method(GroupMethod):
    """GGUF Q4_K's codes with its super-block scales: (D, M) fp32 per 256, 6-bit (sc, mn) per 32."""

    third = "subscales"
    block = w4a8.GROUP * w4a8.SUPER

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // self.block, 2, dtype=torch.float32, device=device))
        layer.register_buffer("subscales", torch.empty(n, 2, k // w4a8.GROUP, dtype=torch.uint8, device=device))

    def fill_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, sup, sub = w4a8.quantize_weight_k(w)
        self.fill_codes(layer, Q4Weight(codes, *w4a8.expand_scales(sup, sub), sup, sub))

    def fill_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q4Weight) or coded.sup is None or coded.sub is None:
            raise ValueError("k4a8 takes 4-bit codes with their super-blocks (GGUF Q4_K)")
        layer.weight.copy_(w4a8_codes.pack_codes(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.sup.float())
        layer.subscales.copy_(coded.sub)


class K6A8Method(GroupMethod):
    """GGUF Q6_K's 6-bit codes with an int8 scale per 16 and D per 256."""

    third = "subscales"
    block = w4a8.GROUP * w4a8.SUPER

    def create_tensors(self, layer: QLinear, n: int, k: int, device: torch.device | str | None) -> None:
        layer.register_buffer("weight", torch.empty(n, k * 3 // 4, dtype=torch.uint8, device=device))
        layer.register_buffer("scales", torch.empty(n, k // self.block, dtype=torch.float32, device=device))
        layer.register_buffer("subscales", torch.empty(n, k // w4a8.SIX_SUB, dtype=torch.int8, device=device))

    def fill_float(self, layer: QLinear, w: torch.Tensor) -> None:
        codes, big, s16 = w4a8.quantize_weight6(w)
        self.fill_codes(layer, Q6Weight(codes, s16, big))

    def fill_codes(self, layer: QLinear, coded: CodedWeight) -> None:
        if not isinstance(coded, Q6Weight):
            raise ValueError("k6a8 takes 6-bit codes with their scales (GGUF Q6_K)")
        layer.weight.copy_(w4a8_codes.pack_codes6(coded.q.to(layer.weight.device)))
        layer.scales.copy_(coded.d)
        layer.subscales.copy_(coded.s)
