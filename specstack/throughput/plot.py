"""Heat-maps of the modelled multiplier over batch x context, one panel per draft design, side by side
(SPIRe Figures 1 and 4). Colours diverge at 1: red where speculation would lose throughput."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specstack.files import atomic_output
from specstack.throughput.model import Cell


def heatmap(cells: Sequence[Cell], batches: Sequence[int], contexts: Sequence[int], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    designs = list(dict.fromkeys(c.design for c in cells))
    value = {(c.design, c.batch, c.context): c.multiplier for c in cells}
    lo = min(min(value.values()), 0.99)
    hi = max(max(value.values()), 1.01)
    norm = TwoSlopeNorm(vmin=lo, vcenter=1.0, vmax=hi)
    fig, axes = plt.subplots(1, len(designs), figsize=(1.2 + 0.9 * len(contexts) * len(designs), 1.6 + 0.55 * len(batches)),
                             squeeze=False, constrained_layout=True)
    image = None
    for ax, design in zip(axes[0], designs, strict=True):
        grid = [[value[design, b, n] for n in contexts] for b in batches]
        image = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower", aspect="auto")
        tau = next(c.tau for c in cells if c.design == design)
        ax.set_title(f"{design} (τ = {tau:.3g})")
        ax.set_xticks(range(len(contexts)), [f"{n:,}" for n in contexts], rotation=45)
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("context length L")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel("batch size B")
    fig.colorbar(image, ax=axes[0].tolist(), label="throughput multiplier τ / Δt")
    fig.suptitle(title, fontsize=10)
    with atomic_output(path) as tmp:  # exactly `path`, whatever its suffix: what the command reports
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
