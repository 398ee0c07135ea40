"""Who may do what: API-key principals, route access levels and model visibility (pure decisions).

A principal is a tenant and a role. `user` keys see and call their tenant's models and the public ones
(contracts without `tenant:`); `admin` keys are operators: they also see every tenant's models, load and
unload them, and read the operator endpoints. A job belongs to the tenant that submitted it, whatever
the role. With authentication off there is no principal (None) and everything is allowed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, get_args

Role = Literal["admin", "user"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: Role
    key_id: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


class Access(enum.Enum):
    """What a route needs: nothing (health, metadata, static files), any key, an admin key, or (PEER: another
    node's weight-store fetch) an admin key or the cluster token."""

    PUBLIC = "public"
    USER = "user"
    ADMIN = "admin"
    PEER = "peer"


def may_enter(principal: Principal | None, access: Access) -> bool:
    """Whether an authenticated principal (None: authentication off) may use a route of this access level."""
    if principal is None or access not in (Access.ADMIN, Access.PEER):
        return True
    return principal.is_admin


def may_see(principal: Principal | None, owner: str | None) -> bool:
    """Whether the principal may see (and call) a model owned by `owner` (None: a public model)."""
    return principal is None or owner is None or principal.is_admin or owner == principal.tenant


def owns_job(principal: Principal | None, job_tenant: str | None) -> bool:
    """Only the submitting tenant reads a job (with authentication off, anyone)."""
    return principal is None or job_tenant == principal.tenant
