"""TLS for a node's gateway and its links to the other nodes: the contexts built from a node's directory.

A node directory (`ember cluster init`, ember/cluster/ca.py) holds `ca.crt` (the cluster CA), `tls.crt` and
`tls.key` (this node's certificate, issued by that CA, and its key). With it (`ember serve --tls-dir`):

- the gateway serves HTTPS with the node's certificate. A client certificate is asked for but optional
  (clients with API keys connect without one); one that is presented must verify against the cluster CA, or
  the handshake fails. A connection whose client presented a verified certificate is another node of the
  cluster (`PEER_SCOPE_KEY` in its requests' ASGI scope, set by ember/gateway/connections.py).
- the node's own links to the other gateways (forwarded requests, weight chunks) present the node's certificate
  and verify the other end against the cluster CA (`client_context`): mutual TLS. Names are not matched (a
  node's address comes and goes with pods and autoscalers): a certificate the cluster CA issued is the identity.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import InvalidInput

CA_CERT = "ca.crt"
NODE_CERT = "tls.crt"
NODE_KEY = "tls.key"
PEER_SCOPE_KEY = "ember.peer"   # in a request's ASGI scope: the CN of the verified client certificate (a node)


@dataclass(frozen=True)
class NodeTls:
    """A node's TLS files; `of` checks they are there and load."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def of(cls, directory: Path) -> NodeTls:
        tls = cls(directory / CA_CERT, directory / NODE_CERT, directory / NODE_KEY)
        missing = [p.name for p in (tls.ca, tls.cert, tls.key) if not p.is_file()]
        if missing:
            raise InvalidInput(f"tls_dir: {directory} lacks {', '.join(missing)} (a node directory made by "
                               "`ember cluster init`: DIR/nodes/NAME)")
        try:
            tls.client_context()
        except (ssl.SSLError, OSError) as err:
            raise InvalidInput(f"tls_dir: {directory}: the certificate, key or CA does not load: {err}") from None
        return tls

    def client_context(self) -> ssl.SSLContext:
        """For this node's links to the other gateways: presents the node's certificate, verifies theirs against
        the cluster CA (not their names: see the module docstring)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def server_kwargs(self) -> dict[str, Any]:
        """uvicorn's settings for the gateway: the node's certificate; a client certificate asked for, optional,
        and verified against the cluster CA when given."""
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key), "ssl_ca_certs": str(self.ca),
                "ssl_cert_reqs": int(ssl.CERT_OPTIONAL)}


def peer_name(peercert: dict[str, Any] | None) -> str | None:
    """The CN of a verified client certificate (`SSLObject.getpeercert()`), None when there is none."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""
