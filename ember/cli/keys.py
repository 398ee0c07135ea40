"""`ember keys create|list|revoke`: the API keys of a server, in its state dir (`keys.json`, mode 0600), or a
cluster's: in its shared job database (`--jobs-url`) or Ray's KV (`--ray`).

The running server re-reads the file when it changes, so a key works (or stops working) on the next
request; a cluster's nodes re-read the shared keys every second. Whoever may write the state dir (or the
database, or join the Ray cluster) manages the keys: there is no HTTP endpoint for it.
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
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--jobs-url", metavar="URL", help="a cluster's keys, in its shared job database "
                       "(postgresql://...: the URL its nodes serve with; password in $PGPASSWORD or ~/.pgpass)")
    where.add_argument("--ray", metavar="ADDRESS", help="a cluster's keys, in Ray's KV (a cluster without a job "
                       "database): 'auto' or the head's address")
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
    """The key store the command works on (a `ember.keys.store.KeyStore`), and where it is, for messages."""
    if args.jobs_url is not None:
        if not args.jobs_url.startswith(("postgresql://", "postgres://")):
            from ember.errors import InvalidInput

            raise InvalidInput("--jobs-url: must be a postgresql:// URL (postgresql://user@host:port/dbname)")
        from ember.keys.postgres import PgKeys

        return PgKeys(args.jobs_url)
    if args.ray is not None:
        from ember.cluster.actors import connect
        from ember.cluster.keys_kv import RayKeys

        connect(args.ray)
        return RayKeys()
    from ember.config import default_state_dir
    from ember.keys.store import KeyFile, keys_path

    return KeyFile(keys_path(args.state_dir or default_state_dir()))


def _where(keys: Any) -> str:
    return str(getattr(keys, "where", None) or keys.path)


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _create(args: argparse.Namespace) -> int:
    keys = _file(args)
    record, key = keys.create(args.tenant, args.role)
    if args.json:
        print(json.dumps({"key": key, "id": record.id, "tenant": record.tenant, "role": record.role}))
    else:
        print(key)
        print(f"id {record.id}  tenant {record.tenant}  role {record.role}  (in {_where(keys)}; "
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
