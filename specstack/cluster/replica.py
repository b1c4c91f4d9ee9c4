"""One Ray Serve replica: a whole `specstack serve` (engine thread, OpenAI routes) inside a Ray actor.

A replica is the single server's parts, built by the same `load_engine` from the same flags, so N
replicas answer exactly as one server would. What a replica adds:
- **Pinned cores.** Ray gives each replica `--threads` CPUs of its node (`num_cpus`) but does not say
  which, and two torch thread pools on one core halve each other. The replica with local rank r on its
  node (Ray Serve's per-node rank, reused when a replica is replaced) pins every thread of its process to
  cores r*threads .. r*threads+threads-1 of the node, before torch starts its thread pool.
- **`/health`, `/metrics` for all replicas.** Any replica may get the request, so each publishes a
  Snapshot to the board (board.py) and answers from everyone's: `/metrics` summed as one server's,
  `/metrics/replicas` side by side, `/health` listing each replica with its rows in flight.
- **Ray Serve's health hook.** `check_health` fails when the engine thread has died, so Ray replaces
  the replica.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from specstack.cluster.aggregate import label, merge
from specstack.cluster.board import NAMESPACE, PUBLISH_PERIOD, Snapshot
from specstack.server.app import ServerState, create_app
from specstack.server.loader import load_engine
from specstack.server.metrics import ServerMetrics


def cores_for(available: Sequence[int], threads: int, local_rank: int) -> tuple[int, ...]:
    """The cores of replica `local_rank` on a node whose usable cores are `available`: `threads` of them,
    its own while replicas x threads fit the node, shared round the ring beyond (Ray's num_cpus keeps a
    node from taking more replicas than its CPUs, unless it was started claiming more CPUs than it has)."""
    cores = sorted(available)
    start = local_rank * threads
    return tuple(sorted({cores[(start + i) % len(cores)] for i in range(threads)}))


def pin(cores: Sequence[int]) -> None:
    """Pin every thread this process has to `cores`; threads started later (torch's pool) inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass


class Replica:
    """Wrapped by `serve.ingress()` (deploy.py): Ray builds it on a replica's actor, then serves the app
    that `__serve_build_asgi_app__` returns."""

    def __init__(self, args: argparse.Namespace, dtype: str, board: str) -> None:
        import ray
        from ray import serve

        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        threads = args.threads or 1
        self.cores = cores_for(os.sched_getaffinity(0), threads, context.rank.local_rank)
        pin(self.cores)
        self.args = argparse.Namespace(**{**vars(args), "threads": threads})
        model_id = args.served_model_name or args.model
        self.state = ServerState(model_id, args.api_key, ServerMetrics(model_id))
        load_engine(self.args, dtype, self.state)
        self.node = ray.util.get_node_ip_address()
        self.board = ray.get_actor(board, namespace=NAMESPACE)
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="specstack-publish", daemon=True)
        self._publisher.start()

    # -- Ray Serve's hooks ----------------------------------------------------------------------------
    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.state, routes=self._routes)

    def check_health(self) -> None:
        """Ray calls this every few seconds; raising makes it replace the replica."""
        worker = self.state.worker
        if worker is None or not worker.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:  # a graceful stop (serve.delete, a scale-down): leave the board now
        stop = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        try:
            self.board.forget.remote(self.replica)
        except Exception:  # Ray is shutting down under us
            pass
        if self.state.worker is not None:
            self.state.worker.stop()

    # -- publishing -----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        worker = self.state.worker
        status = "ok" if worker is not None and worker.alive else "engine stopped"
        return Snapshot(self.replica, self.node, os.getpid(), self.cores, status,
                        worker.in_flight if worker else 0, self.state.metrics.render().decode())

    def _publish_loop(self) -> None:
        while not self._stop.wait(PUBLISH_PERIOD):
            try:
                self.board.publish.remote(self.snapshot())
            except Exception:  # the board is gone: the serve process is stopping
                return

    async def everyone(self) -> list[Snapshot]:
        """Every live replica's snapshot, this one's fresh."""
        await self.board.publish.remote(self.snapshot())
        return await self.board.live.remote()

    def _routes(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health() -> JSONResponse:
            snaps = await self.everyone()
            own = next(s for s in snaps if s.replica == self.replica)
            body = {"status": own.status, "replica": self.replica,
                    "replicas": [{k: v for k, v in asdict(s).items() if k != "metrics"} for s in snaps]}
            return JSONResponse(body, status_code=200 if own.status == "ok" else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            snaps = await self.everyone()
            text = await asyncio.to_thread(merge, {s.replica: s.metrics for s in snaps})
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        @app.get("/metrics/replicas")
        async def metrics_by_replica() -> Response:
            snaps = await self.everyone()
            text = await asyncio.to_thread(label, {s.replica: s.metrics for s in snaps})
            return Response(text, media_type=CONTENT_TYPE_LATEST)
