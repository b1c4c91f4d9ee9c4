"""w4a8's codes as its layer formats store them (models/w4a8.py defines the formats): the group and
super-block sizes, and how 4-, 5- and 6-bit codes are packed into bytes (each function's inverse beside
it). The kernel files unpack these layouts; models/w4a8_wide.py rearranges them for the wide path."""
from __future__ import annotations

from collections.abc import Mapping

import torch

GROUP = 32
SUPER = 8  # groups in a super-block of the k4a8 layer format (GGUF Q4_K's 256 weights)
SUB_LEVELS = 63  # k4a8's 6-bit sub-block scales and mins
X_LEVELS = 127
C_LEVELS = 15  # 4-bit codes 0..15
C8_LEVELS = 127  # 8-bit codes -127..127 (never -128: the kernel takes |c|)
SIX_SUB = 16  # weights under one int8 scale in k6a8 (GGUF Q6_K's sub-blocks)
SIX_OFFSET = 32  # k6a8's codes 0..63 stand for c - 32
SIX_CHUNK = 4 * GROUP  # codes a k6a8 chunk packs (4 groups: 64 bytes of nibbles, 32 of high bits)


# each layer format's C++ op (a path appends its suffix; the wide layout's library has its own namespace)
OPS: Mapping[str, str] = {"w4a8": "mm4", "q8a8": "mm8", "k4a8": "mm4k", "k6a8": "mm6k", "q5a8": "mm5"}


def pack_codes(c: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N, K / 2] uint8: in each group, byte j holds code j (low nibble) and
    code j + 16 (high nibble), the order the kernel unpacks them in."""
    n, k = c.shape
    v = c.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes`: [N, K / 2] uint8 -> codes [N, K] uint8."""
    n, half = packed.shape
    v = packed.view(n, half // (GROUP // 2), GROUP // 2)
    return torch.cat([v & 0x0F, v >> 4], dim=2).reshape(n, 2 * half)


def pack_codes6(c: torch.Tensor) -> torch.Tensor:
    """6-bit codes [N, K] (0..63, K a multiple of 128) -> [N, 3 K / 4] uint8, a chunk of 4 groups as 96
    bytes: their low nibbles as `pack_codes` packs them, then 32 bytes of the top 2 bits, byte j holding
    those of the nibble vector's positions j, j + 32 (bits 0-1, 2-3) and of the high nibbles at the same
    positions (bits 4-5, 6-7), a position p being code p % 16 (or 16 + p % 16) of the chunk's group p / 16
    (the kernel file says why)."""
    n, k = c.shape
    c = c.to(torch.uint8)
    nibbles = pack_codes(c & 0x0F).view(n, k // SIX_CHUNK, 64)
    top = (c >> 4).view(n, k // SIX_CHUNK, 2, 2, 2, GROUP // 2)  # [.., gi >> 1, gi & 1, half, j]
    plane = top[:, :, 0, :, 0] | top[:, :, 1, :, 0] << 2 | top[:, :, 0, :, 1] << 4 | top[:, :, 1, :, 1] << 6
    return torch.cat([nibbles, plane.reshape(n, k // SIX_CHUNK, 32)], dim=2).view(n, k * 3 // 4)


def unpack_codes6(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes6`: [N, 3 K / 4] uint8 -> codes [N, K] uint8."""
    n, width = packed.shape
    chunks = width // 96
    v = packed.view(n, chunks, 96)
    low = unpack_codes(v[:, :, :64].reshape(n, chunks * 64)).view(n, chunks, 2, 2, 2, GROUP // 2)
    plane = v[:, :, 64:].reshape(n, chunks, 2, GROUP // 2)  # [.., gi & 1, j]
    top = torch.stack([torch.stack([plane & 3, (plane >> 4) & 3], dim=3),
                       torch.stack([(plane >> 2) & 3, (plane >> 6) & 3], dim=3)], dim=2)
    return (low | top << 4).view(n, chunks * SIX_CHUNK)


FIVE_CHUNK = 80  # bytes of a q5a8 chunk of 4 groups: two 64-bit words of fifth bits, then the nibbles


def pack_codes5(c: torch.Tensor) -> torch.Tensor:
    """5-bit codes [N, K] (0..31) -> [N, `five_row_bytes`] uint8: each chunk of 4 groups as two 64-bit
    little-endian words of fifth bits (bit p of the first: code p % 16 of the chunk's group p / 16, of the
    second: code 16 + p % 16 of that group), then their nibbles as `pack_codes` packs them; a row's last
    groups, fewer than 4, a chunk of their own (the two words, then their nibbles)."""
    n, k = c.shape
    groups = k // GROUP
    chunks = -(-groups // 4)
    c = c.to(torch.uint8)
    nibbles = torch.zeros(n, chunks * 64, dtype=torch.uint8, device=c.device)
    nibbles[:, : k // 2] = pack_codes(c & 0x0F)
    top = torch.zeros(n, chunks * 4 * GROUP, dtype=torch.uint8, device=c.device)
    top[:, :k] = c >> 4
    halves = top.view(n, chunks, 4, 2, GROUP // 2).transpose(2, 3)  # [.., half, group, j]: position 16 g + j
    weights = (1 << torch.arange(8, dtype=torch.uint8, device=c.device))
    words = (halves.reshape(n, chunks, 2, 8, 8) * weights).sum(dim=4, dtype=torch.uint8)  # byte b: positions 8b..
    out = torch.cat([words.view(n, chunks, 16), nibbles.view(n, chunks, 64)], dim=2).view(n, chunks * FIVE_CHUNK)
    return out[:, : five_row_bytes(groups)].contiguous()


def five_row_bytes(groups: int) -> int:
    """The bytes of a row of q5a8 codes (`pack_codes5`)."""
    rest = groups % 4
    return groups // 4 * FIVE_CHUNK + (16 + 16 * rest if rest else 0)


def unpack_codes5(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes5`: [N, row bytes] uint8 -> codes [N, K] uint8."""
    n, width = packed.shape
    full, rest = divmod(width, FIVE_CHUNK)
    groups = 4 * full + (rest - 16) // 16 if rest else 4 * full
    chunks = -(-groups // 4)
    padded = torch.zeros(n, chunks * FIVE_CHUNK, dtype=torch.uint8, device=packed.device)
    padded[:, :width] = packed
    v = padded.view(n, chunks, FIVE_CHUNK)
    low = unpack_codes(v[:, :, 16:].reshape(n, chunks * 64))
    bits = (v[:, :, :16].reshape(n, chunks, 2, 8, 1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    top = bits.view(n, chunks, 2, 4, GROUP // 2).transpose(2, 3).reshape(n, chunks * 4 * GROUP)
    return (low | top << 4)[:, : groups * GROUP].contiguous()
