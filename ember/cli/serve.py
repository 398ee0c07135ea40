"""`ember serve`: the gateway and the local node on one port (and KServe V2 gRPC on another)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve models over KServe V2 and OpenAI APIs",
                       description="Start the gateway and the local node on one port and deploy every model "
                                   "contract found: the bundled examples and those of --models.")
    p.add_argument("--models", action="append", metavar="PATH",
                   help="a contract file or a directory of them, or store:NAME[:VERSION] (a contract directory "
                        "pushed to the weight store with `ember store push`), served beside the bundled examples "
                        "(repeatable)")
    p.add_argument("--no-examples", action="store_true", help="leave the bundled example models out")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default $EMBER_PORT or 8000)")
    p.add_argument("--grpc-port", type=int, help="port of the KServe V2 gRPC API (default $EMBER_GRPC_PORT, else 8001 "
                                                 "if it is free; 0: no gRPC)")
    p.add_argument("--state-dir", type=Path,
                   help="jobs database, API keys and sockets (default $EMBER_STATE_DIR or ~/.local/state/ember)")
    p.add_argument("--jobs-url", metavar="URL",
                   help="postgresql://user@host:port/dbname of a job store several nodes share (default "
                        "$EMBER_JOBS_URL; unset: SQLite in --state-dir). Give the password in $EMBER_JOBS_URL, "
                        "$PGPASSWORD or ~/.pgpass rather than here: a flag shows in ps. Needs ember[postgres]")
    p.add_argument("--auth", choices=("on", "off", "auto"),
                   help="require API keys (`ember keys create`); auto (default): off on a loopback bind, on otherwise")
    p.add_argument("--allowed-hosts", metavar="NAME,...",
                   help="Host names the gateway answers to, beside IP addresses, localhost, this machine's names "
                        "and the bind/advertised hosts ('.example.com': subdomains; '*': any). Default: checked "
                        "while API keys are off (DNS rebinding), any host while they are on")
    p.add_argument("--rate-limit-rps", type=float, metavar="R",
                   help="requests per second per tenant; over it: 429 with Retry-After (default: no limit)")
    p.add_argument("--rate-limit-burst", type=int, metavar="N",
                   help="requests a tenant may send at once (default: one second's worth)")
    p.add_argument("--cpu-slots", type=int,
                   help="CPU slots (default: one per core): instances share their cores, at most this many working "
                        "at once; 0 (with --ray): a gateway only")
    p.add_argument("--dedicated-cpu-slots", type=int, metavar="N",
                   help="of the CPU slots, N hold one instance each, on cores of its own (contracts with "
                        "resources.dedicated_cores; all of them: every instance on its own; default 0)")
    p.add_argument("--threads-per-slot", type=int, help="intra-op threads of each instance (default 1)")
    p.add_argument("--max-body-mb", type=float, help="largest request body (default 64)")
    p.add_argument("--max-inflight-mb", type=float,
                   help="request bodies held at once, all clients together; past it 429 (default 256)")
    p.add_argument("--max-connections", type=int,
                   help="client connections at once, kept below the open-files limit (default 4096)")
    p.add_argument("--header-timeout-s", type=float, metavar="S",
                   help="close a connection whose request headers take longer (default 10)")
    p.add_argument("--body-timeout-s", type=float, metavar="S",
                   help="answer 408 to a request body that sends nothing for this long (default 30)")
    p.add_argument("--body-min-rate-kbs", type=float, metavar="KIB_S",
                   help="answer 408 to a request body averaging under this many KiB/s after its first 10 s "
                        "(default 64; 0: no minimum)")
    p.add_argument("--body-deadline-s", type=float, metavar="S",
                   help="answer 408 to a request body not whole within this long (default 120)")
    p.add_argument("--http-keepalive-s", type=float, metavar="S",
                   help="close an idle kept-alive connection after this long (default 5)")
    p.add_argument("--shutdown-grace-s", type=float, metavar="S",
                   help="on SIGTERM, requests and running jobs get this long to finish; jobs still running then "
                        "go back to the queue (default 30)")
    p.add_argument("--keepalive", help="idle rungs from: contract (default) | fixed | fixed-zygote | hybrid | "
                                       "hybrid-zygote | ladder | ladder-cold; the plan's rungs are carried out on "
                                       "the node")
    p.add_argument("--keepalive-knob", type=float, metavar="X",
                   help="the policy's knob: keep_alive_s (fixed), range_s (hybrid), latency_value (ladder), "
                        "cold_value (ladder-cold: MB*s per start that needs a new process)")
    p.add_argument("--keepalive-preset", type=Path, metavar="FILE",
                   help="JSON preset of the ladder's constants for --keepalive ladder or ladder-cold (`ember sim "
                        "--write-preset` writes one; default: the built-in preset `ember sim` judges)")
    p.add_argument("--tick-s", type=float, metavar="S",
                   help="how often idle capacity is decided and carried out (default 0.25)")
    p.add_argument("--rung-costs", type=Path,
                   help="bench/cold_start.py JSON: measured rung costs for --keepalive ladder (or ladder-cold)")
    p.add_argument("--idle-memory-mb", type=float, metavar="MB",
                   help="node budget for idle instances' memory (1 to 1e9): every second the LP buffer planner "
                        "sizes how many idle instances each model keeps within it, from its forecast (default: none)")
    p.add_argument("--idle-latency-value", type=float, metavar="MBS",
                   help="with --idle-memory-mb: MB*s of idle memory worth one second of start latency (default 1e5)")
    p.add_argument("--idle-poll-us", type=int, metavar="US",
                   help="poll this long before sleeping, in instances between requests and in the gateway "
                        "around a reply's due time (default 2000; 0: never)")
    p.add_argument("--queue-wait-s", type=float, metavar="S",
                   help="how long a request waits for room before it becomes a 202 job (default 2)")
    p.add_argument("--overload-wait-s", type=float, metavar="S",
                   help="how long an OpenAI request waits for room before a 429 (default 10)")
    p.add_argument("--request-timeout-s", type=float, metavar="S", help="a request's deadline (default 60)")
    p.add_argument("--sandbox", choices=("on", "off"),
                   help="instances run sandboxed where the machine permits: their model's own user, a memory "
                        "cgroup, read-only files, no network, seccomp (default on)")
    p.add_argument("--snapshots", choices=("on", "off"),
                   help="each model's loaded, warmed process is imaged to disk (CRIU >= 4.1, root) and instances "
                        "restore from it when no template or zygote is kept: the ladder's restore rung (default off)")
    p.add_argument("--log-level", help="critical|error|warning|info|debug")
    p.add_argument("--access-log", choices=("text", "json"),
                   help="one line per request on stderr (method, route, model, status, rung, latency, bytes)")
    p.add_argument("--otel", action="store_true", default=None,
                   help="OpenTelemetry traces, one per request, exported over OTLP/HTTP to "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4318); on by default when that or "
                        "OTEL_TRACES_EXPORTER=otlp is set. Needs the otel extra: pip install 'ember[otel]'")
    p.add_argument("--store-root", type=Path,
                   help="weight store root for store:NAME weights (default $EMBER_STORE or ~/.cache/ember/store)")
    p.add_argument("--store-origin", metavar="URL",
                   help="http(s) or s3:// URL of a remote store root to fetch from (default $EMBER_STORE_ORIGIN)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="join a Ray cluster as one of its nodes: 'auto' (the one this machine runs) or the head's "
                        "address; the gateway then routes across nodes (docs/cluster.md). Needs ember[ray]")
    p.add_argument("--gateway-links", choices=("on", "off"),
                   help="with --ray: forward unary requests to other nodes over gateway links, frames on the "
                        "gateway's own port (default on), or over HTTP (off: as streams go)")
    p.add_argument("--ray-node-id", help=argparse.SUPPRESS)   # set by the node agent that starts this server
    p.add_argument("--advertise-url", metavar="URL",
                   help="this gateway's URL as the other nodes reach it (default http://HOST:PORT)")
    p.add_argument("--keep-memory-tier", action="store_true",
                   help="leave the weight store's memory tier (in /dev/shm) in place on exit (default: remove it "
                        "if this server created it)")
    p.add_argument("--store-peers", metavar="URL,...",
                   help="other nodes' gateways (http://host:port) to fetch weight chunks from before the origin")
    p.add_argument("--cluster-token", metavar="TOKEN", help="token the nodes of a cluster present to each other's "
                   "weight-chunk route on plain links, 16+ characters (default $EMBER_CLUSTER_TOKEN; prefer the "
                   "variable)")
    p.add_argument("--tls-dir", type=Path, metavar="DIR",
                   help="a node directory of `ember cluster init` (ca.crt, tls.crt, tls.key): serve HTTPS and use "
                        "mutual TLS between the nodes (default $EMBER_TLS_DIR; docs/cluster.md)")
    p.add_argument("--allow-local-jobs", action="store_true",
                   help="with --ray and no --jobs-url: keep a job queue per node instead of refusing to start")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # The gateway forks only to exec (zygotes): gRPC's fork handlers would only pause its threads, and log each time.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from ember.config import load_serve_config
    from ember.server import serve

    config = load_serve_config(
        host=args.host, port=args.port, grpc_port=args.grpc_port, state_dir=args.state_dir,
        models=tuple(Path(m) for m in args.models or () if not m.startswith("store:")) or None,
        store_models=tuple(m.removeprefix("store:") for m in args.models or () if m.startswith("store:")) or None,
        examples=False if args.no_examples else None,
        cpu_slots=args.cpu_slots, dedicated_cpu_slots=args.dedicated_cpu_slots,
        threads_per_slot=args.threads_per_slot,
        max_body_mb=args.max_body_mb, max_inflight_mb=args.max_inflight_mb, max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
        body_min_rate_kbs=args.body_min_rate_kbs, body_deadline_s=args.body_deadline_s,
        http_keepalive_s=args.http_keepalive_s, shutdown_grace_s=args.shutdown_grace_s,
        log_level=args.log_level, keepalive=args.keepalive,
        keepalive_knob=args.keepalive_knob, keepalive_preset=args.keepalive_preset, tick_s=args.tick_s,
        rung_costs=args.rung_costs, idle_poll_us=args.idle_poll_us, idle_memory_mb=args.idle_memory_mb,
        idle_latency_value=args.idle_latency_value, store_root=args.store_root,
        store_origin=args.store_origin, queue_wait_s=args.queue_wait_s, overload_wait_s=args.overload_wait_s,
        request_timeout_s=args.request_timeout_s, access_log=args.access_log, otel=args.otel,
        keep_memory_tier=args.keep_memory_tier or None, auth=args.auth,
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
        if args.allowed_hosts else None,
        rate_limit_rps=args.rate_limit_rps, rate_limit_burst=args.rate_limit_burst, jobs_url=args.jobs_url,
        sandbox=None if args.sandbox is None else args.sandbox == "on",
        snapshots=None if args.snapshots is None else args.snapshots == "on",
        store_peers=tuple(u.strip() for u in args.store_peers.split(",") if u.strip()) if args.store_peers else None,
        cluster_token=args.cluster_token, tls_dir=args.tls_dir, allow_local_jobs=args.allow_local_jobs or None,
        ray=args.ray, ray_node_id=args.ray_node_id, advertise_url=args.advertise_url,
        gateway_links=None if args.gateway_links is None else args.gateway_links == "on",
    )
    for path in config.models:
        if not path.exists():
            from ember.errors import InvalidInput

            raise InvalidInput(f"--models: {path} does not exist")
    serve(config)
    return 0
