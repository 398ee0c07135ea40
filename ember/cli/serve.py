"""`ember serve`: the gateway and the local node on one port."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve models over KServe V2 and OpenAI APIs",
                       description="Start the gateway and the local node on one port and deploy every model "
                                   "contract found (with no --models, the bundled examples).")
    p.add_argument("--models", type=Path, action="append", metavar="PATH",
                   help="a contract file or a directory of them (repeatable)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--state-dir", type=Path, help="jobs database and sockets (default ~/.local/state/ember)")
    p.add_argument("--cpu-slots", type=int, help="CPU slices (default: one per core)")
    p.add_argument("--threads-per-slot", type=int, help="intra-op threads of each instance (default 1)")
    p.add_argument("--max-body-mb", type=float, help="largest request body (default 64)")
    p.add_argument("--keepalive", help="idle rungs from: contract (default) | fixed | hybrid | ladder")
    p.add_argument("--rung-costs", type=Path,
                   help="bench/cold_start.py JSON: measured rung costs for --keepalive ladder")
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
    p.add_argument("--log-level", help="critical|error|warning|info|debug")
    p.add_argument("--access-log", choices=("text", "json"),
                   help="one line per request on stderr (method, route, model, status, rung, latency, bytes)")
    p.add_argument("--store-root", type=Path,
                   help="weight store root for store:NAME weights (default $EMBER_STORE or ~/.cache/ember/store)")
    p.add_argument("--store-origin", metavar="URL",
                   help="http(s) or s3:// URL of a remote store root to fetch from (default $EMBER_STORE_ORIGIN)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from ember.config import load_serve_config
    from ember.server import serve

    config = load_serve_config(
        host=args.host, port=args.port, state_dir=args.state_dir,
        models=tuple(args.models) if args.models else None, cpu_slots=args.cpu_slots,
        threads_per_slot=args.threads_per_slot,
        max_body_mb=args.max_body_mb, log_level=args.log_level, keepalive=args.keepalive,
        rung_costs=args.rung_costs, idle_poll_us=args.idle_poll_us, store_root=args.store_root,
        store_origin=args.store_origin, queue_wait_s=args.queue_wait_s, overload_wait_s=args.overload_wait_s,
        request_timeout_s=args.request_timeout_s, access_log=args.access_log,
        sandbox=None if args.sandbox is None else args.sandbox == "on",
    )
    for path in config.models:
        if not path.exists():
            from ember.errors import InvalidInput

            raise InvalidInput(f"--models: {path} does not exist")
    serve(config)
    return 0
