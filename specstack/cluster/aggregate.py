"""Prometheus text from many replicas: summed into one server's view, or side by side with a label.

`/metrics` through the proxy answers `merge`: the series one server would have, each the sum over the
live replicas (counters, histogram buckets, gauges such as rows running and resident memory), so the
dashboards and `bench-serve` that read one server read N replicas unchanged. `label` keeps every
replica's own series, told apart by a `replica` label (`/metrics/replicas`). A sample that is a time
(`*_created`, `process_start_time_seconds`) is the earliest, not a sum.
"""
from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

REPLICA_LABEL = "replica"
_EARLIEST = ("_created", "process_start_time_seconds")

Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, its labels in order


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _line(name: str, labels: tuple[tuple[str, str], ...], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} {floatToGoString(value)}" if inner else f"{name} {floatToGoString(value)}"


def _families(texts: Mapping[str, str], label: bool):
    """(family name, type, help) -> {sample key: value}, in first-seen order."""
    out: dict[tuple[str, str, str], dict[Key, float]] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            samples = out.setdefault((fam.name, fam.type, fam.documentation), {})
            for s in fam.samples:
                labels = tuple(s.labels.items()) + (((REPLICA_LABEL, replica),) if label else ())
                key = (s.name, labels)
                if key not in samples:
                    samples[key] = s.value
                elif s.name.endswith(_EARLIEST):
                    samples[key] = min(samples[key], s.value)
                else:
                    samples[key] += s.value
    return out


def _render(families) -> bytes:
    lines = []
    for (name, kind, doc), samples in families.items():
        typed = name + "_total" if kind == "counter" else name  # as prometheus_client writes it
        lines.append(f"# HELP {typed} {doc}")
        lines.append(f"# TYPE {typed} {kind}")
        lines.extend(_line(n, labels, v) for (n, labels), v in samples.items())
    return ("\n".join(lines) + "\n").encode()


def merge(texts: Mapping[str, str]) -> bytes:
    """One server's exposition: every series summed over the replicas (`texts`: replica -> its /metrics)."""
    return _render(_families(texts, label=False))


def label(texts: Mapping[str, str]) -> bytes:
    """Every replica's own series, with a `replica` label naming it."""
    return _render(_families(texts, label=True))
