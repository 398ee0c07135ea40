"""The cluster's certificate authority: `ember cluster init` makes it, and a certificate per node.

Layout of the directory it writes (docs/cluster.md, "TLS and identity"):

    DIR/ca.crt                    the cluster CA's certificate (public; every node has a copy)
    DIR/ca.key                    the CA's private key (0600): only `ember cluster init/cert` read it; keep it
                                  off the nodes
    DIR/nodes/NAME/ca.crt         the directory a node is given (`ember serve --tls-dir DIR/nodes/NAME`, or a
    DIR/nodes/NAME/tls.crt        Kubernetes Secret made from it): the CA's certificate, the node's certificate
    DIR/nodes/NAME/tls.key        and its private key (0600)

Keys are ECDSA P-256. A node's certificate names the node (CN) and its hosts (subjectAltName: DNS names and IP
addresses, for clients that check them), and is good for both ends of a link (serverAuth and clientAuth): the
gateways verify each other against the CA in both directions (mutual TLS). What identifies a node to another
is that its certificate was issued by the cluster's CA (nodes' addresses come and go with pods and autoscalers,
so the gateways do not match names); `ember.tls` builds the contexts.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ember.errors import InvalidInput
from ember.tls import CA_CERT, NODE_CERT, NODE_KEY

CA_KEY = "ca.key"
NODES = "nodes"
CA_DAYS = 3650
NODE_DAYS = 825
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_HOST = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?$")


def _write(path: Path, data: bytes, private: bool) -> None:
    """Written whole (a temporary file renamed over it), 0600 for a private key."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def check_node_name(name: str) -> str:
    if not _NODE_NAME.match(name):
        raise InvalidInput(f"node name: {name!r} is not one (letters, digits, '_', '.', '-'; at most 63 characters)")
    return name


def san_of(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """subjectAltName entries: an IP address as an IPAddress, anything else as a DNSName (a wildcard allowed)."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        host = host.strip()
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
            continue
        except ValueError:
            pass
        if not _HOST.match(host):
            raise InvalidInput(f"--host: {host!r} is neither an IP address nor a DNS name")
        names.append(x509.DNSName(host.rstrip(".")))
    return names


def init_ca(root: Path, name: str = "ember cluster CA") -> Path:
    """A new CA in `root` (created); refuses a directory that already has one (its nodes' certificates would stop
    verifying). Returns the CA certificate's path."""
    root.mkdir(parents=True, exist_ok=True)
    if (root / CA_KEY).exists() or (root / CA_CERT).exists():
        raise InvalidInput(f"DIR: {root} already holds a cluster CA ({CA_CERT}); add nodes with "
                           f"`ember cluster cert {root} NAME`, or give another directory")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ember"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    _write(root / CA_KEY, _key_pem(key), private=True)
    _write(root / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return root / CA_CERT


def _load_ca(root: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((root / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((root / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as err:
        raise InvalidInput(f"DIR: {root} holds no cluster CA ({err.filename} missing): "
                           f"make one with `ember cluster init {root}`") from None
    except ValueError as err:
        raise InvalidInput(f"DIR: {root}: the CA's files cannot be read: {err}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidInput(f"DIR: {root}/{CA_KEY} is not an ember CA key (ECDSA)")
    return cert, key


def issue(root: Path, node: str, hosts: Sequence[str] = ()) -> Path:
    """A certificate and key for `node`, signed by the CA in `root`, in `root/nodes/NODE/` (with the CA's
    certificate beside them); an existing one for that name is replaced. Returns that directory."""
    check_node_name(node)
    ca_cert, ca_key = _load_ca(root)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ember"),
                         x509.NameAttribute(NameOID.COMMON_NAME, node)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(_now() - datetime.timedelta(minutes=5))
               .not_valid_after(_now() + datetime.timedelta(days=NODE_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                            crl_sign=False, content_commitment=False, data_encipherment=False,
                                            key_agreement=True, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    names = san_of(hosts)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    out = root / NODES / node
    out.mkdir(parents=True, exist_ok=True)
    _write(out / NODE_KEY, _key_pem(key), private=True)
    _write(out / NODE_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(out / CA_CERT, (root / CA_CERT).read_bytes(), private=False)
    return out
