"""`ember cluster init` / `cert`: the cluster's CA and node certificates, and the TLS contexts built from them
(a real handshake between two in-process sockets: mutual TLS verifies against the CA, in both directions)."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ember.cli import main
from ember.cluster.ca import CA_KEY, init_ca, issue
from ember.errors import InvalidInput
from ember.tls import CA_CERT, NODE_CERT, NODE_KEY, NodeTls, peer_name


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_writes_the_layout_with_private_keys_0600_and_names_the_node_and_its_hosts(tmp_path: Path) -> None:
    init_ca(tmp_path)
    node = issue(tmp_path, "node-a", ["10.0.0.1", "a.example.com", "*.pods.local"])
    assert node == tmp_path / "nodes" / "node-a"
    assert sorted(p.name for p in node.iterdir()) == [CA_CERT, NODE_CERT, NODE_KEY]
    for key in (tmp_path / CA_KEY, node / NODE_KEY):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cert, ca = _cert(node / NODE_CERT), _cert(tmp_path / CA_CERT)
    assert cert.issuer == ca.subject and (node / CA_CERT).read_bytes() == (tmp_path / CA_CERT).read_bytes()
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-a"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["a.example.com", "*.pods.local"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca)


def test_init_refuses_a_directory_with_a_ca_and_bad_names_are_named(tmp_path: Path) -> None:
    init_ca(tmp_path)
    with pytest.raises(InvalidInput, match="already holds a cluster CA"):
        init_ca(tmp_path)
    with pytest.raises(InvalidInput, match="node name"):
        issue(tmp_path, "../evil")
    with pytest.raises(InvalidInput, match="--host: 'not a host'"):
        issue(tmp_path, "b", ["not a host"])
    with pytest.raises(InvalidInput, match="holds no cluster CA"):
        issue(tmp_path / "elsewhere", "b")


def test_the_cli_makes_the_ca_and_every_node_and_cert_adds_one(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "init", str(tmp_path), "--node", "a=127.0.0.1,a.lan", "--node", "b"]) == 0
    assert main(["cluster", "cert", str(tmp_path), "c", "--host", "10.1.2.3"]) == 0
    assert sorted(p.name for p in (tmp_path / "nodes").iterdir()) == ["a", "b", "c"]
    assert "keep it off the nodes" in capsys.readouterr().out
    NodeTls.of(tmp_path / "nodes" / "c")


def test_a_node_directory_missing_a_file_is_named(tmp_path: Path) -> None:
    init_ca(tmp_path)
    node = issue(tmp_path, "a")
    (node / NODE_KEY).unlink()
    with pytest.raises(InvalidInput, match="tls_dir: .* lacks tls.key"):
        NodeTls.of(node)


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> str | None:
    """A TLS handshake over a socket pair; what the server saw of the client (`peer_name`), or the error raised."""
    a, b = socket.socketpair()
    seen: list[str | None] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as tls:
                seen.append(peer_name(tls.getpeercert()))
                tls.recv(1)
        except (ssl.SSLError, OSError) as err:
            seen.append(f"refused: {type(err).__name__}")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(b) as tls:
            tls.sendall(b"x")
    except (ssl.SSLError, OSError):
        pass
    thread.join(10)
    return seen[0]


def _server(tls: NodeTls) -> ssl.SSLContext:
    """The context uvicorn builds from `server_kwargs()`."""
    kw = tls.server_kwargs()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(kw["ssl_certfile"], kw["ssl_keyfile"])
    ctx.load_verify_locations(kw["ssl_ca_certs"])
    ctx.verify_mode = ssl.VerifyMode(kw["ssl_cert_reqs"])
    return ctx


def test_mutual_tls_takes_a_node_of_the_ca_a_client_without_a_certificate_and_refuses_another_ca(
        tmp_path: Path) -> None:
    init_ca(tmp_path / "pki")
    a, b = (NodeTls.of(issue(tmp_path / "pki", n)) for n in ("a", "b"))
    init_ca(tmp_path / "rogue")
    rogue = NodeTls.of(issue(tmp_path / "rogue", "a"))
    assert _handshake(_server(b), a.client_context()) == "a"         # a node: named by its certificate
    anonymous = ssl.create_default_context(cafile=str(a.ca))
    anonymous.check_hostname = False
    assert _handshake(_server(b), anonymous) is None                   # a client: no certificate, no name
    assert str(_handshake(_server(b), rogue.client_context())).startswith("refused")   # another CA's "a"
    # ... and node a does not take a server of another CA either
    assert str(_handshake(_server(rogue), a.client_context())).startswith("refused")
