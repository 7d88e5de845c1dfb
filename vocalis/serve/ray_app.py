"""Ray Serve deployment of the same app: `vocalis serve --ray --replicas N`.

Each replica is a Ray actor that loads the model, owns one `EngineBackend` (the batching engine) and serves
`create_app(...)` through Ray's FastAPI ingress (built on the replica, so the model never travels through the object
store). Ray's HTTP proxy spreads requests over the replicas; streaming, WebSockets and disconnect-aborts pass
through it. Saved voices live in one folder all replicas read (`VoiceStore` re-scans it), so a voice saved via one
replica is usable via every other. Ray runs locally here (`ray.init` with loopback addresses); on a cluster, start
Ray first (`ray start --head` / workers) and set RAY_ADDRESS, and the same command deploys onto it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from vocalis.model_options import ModelOptions
from vocalis.serve.config import ServeConfig

log = logging.getLogger(__name__)
APP_NAME = "vocalis"


def _deployment_class() -> Any:
    from ray import serve

    @serve.ingress()
    class VocalisReplica:
        """One model copy behind Ray Serve; the ASGI app is built after __init__ on the replica."""

        def __init__(self, model: str | None, config: ServeConfig, backend_opts: dict[str, Any],
                     options: ModelOptions, threads: int) -> None:
            import torch

            from vocalis.serve.engine_backend import EngineBackend

            if threads > 0:
                torch.set_num_threads(threads)
            self.config = config
            self.backend = EngineBackend(options.load(model), **backend_opts)

        def __serve_build_asgi_app__(self) -> Any:
            from vocalis.serve.app import create_app

            return create_app(self.backend, self.config)

    return VocalisReplica


def deploy(model: str | None, config: ServeConfig, backend_opts: dict[str, Any],
           options: ModelOptions | None = None, *, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
           threads: int = 0, num_cpus: int | None = None) -> None:
    """Start (or join) Ray, start Serve's HTTP proxy on host:port and deploy `replicas` model replicas."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home
    import ray
    from ray import serve

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    per_replica_cpus = max(1, threads) if threads > 0 else 1
    options = options or ModelOptions()
    deployment = serve.deployment(_deployment_class(), name="VocalisReplica").options(
        num_replicas=replicas,
        # Ray's own per-replica limit must not cut in before our bounded queue answers 503.
        max_ongoing_requests=backend_opts.get("max_queue", 64) + 1,
        ray_actor_options={"num_cpus": per_replica_cpus},
        graceful_shutdown_timeout_s=10,
    )
    serve.run(deployment.bind(model, config, backend_opts, options, threads), name=APP_NAME, route_prefix="/")
    log.info("Ray Serve: %d replica(s) of %s at http://%s:%d", replicas, model or "the built-in model", host, port)


def shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run_ray(model: str | None, config: ServeConfig, backend_opts: dict[str, Any], options: ModelOptions, *,
            host: str, port: int, replicas: int, threads: int) -> int:
    """`vocalis serve --ray`: deploy, then wait for Ctrl-C or SIGTERM and take everything down."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        from vocalis.errors import InputError

        raise InputError("--ray needs Ray Serve: pip install 'vocalis[ray]'") from None
    if replicas < 1:
        from vocalis.errors import InputError

        raise InputError("--replicas must be at least 1")
    stop = threading.Event()
    try:
        deploy(model, config, backend_opts, options, host=host, port=port, replicas=replicas, threads=threads)
        # After ray.init, which installs its own fatal-signal handlers: a SIGTERM must mean "shut down cleanly".
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"vocalis: serving {replicas} Ray Serve replica(s) at http://{host}:{port}", flush=True)
        stop.wait()
    finally:
        log.info("shutting down Ray Serve")
        shutdown()
    return 0
