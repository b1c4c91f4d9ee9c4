"""The board: one small Ray actor where every replica publishes what it is doing, so that any replica
can answer `/health` and `/metrics` for all of them.

Ray Serve routes each HTTP request to one replica, and a replica cannot call its siblings by name; so
each replica pushes a `Snapshot` here every `PUBLISH_PERIOD` seconds (and at once before it answers
`/metrics`), and reads everyone's back. A replica that stops publishing (killed, its node gone) drops
out after `STALE_AFTER` seconds: Prometheus scrapes every 15 s or so, so a second of lag is nothing.
The actor is named, owned by the `specstack serve` process, and dies with it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

PUBLISH_PERIOD = 1.0  # seconds between a replica's snapshots
STALE_AFTER = 3.5  # a replica unheard of for longer is gone
NAMESPACE = "specstack"


def board_name(app: str) -> str:
    return f"{app}-board"


@dataclass(frozen=True)
class Snapshot:
    """One replica as it saw itself when it published."""

    replica: str  # Ray Serve's replica id
    node: str  # the node's IP address
    pid: int
    cores: tuple[int, ...]  # the CPUs its threads are pinned to
    status: str  # "ok", or what is wrong
    rows: int  # jobs in flight: decoding or waiting for a row
    metrics: str  # its own /metrics text


class ReplicaBoard:
    """Run as a Ray actor (`ray.remote(ReplicaBoard)`); every method is one cheap call."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, Snapshot]] = {}

    def publish(self, snapshot: Snapshot) -> None:
        self._seen[snapshot.replica] = (time.monotonic(), snapshot)

    def forget(self, replica: str) -> None:
        self._seen.pop(replica, None)

    def live(self) -> list[Snapshot]:
        """The replicas heard of in the last STALE_AFTER seconds, by replica id."""
        now = time.monotonic()
        for replica, (when, _) in list(self._seen.items()):
            if now - when > STALE_AFTER:
                del self._seen[replica]
        return [s for _, s in sorted(self._seen.values(), key=lambda e: e[1].replica)]
