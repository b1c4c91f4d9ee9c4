"""A KV cache whose slots also hold a feature vector each (EAGLE-style: a SPIRe draft with feature input
reads the previous token's top-level feature, models/spire_draft.py). The features move with their
slots: rows copied or moved, tree paths committed, a window's evictions, the cache growing."""
from __future__ import annotations

import torch

from specstack.cache import KVCache, widened
from specstack.config import ModelConfig, WindowSpec


class FeatureCache(KVCache):
    def __init__(self, config: ModelConfig, batch_size: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, window: WindowSpec | None, feature_dim: int,
                 max_rows: int | None = None, max_capacity: int | None = None) -> None:
        super().__init__(config, batch_size, capacity, dtype, device, window, max_rows, max_capacity)
        self.feat = torch.zeros(self.max_rows, capacity, feature_dim, dtype=dtype, device=device)  # [rows, slots, d]

    def write_feature(self, x: torch.Tensor) -> None:
        """Store features x [B, T, feature_dim] at the current block's scratch slots."""
        if self._write_at is None:
            assert self._write_idx is not None
            self.feat[0].index_copy_(0, self._write_idx, x[0].reshape(-1, x.shape[-1]))
        else:
            self.feat[self._write_at] = x.reshape(-1, x.shape[-1])

    def block_start(self) -> list[int]:
        """First slot of the current block in each row (slots before it hold finished tokens: their
        features are final)."""
        return [n + self._offset for n in self.lengths]

    # -- the features move with their slots --------------------------------------------------------
    def reserve(self, max_rows: int) -> None:
        n, old = self.batch_size, self.feat
        super().reserve(max_rows)
        if self.max_rows > old.shape[0]:
            self.feat = old.new_zeros((self.max_rows, *old.shape[1:]))
            self.feat[:n] = old[:n]

    def _widen(self, new: int) -> None:
        super()._widen(new)
        self.feat = widened(self.feat, 1, new)

    def _copy_row(self, src: int, dst: int) -> None:
        super()._copy_row(src, dst)
        n = self.lengths[src]
        self.feat[dst, :n] = self.feat[src, :n]

    def _move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        super()._move(row, src, dst)
        self.feat[row, dst] = self.feat[row, src]
