"""The hardware a throughput model runs on, by what `--hardware` names: a built-in preset
(model.PRESETS), `local` (this machine's preset, written by `specstack throughput-calibrate` into the
specstack cache) or a calibration JSON file (calibrate.Calibration.to_json).

Torch-free, so the command's cheap checks (an unknown name, a missing file) never load the engine.
"""
from __future__ import annotations

import json
from pathlib import Path

from specstack.errors import SpecstackError
from specstack.throughput.model import PRESETS, Hardware

LOCAL = "local"  # --hardware local: the preset written by throughput-calibrate


def local_path() -> Path:
    """Where throughput-calibrate writes this machine's preset by default."""
    # deferred: models.loading (which owns the cache folder) imports torch; only `local` needs it
    from specstack.models.loading import cache_root

    return cache_root() / "hardware" / f"{LOCAL}.json"


def load_hardware(spec: str) -> Hardware:
    """A preset name, `local` (this machine's calibration) or a calibration JSON file."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = local_path() if spec == LOCAL else Path(spec).expanduser()
    if not path.is_file():
        if spec == LOCAL:
            raise SpecstackError(f"no calibration of this machine at {path}: run `specstack throughput-calibrate`")
        raise SpecstackError(f"unknown hardware {spec!r}: use one of {', '.join([*PRESETS, LOCAL])} "
                             "or a calibration JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecstackError(f"cannot read the hardware file {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("hardware"), dict):
        raise SpecstackError(f"{path} is not a calibration file (no 'hardware' object)")
    return Hardware.from_json(data["hardware"])
