"""`ember status`: each model and each instance of a running server."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ember.errors import EmberError


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="show models and instances of a running ember serve")
    # The same default port as `ember serve`, so that EMBER_PORT=8080 serves and asks on 8080.
    p.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('EMBER_PORT') or 8000}",
                   help="the server (default http://127.0.0.1:$EMBER_PORT, else :8000)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"),
                   help="an admin API key, for a server with --auth on (default: $EMBER_API_KEY)")
    p.set_defaults(func=_run)


def fetch_status(url: str, api_key: str | None = None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/ember/status", headers=headers, timeout=10)
    except httpx.HTTPError as err:
        raise EmberError(f"cannot reach ember at {url}: {err}") from None
    if response.status_code != 200:
        raise EmberError(f"{url} answered {response.status_code}: {response.text[:200]}")
    data: dict[str, Any] = response.json()
    return data


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _run(args: argparse.Namespace) -> int:
    data = fetch_status(args.url, args.api_key)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ember at {args.url}")
    for col in ("model", "state", "instance", "inst. state", "rung", "pid", "slice", "idle s", "served",
                "RSS MB", "PSS MB"):
        table.add_column(col)
    for m in data["models"]:
        name = f"{m['name']}:{m['version']}"
        tmpl = m.get("template")
        table.add_row(name, m["state"], "template" if tmpl else "-", "", "", "", "", "", "",
                      _mb(tmpl["rss_bytes"]) if tmpl else "-", _mb(tmpl["pss_bytes"]) if tmpl else "-")
        for i in m["instances"]:
            table.add_row("", "", i["id"], i["state"], i["rung"], str(i["pid"]), i["slice"], f"{i['idle_s']:.1f}",
                          str(i["served"]), _mb(i["rss_bytes"]), _mb(i["pss_bytes"]))
    console = Console()
    # A pipe gets rich's 80 columns by default: too narrow for eleven columns.
    console.width = max(console.width, 150)
    console.print(table)
    node = data.get("node") or {}
    zygotes = Table(title="zygotes (one per runtime: imports done, forks instances)")
    for col in ("runtime", "RSS MB", "PSS MB"):
        zygotes.add_column(col)
    for z in node.get("zygotes", []):
        zygotes.add_row(z["runtime"], _mb(z["rss_bytes"]), _mb(z["pss_bytes"]))
    console.print(zygotes)
    snapshots = node.get("snapshots") or {}
    if snapshots:
        console.print(f"snapshots: {snapshots.get('state')}")
        for image in snapshots.get("images", []):
            made = f", load {image['load_s']:.2f} s, dump {image['dump_s']:.2f} s" if "dump_s" in image else ""
            console.print(f"  image of {image['model']}: {image.get('mb', 0):.0f} MiB{made}")
    jobs = node.get("jobs", [])
    if not jobs:
        console.print("job queue: empty")
    for j in jobs:
        console.print(f"job queue: {j['model']}:{j['version']}: {j['queued']} queued, the oldest "
                      f"{j['oldest_age_s']:.1f} s old")
    return 0
