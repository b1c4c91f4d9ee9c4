"""τ as `specstack throughput --tau` takes it: tokens emitted per speculation round, for each draft
design. Given as one number for every design, as `design=value` pairs, or as `auto` (alone or beside
pairs: `auto,spire=3.401`), which measures τ with the engine (measure_tau.py) for the designs it
can draft with untrained: MEASURABLE.

Torch-free, so the command's cheap checks never load the engine.
"""
from __future__ import annotations

from specstack.errors import SpecstackError
from specstack.throughput.model import DESIGNS, check_tau

# The designs `--tau auto` measures (measure_tau.DRAFTERS builds their drafters): a vanilla chain from
# --draft and MagicDec (the target behind a sliding-window KV) exist without training.
MEASURABLE = ("vanilla", "magicdec")
# Why the others are not measured: said where `auto` is asked for one, and where its τ is missing.
NOT_MEASURABLE = {"spire": "a SPIRe draft has a τ only once trained: `specstack draft-acceptance` measures a "
                           "trained one"}


def parse_tau(text: str, designs: list[str], k: int) -> tuple[dict[str, float], list[str]]:
    """(the τ given per design, the designs to measure), from `--tau`. `auto` alone measures every
    design among `designs` that it can; a value given for a design wins over `auto`."""
    given: dict[str, float] = {}
    auto: list[str] = []
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SpecstackError("--tau is empty: give a number, design=value pairs, or auto")

    def value(design: str, raw: str) -> None:
        if raw == "auto":
            if design not in MEASURABLE:
                raise SpecstackError(f"--tau {design}=auto: --tau auto cannot run a {design} draft "
                                     f"({NOT_MEASURABLE[design]}); give its τ")
            auto.append(design)
            return
        try:
            tau = float(raw)
        except ValueError:
            raise SpecstackError(f"--tau: {raw!r} is not a number") from None
        check_tau(tau, k)
        given[design] = tau

    for item in items:
        name, eq, raw = item.partition("=")
        name = name.strip()
        if not eq:
            if name == "auto":
                auto += [d for d in designs if d in MEASURABLE]
            else:
                for d in designs:
                    value(d, name)
            continue
        if name not in DESIGNS:
            raise SpecstackError(f"--tau: unknown design {name!r}; choose from {', '.join(DESIGNS)}")
        value(name, raw.strip())
    auto = [d for d in dict.fromkeys(auto) if d not in given and d in designs]
    return given, auto


def missing_tau_note(design: str) -> str:
    """What to tell the user about a design left out for want of a τ."""
    why = f"{NOT_MEASURABLE[design]}; " if design in NOT_MEASURABLE else ""
    return f"{design}: left out, no τ ({why}give it as --tau ...,{design}=T)"
