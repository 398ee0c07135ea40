"""`ember cluster up`: a Ray cluster on this machine (a head and N nodes, each with its gateway), for trying it;
`ember cluster init` / `cert`: the cluster's CA and a certificate per node (ember/cluster/ca.py)."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("cluster", help="ember on many nodes: a local Ray cluster; the cluster's CA",
                       description="Run ember on a Ray cluster of this machine: a head (the controller actor) and "
                                   "N nodes, each with its own node agent, `ember serve --ray` and gateway. "
                                   "Prints the gateways' URLs; Ctrl-C stops it all. Needs ember[ray]. "
                                   "`init`/`cert`: the cluster's CA and node certificates (docs/cluster.md).")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    up = verbs.add_parser("up", help="start a head and N nodes and wait")
    up.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    up.add_argument("--state-dir", type=Path, help="a state directory per node under it (default: a temp dir)")
    up.add_argument("--tls", action="store_true",
                    help="a cluster CA under the state dir and a certificate per node: the gateways serve HTTPS "
                         "and talk mutual TLS (docs/cluster.md)")
    up.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS",
                    help="passed to every node's `ember serve` (e.g. -- --models ./models --no-examples)")
    up.set_defaults(func=_up)
    init = verbs.add_parser("init", help="make the cluster's CA and a certificate per node (TLS between gateways)",
                            description="Make a cluster CA in DIR (ca.crt, ca.key) and, for each --node, a node "
                                        "directory DIR/nodes/NAME (ca.crt, tls.crt, tls.key) to give that node "
                                        "(`ember serve --tls-dir DIR/nodes/NAME`). Keep DIR/ca.key off the nodes.")
    init.add_argument("dir", type=Path, metavar="DIR", help="where the CA and the nodes' directories go")
    init.add_argument("--node", action="append", default=[], metavar="NAME[=HOST,HOST...]",
                      help="a node (repeat): its name, and the DNS names / IP addresses clients reach it by")
    init.set_defaults(func=_init)
    cert = verbs.add_parser("cert", help="a certificate for one more node, from the CA in DIR",
                            description="Issue DIR/nodes/NAME (ca.crt, tls.crt, tls.key) with the CA that "
                                        "`ember cluster init DIR` made; an existing one for NAME is replaced.")
    cert.add_argument("dir", type=Path, metavar="DIR", help="the directory `ember cluster init` made")
    cert.add_argument("name", metavar="NAME", help="the node's name (its certificate's CN)")
    cert.add_argument("--host", action="append", default=[], metavar="HOST",
                      help="a DNS name or IP address clients reach the node by (repeat)")
    cert.set_defaults(func=_cert)


def _node_spec(spec: str) -> tuple[str, list[str]]:
    name, _, hosts = spec.partition("=")
    return name.strip(), [h for h in hosts.split(",") if h.strip()]


def _init(args: argparse.Namespace) -> int:
    from ember.cluster.ca import check_node_name, init_ca, issue, san_of

    nodes = [_node_spec(s) for s in args.node]
    for name, hosts in nodes:   # every --node checked before anything is written
        check_node_name(name)
        san_of(hosts)
    print(f"cluster CA: {init_ca(args.dir)} (its key {args.dir / 'ca.key'}: keep it off the nodes)")
    for name, hosts in nodes:
        print(f"node {name}: {issue(args.dir, name, hosts)}  (ember serve --tls-dir ...)")
    return 0


def _cert(args: argparse.Namespace) -> int:
    from ember.cluster.ca import issue

    print(f"node {args.name}: {issue(args.dir, args.name, args.host)}  (ember serve --tls-dir ...)")
    return 0


def _up(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ember.errors import InvalidInput

    if not 1 <= args.nodes <= 64:
        raise InvalidInput(f"--nodes: must be between 1 and 64, got {args.nodes}")
    try:
        from ember.cluster.one_host import LocalCluster
    except ImportError as err:
        raise InvalidInput(f"ember cluster needs Ray: pip install 'ember[ray]' ({err})") from None
    serve_args = [a for a in args.serve_args if a != "--"]
    if not ({"--jobs-url", "--allow-local-jobs"} & set(serve_args) or os.environ.get("EMBER_JOBS_URL")):
        raise InvalidInput("the nodes need a shared job store: pass -- --jobs-url postgresql://... (or set "
                           "$EMBER_JOBS_URL), or -- --allow-local-jobs for a job queue per node")
    root = args.state_dir or Path(tempfile.mkdtemp(prefix="ember-cluster-"))
    tls = None
    if args.tls:
        from ember.cluster.ca import init_ca

        tls = root / "pki"
        init_ca(tls)
    with LocalCluster(root, [serve_args] * args.nodes, tls=tls) as cluster:
        assert cluster.cluster is not None
        print(f"Ray head: {cluster.cluster.address} (controller actor 'ember-controller', namespace 'ember')")
        if tls is not None:
            print(f"cluster CA: {tls / 'ca.crt'} (curl --cacert it)")
        for node in cluster.nodes:
            print(f"node {node.index}: {node.url}   ray node {node.node_id[:12]}   logs {node.state_dir}/serve.log")
        print("Ctrl-C stops the cluster.", flush=True)
        while True:
            time.sleep(3600)
