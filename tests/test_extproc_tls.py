"""TLS and mTLS on the ext_proc port, through a real Envoy whose derender cluster speaks TLS to the
filter (``envoy_config.tls_transport_socket``), on both transports, with a CA made here: Envoy's
clients are served; a peer without a client certificate, with one from another CA, or in cleartext
is refused; the health check works with the right certificate only."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import pytest
from h2peer import HEALTH, Closed, Peer
from stack import start_target

from derender.extproc import health
from derender.extproc.http2 import wire
from derender.ops import envoy_config


def _cert(folder: Path, name: str, issuer=None, server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1)))
    if issuer is None:  # a CA
        builder = builder.issuer_name(subject).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        signer, signer_key = None, key
    else:
        signer, signer_key = issuer
        builder = builder.issuer_name(signer.subject).add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
    cert = builder.sign(signer_key, hashes.SHA256())
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pki")
    ca = _cert(folder, "ca")
    _cert(folder, "filter", ca, server=True)
    _cert(folder, "envoy", ca)
    rogue = _cert(folder, "rogue-ca")
    _cert(folder, "rogue", rogue)
    return folder


@pytest.fixture(scope="module", params=["http2", "grpcio"])
def mtls(request, pki, qwen3_dir):
    socket_ = envoy_config.tls_transport_socket(str(pki / "ca.pem"), str(pki / "envoy.pem"), str(pki / "envoy.key"))
    target = start_target(qwen3_dir, "--tls-cert", str(pki / "filter.pem"), "--tls-key", str(pki / "filter.key"),
                          "--tls-client-ca", str(pki / "ca.pem"), transport=request.param,
                          FILTER_TRANSPORT_SOCKET=socket_)
    yield request.param, target.port, target.envoy_url, target.filter
    target.stop()


def client_context(pki: Path, cert: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.set_alpn_protocols(["h2"])
    if cert:
        context.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
    return context


def test_envoys_clients_are_served_over_mtls(mtls):
    transport, port, base, flt = mtls
    for stream in (False, True):
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "over TLS"}], "stream": stream}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert "over" in r.text and "TLS" in r.text
    assert ("mTLS" in flt.log.read_text()), "the filter says it serves mTLS"


def test_the_health_check_needs_the_right_certificate(mtls, pki):
    _, port, _, _ = mtls
    address = f"127.0.0.1:{port}"
    ca = str(pki / "ca.pem")
    assert health.check(address, ca=ca, cert=str(pki / "envoy.pem"), key=str(pki / "envoy.key"), server_name="localhost")
    assert not health.check(address, ca=ca, server_name="localhost")  # no client certificate
    assert not health.check(address, ca=ca, cert=str(pki / "rogue.pem"), key=str(pki / "rogue.key"), server_name="localhost")
    assert not health.check(address)  # cleartext
    assert health.main([address, "--tls-ca", ca, "--tls-cert", str(pki / "envoy.pem"), "--tls-key",
                        str(pki / "envoy.key"), "--server-name", "localhost"]) == 0


@pytest.mark.parametrize("cert", [None, "rogue"], ids=["no-client-cert", "other-ca"])
def test_a_peer_without_a_trusted_client_certificate_gets_nothing(mtls, pki, cert):
    _, port, _, _ = mtls
    with pytest.raises((ssl.SSLError, ConnectionError, Closed, OSError)):
        with Peer(port, tls=client_context(pki, cert)) as peer:
            peer.handshake(3)
            sid = peer.stream_id()
            peer.send(peer.headers(sid, HEALTH), peer.message(sid, b""))
            seen = peer.frames(3, until=lambda f: f.kind == wire.HEADERS and f.flags & wire.END_STREAM)
            if not seen or peer.closed:
                raise Closed()


def test_a_trusted_peer_speaks_http2_over_tls(mtls, pki):
    transport, port, _, _ = mtls
    with Peer(port, tls=client_context(pki, "envoy")) as peer:
        assert peer.sock.selected_alpn_protocol() == "h2"
        peer.handshake()
        sid = peer.stream_id()
        peer.send(peer.headers(sid, HEALTH), peer.message(sid, b""))
        seen = peer.frames(5, until=lambda f: f.kind == wire.HEADERS and f.flags & wire.END_STREAM)
        assert seen and seen[-1].field("grpc-status") == "0"


def test_cleartext_is_refused_on_a_tls_port(mtls):
    _, port, _, _ = mtls
    with Peer(port) as peer:
        assert not peer.frames(2, until=lambda f: f.kind == wire.SETTINGS)
