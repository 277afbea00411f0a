"""Mutual TLS for peer traffic (``--peer-tls-cert``, ``--peer-tls-key``, ``--peer-tls-ca``).

Design: one port, HTTPS for everyone, client certificates for ``/peer/*`` only
-----------------------------------------------------------------------------
With the three files set, the node's one port (client API and peer endpoints) serves HTTPS
with its certificate. The TLS server asks every client for a certificate but does not require
one (``CERT_OPTIONAL``): a client of the OpenAI API connects without one, while a presented
certificate that the mesh CA did not sign fails the handshake. The app then refuses every
``/peer/*`` request whose connection did not present a CA-verified certificate: 403
``peer_tls_client_cert_required``, counted (``peer_tls_rejected_<reason>``).

How the app learns about the connection: the ASGI TLS extension
(``scope["extensions"]["tls"]``, ``client_cert_name`` etc.). uvicorn does not fill it (up to
0.54 at least), so :meth:`PeerTls.uvicorn_options` gives uvicorn a protocol class — its own
HTTP protocol, subclassed — whose ``connection_made`` reads the TLS transport's verified peer
certificate and wraps that connection's ASGI app so each of its requests carries the
extension. If a uvicorn version stopped honouring that shim, the extension would be missing
and peer requests would be refused (fail closed), never accepted unverified. The extension
cannot be forged by a client (it is not a header), and the connection's address is not used
(``X-Forwarded-For`` rewrites it).

The peer client (runtime/peer_client.py) sends over ``https://`` with
:attr:`PeerTls.client_context`: this node's certificate and key, only the mesh CA as trust
anchor (not the system store), and the hostname check on: the peer's certificate must name
the host of the address it is reached at (its ``--advertise`` host, an IP or a DNS name, as a
subjectAltName). A node certificate therefore needs that SAN and, if it has an extended key
usage, both ``serverAuth`` and ``clientAuth``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("radixmesh.tls")

PEER_PREFIX = "/peer/"
REJECT_REASONS = ("no_tls", "no_client_cert")
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}
_SHORT_NAMES = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
                "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST",
                "domainComponent": "DC"}


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The listening side: our certificate; client certificates optional, verified by ``ca``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(cafile=ca)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The sending side: our certificate; the peer's must chain to ``ca`` and name its host."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED + check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=ca)
    ctx.load_cert_chain(cert, key)
    return ctx


def distinguished_name(cert: dict[str, Any] | None) -> str | None:
    """RFC 4514-style subject of a certificate from ``getpeercert()``; None without one."""
    if not cert or not cert.get("subject"):
        return None
    rdns = ["+".join(f"{_SHORT_NAMES.get(k, k)}={v}" for k, v in rdn)
            for rdn in cert["subject"]]
    return ",".join(reversed(rdns))


def tls_extension(transport: asyncio.BaseTransport) -> dict[str, Any] | None:
    """The ASGI TLS extension of one connection (None: not a TLS connection)."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    cert = transport.get_extra_info("peercert")  # verified by the handshake, or None
    der = ssl_object.getpeercert(binary_form=True)
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der and cert else [],
        "client_cert_name": distinguished_name(cert),
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": None,
    }


class _WithTlsExtension:
    """One connection's ASGI app: each request's scope gains the connection's TLS extension."""

    def __init__(self, app: ASGIApp, extension: dict[str, Any]) -> None:
        self.app = app
        self.extension = extension

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            extensions = dict(scope.get("extensions") or {})
            extensions.setdefault("tls", self.extension)  # a server's own value wins
            scope["extensions"] = extensions
        await self.app(scope, receive, send)


def protocol_class() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, whose connections put the TLS extension into their scopes."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class TlsExtensionProtocol(base):  # type: ignore[misc]
        app: ASGIApp  # set by uvicorn's __init__, run for each request of the connection

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            extension = tls_extension(transport)
            if extension is not None:
                self.app = _WithTlsExtension(self.app, extension)

    return TlsExtensionProtocol


class PeerTls:
    """A node's TLS material and its peer-request check; attached to the node (``/metrics``,
    ``/mesh``: ``peer_tls``)."""

    name = "peer_tls"

    def __init__(self, cert: str, key: str, ca: str) -> None:
        self.files = (cert, key, ca)
        self.server_context = server_context(cert, key, ca)
        self.client_context = client_context(cert, key, ca)
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.peers: Any = None  # the node's PeerClient (its TLS failures are reported here)

    @classmethod
    def from_config(cls, config: Any) -> PeerTls | None:
        """None without ``--peer-tls-*``; raises OSError / ssl.SSLError on unusable files."""
        if not getattr(config, "peer_tls", False):
            return None
        return cls(config.peer_tls_cert, config.peer_tls_key, config.peer_tls_ca)

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords: serve HTTPS with our context, fill the TLS extension."""
        return {"ssl_context_factory": lambda _config, _default: self.server_context,
                "http": protocol_class()}

    def refusal(self, scope: Scope) -> str | None:
        """Why a peer request must be refused (a :data:`REJECT_REASONS` entry), or None."""
        tls = (scope.get("extensions") or {}).get("tls")
        if not isinstance(tls, dict):
            return "no_tls"
        if not tls.get("client_cert_name") or tls.get("client_cert_error"):
            return "no_client_cert"
        return None

    # ------------------------------------------------------------------ node attachment
    async def start(self) -> None:
        log.info("peer TLS on: HTTPS on this port, /peer/* needs a client certificate "
                 "signed by %s", self.files[2])

    async def stop(self) -> None:
        return None

    def mesh_state(self) -> dict[str, object]:
        return {"enabled": True, "cert": self.files[0], "ca": self.files[2],
                "accepted": self.accepted, "rejected": dict(self.rejected)}

    def metrics(self) -> dict[str, float]:
        out = {"peer_tls_enabled": 1.0, "peer_tls_accepted": float(self.accepted)}
        for reason in REJECT_REASONS:
            out[f"peer_tls_rejected_{reason}"] = float(self.rejected[reason])
        out["peer_tls_rejected_total"] = float(sum(self.rejected.values()))
        if self.peers is not None:
            out["peer_tls_client_failures"] = float(self.peers.tls_failed)
        return out


def refused_body(reason: str) -> dict[str, object]:
    return {
        "error": {
            "message": "peer endpoints need a TLS client certificate signed by the mesh CA "
                       f"({reason})",
            "type": "authentication_error",
            "param": None,
            "code": "peer_tls_client_cert_required",
        }
    }


class PeerTlsMiddleware:
    """ASGI middleware: ``/peer/*`` needs a connection with a CA-verified client certificate."""

    def __init__(self, app: ASGIApp, tls: PeerTls) -> None:
        self.app = app
        self.tls = tls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope["path"]).startswith(PEER_PREFIX):
            reason = self.tls.refusal(scope)
            if reason is not None:
                count = self.tls.rejected[reason] = self.tls.rejected[reason] + 1
                if count == 1 or count % 1000 == 0:
                    client = scope.get("client")
                    log.warning("refused a peer request from %s without a verified client "
                                "certificate (%s, #%d of this kind)",
                                client[0] if client else "an unknown client", reason, count)
                await JSONResponse(refused_body(reason), status_code=403)(scope, receive, send)
                return
            self.tls.accepted += 1
        await self.app(scope, receive, send)


def install_peer_tls(app: Any, service: Any) -> PeerTls | None:
    """With ``--peer-tls-*``: check /peer/* requests, send to peers over HTTPS, report in
    /metrics and /mesh; ``app.state.peer_tls`` then holds what :func:`uvicorn_options` needs."""
    tls = PeerTls.from_config(service.config)
    app.state.peer_tls = tls
    if tls is None:
        return None
    app.add_middleware(PeerTlsMiddleware, tls=tls)
    service.peers.use_tls(tls.client_context)
    tls.peers = service.peers
    service.attachments.append(tls)
    return tls


def uvicorn_options(app: Any) -> dict[str, Any]:
    """Extra ``uvicorn.Config`` keywords for an app from ``create_app`` ({} without TLS)."""
    tls: PeerTls | None = getattr(app.state, "peer_tls", None)
    return tls.uvicorn_options() if tls is not None else {}
