"""matplotlib for the bench reports: the headless backend, and PNGs written whole (renamed into place)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from specstack.files import atomic_output


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display); ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
