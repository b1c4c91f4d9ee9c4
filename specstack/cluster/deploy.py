"""`specstack serve --replicas N`: start or join Ray, deploy the replicas behind Ray Serve's HTTP proxy,
serve until Ctrl-C / SIGTERM, then take everything down.

Routing: Ray Serve's default router, power of two choices on each replica's requests in flight (it asks
two random replicas for their queue length and sends the request to the shorter). A request of this
server is one row (or n rows for `n` choices) from the moment it is taken until its last token, so
requests in flight are rows in flight; the router's count is live, where routing stats reported by
the replicas are seconds old. With 2 replicas it compares both, so the least-loaded one gets every
request. Each replica takes up to its server's capacity (`--max-batch` + `--max-queue`).

Scaling: `--replicas N` is fixed; `--replicas MIN:MAX` autoscales on requests in flight per replica
(`--target-ongoing`). Each replica asks Ray for `--threads` CPUs, so a node takes no more replicas than
it has cores for, and pins its threads to cores of its own (replica.py).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
from dataclasses import dataclass

from specstack.cluster.board import NAMESPACE, ReplicaBoard, board_name
from specstack.cluster.failover import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from specstack.errors import SpecstackError
from specstack.server.listen import bind, note, url_of

APP = "specstack"  # the Ray Serve application and deployment name
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: "0" keeps a local instance on 127.0.0.1
# What Ray's processes read from the environment (a local instance takes ours; a cluster, `ray start`'s):
# the proxy's failover middleware (failover.py), and the user's code on the replica's own event loop and
# the proxy's router on the proxy's, not on second threads: a thread hop less each way, a visible part
# of a short request's time through the proxy (docs/bench-history, "Replicas").
RAY_ENV: dict[str, str] = {PROXY_CALLBACK_ENV: PROXY_CALLBACK, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                           "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


@dataclass(frozen=True)
class ReplicaCount:
    """`--replicas`: N, or MIN:MAX to autoscale."""

    min: int
    max: int

    @property
    def fixed(self) -> bool:
        return self.min == self.max

    def __str__(self) -> str:
        return str(self.min) if self.fixed else f"{self.min}:{self.max}"


def parse_replicas(name: str, value: object) -> ReplicaCount:
    """An argparse rule (validate's shape): 'N' (1..1024) or 'MIN:MAX' with 0 <= MIN <= MAX, 1 <= MAX."""
    text = str(value).strip()
    try:
        lo, _, hi = text.partition(":")
        count = ReplicaCount(int(lo), int(hi) if hi else int(lo))
    except ValueError:
        raise SpecstackError(f"{name} {value!r}: expected N or MIN:MAX (whole numbers)") from None
    if not (0 <= count.min <= count.max and 1 <= count.max <= 1024) or (count.fixed and count.min < 1):
        raise SpecstackError(f"{name} {value!r}: need 1 <= N <= 1024, or 0 <= MIN <= MAX with 1 <= MAX <= 1024")
    return count


def deployment_options(args: argparse.Namespace, count: ReplicaCount) -> dict[str, object]:
    threads = args.threads or 1
    env = {k: v for k, v in os.environ.items() if k.startswith("SPECSTACK_")}  # the weight cache, on every node
    options: dict[str, object] = {
        "name": APP,
        "ray_actor_options": {"num_cpus": threads, "runtime_env": {"env_vars": env}},
        "max_ongoing_requests": args.max_batch + args.max_queue,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if count.fixed:
        options["num_replicas"] = count.min
    else:
        options["autoscaling_config"] = {
            "min_replicas": count.min, "max_replicas": count.max, "initial_replicas": max(count.min, 1),
            "target_ongoing_requests": args.target_ongoing or max(1, args.max_batch // 2),
            "upscale_delay_s": 5.0, "downscale_delay_s": 60.0,
        }
    return options


def check_cpus(count: ReplicaCount, threads: int, cpus: float, where: str) -> None:
    """Ray would leave replicas that do not fit pending forever: refuse them up front."""
    need = max(count.min, 1) * threads
    if need > cpus:
        fewer = "fewer replicas" + (" or threads" if threads > 1 else "")
        raise SpecstackError(f"--replicas {count} with --threads {threads} needs {need} CPUs; {where} has "
                             f"{cpus:g} ({fewer})")


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT that answers (Ray itself would retry for a minute, then abort the process)."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except ValueError:
        raise SpecstackError(f"--ray-address {address!r}: expected HOST:PORT or 'auto'") from None
    except OSError as e:
        raise SpecstackError(f"--ray-address {address}: no Ray cluster answers there ({e.strerror or e})") from None


def serve_replicas(args: argparse.Namespace, dtype: str) -> int:
    """Deploy and serve until a stop signal; the replicas, the board and (if we started it) Ray go with us."""
    if args.ray_address is None and args.host in LOOPBACK_HOSTS:  # Ray too on loopback (it would use the
        os.environ.setdefault(RAY_LOOPBACK_ENV, "0")  # node's address), so nothing listens beyond this host
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecstackError("--replicas and --ray-address need Ray Serve: pip install 'specstack[cluster]'") from None
    from specstack.cluster.replica import Replica

    count: ReplicaCount = args.replicas or ReplicaCount(1, 1)
    threads = args.threads or 1
    if os.path.exists(args.model):  # the replicas do not run in this directory
        args.model = os.path.abspath(args.model)
    if args.ray_address is not None:
        check_reachable(args.ray_address)
    else:
        from specstack.validate import available_cores

        cpus = available_cores()
        check_cpus(count, threads, cpus, "this machine")
    listener = bind(args.host, args.port)  # a busy port fails here, not after Ray and the replicas start;
    url, port = url_of(listener), listener.getsockname()[1]  # `--port 0` picks one. Ray's proxy binds it
    listener.close()
    note(f"starting Ray ({args.ray_address or 'a local instance'}) and {count} replica(s) of {args.model}")
    # Ray's processes take these from our environment (a local instance; a cluster from `ray start`'s)
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    try:
        if args.ray_address is None:
            ray.init(num_cpus=cpus, include_dashboard=False, namespace=NAMESPACE,
                     log_to_driver=args.log_level in ("info", "debug"), configure_logging=False)
        else:
            ray.init(address=args.ray_address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
            check_cpus(count, threads, ray.cluster_resources().get("CPU", 0), f"the cluster at {args.ray_address}")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SpecstackError(f"cannot start or join Ray: {e}") from None
    started_here = args.ray_address is None
    board = None
    stop = threading.Event()
    try:
        board = ray.remote(ReplicaBoard).options(name=board_name(APP), namespace=NAMESPACE, num_cpus=0,
                                                 get_if_exists=True).remote()
        serve.start(http_options={"host": args.host, "port": port},
                    logging_config={"log_level": args.log_level.upper(), "enable_access_log": False})
        deployment = serve.deployment(serve.ingress()(Replica), **deployment_options(args, count))
        serve.run(deployment.bind(args, dtype, board_name(APP)), name=APP, route_prefix="/", blocking=False)
        note(f"listening on {url} ({count} replica(s), {threads} thread(s) each, behind Ray Serve's proxy)")
        note(f"ready: {args.served_model_name or args.model} on {url}/v1 (Ray at "
             f"{ray.get_runtime_context().gcs_address})")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    except RuntimeError as e:  # a deployment that failed (a replica's constructor raised): its last line
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise SpecstackError(f"the replicas failed to start: {lines[-1] if lines else e}") from None
    finally:
        note("stopping the replicas")
        try:
            if serve.status().applications.get(APP) is not None:
                serve.delete(APP)
            if started_here:
                serve.shutdown()
            if board is not None:
                ray.kill(board)
        except Exception as e:  # noqa: BLE001 - stopping: say what failed, still shut Ray down
            note(f"while stopping: {e}")
        finally:
            if started_here:
                ray.shutdown()
    return 0
