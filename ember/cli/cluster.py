"""`ember cluster up`: a Ray cluster on this machine (a head and N nodes, each with its gateway), for trying it."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("cluster", help="try ember on many nodes: a local Ray cluster",
                       description="Run ember on a Ray cluster of this machine: a head (the controller actor) and "
                                   "N nodes, each with its own node agent, `ember serve --ray` and gateway. "
                                   "Prints the gateways' URLs; Ctrl-C stops it all. Needs ember[ray].")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    up = verbs.add_parser("up", help="start a head and N nodes and wait")
    up.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    up.add_argument("--state-dir", type=Path, help="a state directory per node under it (default: a temp dir)")
    up.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS",
                    help="passed to every node's `ember serve` (e.g. -- --models ./models --no-examples)")
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ember.errors import InvalidInput

    if not 1 <= args.nodes <= 64:
        raise InvalidInput(f"--nodes: must be between 1 and 64, got {args.nodes}")
    try:
        from ember.cluster.local import LocalCluster
    except ImportError as err:
        raise InvalidInput(f"ember cluster needs Ray: pip install 'ember[ray]' ({err})") from None
    serve_args = [a for a in args.serve_args if a != "--"]
    root = args.state_dir or Path(tempfile.mkdtemp(prefix="ember-cluster-"))
    with LocalCluster(root, [serve_args] * args.nodes) as cluster:
        assert cluster.cluster is not None
        print(f"Ray head: {cluster.cluster.address} (controller actor 'ember-controller', namespace 'ember')")
        for node in cluster.nodes:
            print(f"node {node.index}: {node.url}   ray node {node.node_id[:12]}   logs {node.state_dir}/serve.log")
        print("Ctrl-C stops the cluster.", flush=True)
        while True:
            time.sleep(3600)
