"""Mutual TLS on the peer port (``--peer-tls-*``, runtime/peer_tls.py).

A throwaway PKI in a temporary directory — a mesh CA, two node certificates (SAN 127.0.0.1 and
localhost), a certificate with the wrong name, and an intruder CA with its own certificate —
made with ``cryptography`` if installed, else the ``openssl`` CLI; skipped without either. Nodes
run in this process (uvicorn on 127.0.0.1, as in test_runtime_cancel.py) with the same
``uvicorn_options`` as ``radixmesh serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.runtime import serve_cli
from radixmesh.runtime.config import ServeConfig, config_from_mapping
from radixmesh.runtime.inprocess import free_port
from radixmesh.runtime.inprocess import serving as serve_in_process
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.peer_tls import PeerTls, uvicorn_options

if TYPE_CHECKING:
    from conftest import Poll

GOOD_SAN = ("127.0.0.1", "localhost")


# ------------------------------------------------------------------------------ the PKI
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _pki_openssl(d: Path) -> None:
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "evil-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=test {ca}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for serial, (name, ca, sans) in enumerate(_LEAVES, start=1000):
        alt = ",".join(("IP:" if s[0].isdigit() else "DNS:") + s for s in sans)
        (d / f"{name}.ext").write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\n"
            f"authorityKeyIdentifier=keyid\nsubjectAltName={alt}\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-set_serial", str(serial), "-days", "2", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)


def _pki_cryptography(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write(name: str, key: Any, cert: Any) -> None:
        (d / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def builder(subject: str, issuer: Any, key: Any) -> Any:
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(issuer).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False))

    cas: dict[str, tuple[Any, Any]] = {}
    for ca in ("ca", "evil-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test {ca}")])
        cert = (builder(f"test {ca}", name, key)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .sign(key, hashes.SHA256()))
        cas[ca] = (key, cert)
        write(ca, key, cert)
    for name, ca, sans in _LEAVES:
        ca_key, ca_cert = cas[ca]
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [x509.IPAddress(ipaddress.ip_address(s)) if s[0].isdigit() else x509.DNSName(s)
               for s in sans]
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (builder(name, ca_cert.subject, key)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(True, False, False, False, False, False, False,
                                             False, False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                    ski), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(name, key, cert)


_LEAVES = (  # name, issuing CA, subjectAltNames
    ("a", "ca", GOOD_SAN),
    ("b", "ca", GOOD_SAN),
    ("misnamed", "ca", ("elsewhere.example",)),
    ("intruder", "evil-ca", GOOD_SAN),
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if not shutil.which("openssl"):
            pytest.skip("peer TLS tests need the cryptography package or the openssl CLI to "
                        "make throwaway certificates; neither is installed")
        _pki_openssl(d)
    else:
        _pki_cryptography(d)
    return d


def tls_files(pki: Path, name: str) -> dict[str, Any]:
    return {"peer_tls_cert": str(pki / f"{name}.pem"), "peer_tls_key": str(pki / f"{name}.key"),
            "peer_tls_ca": str(pki / "ca.pem")}


def client_ssl(pki: Path, cert: str | None = None) -> ssl.SSLContext:
    """What an outside client uses: trusts the mesh CA; with ``cert``, presents it."""
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert is not None:
        ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
    return ctx


# ----------------------------------------------------------------------------- the nodes
@contextlib.asynccontextmanager
async def serving(engine: Any, name: str, *, port: int = 0, **overrides: Any
                  ) -> AsyncIterator[NodeService]:
    port = port or free_port()
    cfg = ServeConfig(node_id=name, port=port, gossip_interval=0.1, forward_timeout=5.0,
                      **overrides)
    service = NodeService(cfg, engine)
    async with serve_in_process(service, port, app_options=uvicorn_options):
        yield service


def tls_of(node: NodeService) -> PeerTls:
    found = [a for a in node.attachments if isinstance(a, PeerTls)]
    assert len(found) == 1
    return found[0]


# ----------------------------------------------------------------------------- the tests
def test_the_three_tls_files_go_together(pki: Path) -> None:
    files = tls_files(pki, "a")
    assert ServeConfig(**files).peer_tls
    assert not ServeConfig().peer_tls
    for missing in files:
        partial = {k: v for k, v in files.items() if k != missing}
        with pytest.raises(ValueError, match="all three or none") as err:
            ServeConfig(**partial)
        assert "--" + missing.replace("_", "-") in str(err.value)
    toml = {k.replace("_", "-"): v for k, v in files.items()}  # the TOML keys
    assert config_from_mapping(toml).peer_tls_ca == files["peer_tls_ca"]


def test_unusable_tls_files_stop_serve_before_the_engine(pki: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--peer-tls-cert", str(pki / "a.pem"),
                              "--peer-tls-key", str(pki / "b.key"),  # not a's key
                              "--peer-tls-ca", str(pki / "ca.pem")])
    assert serve_cli.run(args) == 2
    assert "cannot load the peer TLS files" in capsys.readouterr().err


def test_two_tls_nodes_gossip_and_forward_over_mutual_tls(
    engine: Any, pki: Path, poll: Poll
) -> None:
    async def scenario() -> None:
        port_a = free_port()
        async with serving(engine, "a", port=port_a, **tls_files(pki, "a")) as a, \
                serving(engine, "b", peers=(f"127.0.0.1:{port_a}",), **tls_files(pki, "b")) as b:
            await poll.until_async(lambda: a.peer_states() == {"b": "alive"}
                                   and b.peer_states() == {"a": "alive"},
                                   "a and b see each other")
            body = {"model": "micro", "prompt": "over TLS " * 4, "max_tokens": 4}
            async with aiohttp.ClientSession() as http, http.post(
                f"https://{a.address}/v1/completions", json=body,
                headers={"x-radixmesh-target": "b"}, ssl=client_ssl(pki),
            ) as resp:  # the client API is HTTPS too, no client certificate needed
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-radixmesh-route"] == "forwarded"
                assert resp.headers["x-radixmesh-served-by"] == "b"
            assert b.metrics.served_for_peers == 1
            for node in (a, b):
                tls = tls_of(node)
                assert tls.accepted > 0 and sum(tls.rejected.values()) == 0
                assert node.peers.gossip_sent > 0 and node.peers.tls_failed == 0
                assert "peer_tls_accepted" in node.prometheus()
                assert node.mesh()["peer_tls"]["enabled"] is True

    asyncio.run(scenario())


def test_peer_requests_without_a_mesh_certificate_are_refused(engine: Any, pki: Path) -> None:
    async def scenario() -> None:
        async with serving(engine, "a", **tls_files(pki, "a")) as a:
            gossip = f"https://{a.address}/peer/gossip"
            async with aiohttp.ClientSession() as http:
                async with http.get(f"https://{a.address}/health", ssl=client_ssl(pki)) as ok:
                    assert ok.status == 200  # clients need no certificate
                async with http.post(gossip, data=b"x", ssl=client_ssl(pki)) as resp:
                    assert resp.status == 403
                    error = (await resp.json())["error"]
                    assert error["code"] == "peer_tls_client_cert_required"
                assert tls_of(a).rejected["no_client_cert"] == 1
                assert "peer_tls_rejected_no_client_cert_total 1" in a.prometheus()
                # a certificate from another CA: the handshake itself is refused
                with pytest.raises(aiohttp.ClientError):
                    async with http.post(gossip, data=b"x",
                                         ssl=client_ssl(pki, cert="intruder")) as resp:
                        await resp.read()
                # plain HTTP to the TLS port: no HTTP answer at all
                with pytest.raises(aiohttp.ClientError):
                    async with http.post(f"http://{a.address}/peer/gossip", data=b"x") as resp:
                        await resp.read()
            assert tls_of(a).accepted == 0  # nothing reached a peer endpoint
            assert a.peer_states() == {}

    asyncio.run(scenario())


def test_a_node_without_tls_cannot_talk_to_a_tls_mesh(engine: Any, pki: Path, poll: Poll) -> None:
    async def scenario() -> None:
        port_a, port_c = free_port(), free_port()
        addr_a, addr_c = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_c}"
        async with serving(engine, "a", port=port_a, peers=(addr_c,),
                           **tls_files(pki, "a")) as a, \
                serving(engine, "c", port=port_c, peers=(addr_a,)) as c:
            await poll.until_async(lambda: a.peers.tls_failed >= 2
                                   and c.peers.gossip_failed >= 2, "both sides tried")
            assert c.peers.gossip_sent == 0  # plain gossip never reached a
            assert a.peers.gossip_sent == 0  # nor TLS gossip c
            assert a.peer_states() == {} and c.peer_states() == {}
            assert tls_of(a).accepted == 0

    asyncio.run(scenario())


def test_a_peer_whose_certificate_names_another_host_is_not_trusted(engine: Any,
                                                                    pki: Path) -> None:
    """The hostname check: a CA-signed certificate for elsewhere.example at 127.0.0.1."""
    async def scenario() -> None:
        async with serving(engine, "m", **tls_files(pki, "misnamed")) as m, \
                serving(engine, "a", **tls_files(pki, "a")) as a:
            assert not await a.peers.send_gossip(m.address, b"hello", None)
            assert a.peers.tls_failed == 1
            assert tls_of(m).accepted == 0

    asyncio.run(scenario())
