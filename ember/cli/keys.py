"""`ember keys create|list|revoke`: the API keys of a server, in its state dir (`keys.json`, mode 0600).

The running server re-reads the file when it changes, so a key works (or stops working) on the next
request. Whoever may write the state dir manages the keys: there is no HTTP endpoint for it.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("keys", help="create, list and revoke API keys of ember serve",
                            description="API keys for `ember serve --auth on` (the default on a non-loopback bind).")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="the server's state dir (default $EMBER_STATE_DIR or ~/.local/state/ember)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="a new key; it is printed once, only its hash is kept")
    create.add_argument("--tenant", required=True, help="the tenant the key belongs to (sees its models and jobs)")
    create.add_argument("--role", choices=("admin", "user"), default="user",
                        help="user (default): call models; admin: also load/unload models, metrics, status")
    create.add_argument("--json", action="store_true", help="print the key and its record as JSON")
    create.set_defaults(func=_create)
    listing = actions.add_parser("list", help="every key's id, tenant, role and dates (never the key)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_list)
    revoke = actions.add_parser("revoke", help="revoke a key by its id (from `ember keys list`)")
    revoke.add_argument("id", metavar="ID")
    revoke.set_defaults(func=_revoke)


def _file(args: argparse.Namespace) -> Any:
    from ember.config import default_state_dir
    from ember.keys import KeyFile, keys_path

    return KeyFile(keys_path(args.state_dir or default_state_dir()))


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _create(args: argparse.Namespace) -> int:
    keys = _file(args)
    record, key = keys.create(args.tenant, args.role)
    if args.json:
        print(json.dumps({"key": key, "id": record.id, "tenant": record.tenant, "role": record.role}))
    else:
        print(key)
        print(f"id {record.id}  tenant {record.tenant}  role {record.role}  (in {keys.path}; "
              "the key is not shown again)")
    return 0


def _list(args: argparse.Namespace) -> int:
    records = _file(args).records()
    if args.json:
        print(json.dumps([r.model_dump(exclude={"sha256"}) for r in records], indent=2))
        return 0
    print(f"{'ID':<14}{'TENANT':<20}{'ROLE':<7}{'CREATED':<21}REVOKED")
    for r in records:
        print(f"{r.id:<14}{r.tenant:<20}{r.role:<7}{_when(r.created_at):<21}{_when(r.revoked_at)}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    record = _file(args).revoke(args.id)
    print(f"revoked {record.id} (tenant {record.tenant}, role {record.role})")
    return 0
