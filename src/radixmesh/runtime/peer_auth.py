"""The runtime side of peer and client authentication (the pure part is core/auth.py).

Peer messages (gossip, forwarded requests) carry ``x-radixmesh-auth``: the sender signs the
exact body bytes it sends with the cluster key, the receiver verifies the exact bytes it read
before decoding anything. This module supplies what the core must not own: the wall clock
(``time.time()`` — the header's timestamp is compared across nodes, so it cannot be the
monotonic clock) and nonces from ``secrets``.

Without a key the node runs open (development mode): it signs nothing, accepts everything, and
says so loudly at start-up. With a key, unauthenticated, forged, stale or replayed peer
messages are refused with 401/403 and counted by reason (``peer_auth_rejected_<reason>``).

The client API can require a bearer token (``--api-key``): compared in constant time. It also
guards /mesh, /metrics and the (loopback-only) /admin endpoints; the health probe stays open
so load balancers and the launcher can poll it.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from radixmesh.core.auth import (
    AUTH_FAILURE_REASONS,
    NONCE_BYTES,
    AuthConfig,
    AuthError,
    ClusterKey,
    Signer,
    Verified,
    Verifier,
)
from radixmesh.core.headers import HEADER_AUTH
from radixmesh.core.tenants import ApiKeys, Caller

ENV_CLUSTER_KEY = "RADIXMESH_CLUSTER_KEY"
ENV_API_KEY = "RADIXMESH_API_KEY"
ENV_PREVIOUS_KEY = "RADIXMESH_CLUSTER_KEY_PREVIOUS"  # still accepted (not used to sign): rotation
GOSSIP_PURPOSE = "gossip"
API_PROTECTED_PREFIXES = ("/v1/", "/mesh", "/metrics", "/admin/")  # /health stays open
TENANT_STATE = "radixmesh_tenant"  # the request-state key of the caller's tenant

log = logging.getLogger("radixmesh.auth")

NO_KEY_WARNING = (
    "!!! NO CLUSTER KEY: peer messages (gossip, forwards) are NOT authenticated. Anyone who can "
    "reach this port can inject gossip and steer routing. Set --cluster-key, the "
    f"{ENV_CLUSTER_KEY} environment variable or cluster-key in the config file. !!!"
)


def forward_purpose(path: str) -> str:
    """The MAC purpose of a forwarded request to ``path`` (binds a body to its endpoint)."""
    return f"forward {path}"


def resolve_secret(configured: str, env: Mapping[str, str] | None = None, var: str = "") -> str:
    """A flag/config value wins over the environment; ``""`` means none."""
    if configured:
        return configured
    return (env if env is not None else os.environ).get(var, "")


class PeerAuth:
    """Signs outgoing and verifies incoming peer messages of one node (or does neither)."""

    def __init__(self, key_text: str, node_id: str, config: AuthConfig | None = None,
                 previous_key_text: str | None = None) -> None:
        """``previous_key_text`` (default: ``$RADIXMESH_CLUSTER_KEY_PREVIOUS``) is accepted
        but never used to sign: deploy it everywhere with the new key, then remove it."""
        if previous_key_text is None:
            previous_key_text = os.environ.get(ENV_PREVIOUS_KEY, "")
        self.key = ClusterKey.from_text(key_text) if key_text.strip() else None
        keys = [self.key] if self.key else []
        if self.key and previous_key_text.strip():
            keys.append(ClusterKey.from_text(previous_key_text))
        self._signer = Signer(self.key, node_id) if self.key else None
        self._verifier = Verifier(keys, config) if keys else None
        self.unauthenticated_accepted = 0  # peer messages accepted in open mode
        self.rejections_logged: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def warn_if_open(self) -> None:
        if not self.enabled:
            log.warning(NO_KEY_WARNING)

    def headers(self, purpose: str, body: bytes) -> dict[str, str]:
        """Headers to send with ``body`` (empty in open mode)."""
        if self._signer is None:
            return {}
        value = self._signer.sign(purpose, body, time.time(), secrets.token_bytes(NONCE_BYTES))
        return {HEADER_AUTH: value}

    def verify(self, headers: Mapping[str, str], purpose: str, body: bytes) -> Verified | None:
        """Check an incoming peer message; raises :class:`AuthError`. None in open mode."""
        if self._verifier is None:
            self.unauthenticated_accepted += 1
            return None
        return self._verifier.verify(headers.get(HEADER_AUTH), purpose, body, time.time())

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"peer_auth_enabled": 1.0 if self.enabled else 0.0}
        rejected = self._verifier.rejected if self._verifier else {}
        for reason in AUTH_FAILURE_REASONS:
            out[f"peer_auth_rejected_{reason}"] = float(rejected.get(reason, 0))
        out["peer_auth_rejected_total"] = float(sum(rejected.values()))
        out["peer_auth_accepted"] = float(self._verifier.accepted if self._verifier else 0)
        out["peer_auth_replay_cache_size"] = float(
            self._verifier.replay_cache_size if self._verifier else 0
        )
        out["peer_auth_unauthenticated_accepted"] = float(self.unauthenticated_accepted)
        return out


def refused(auth: PeerAuth, exc: AuthError, sender: str | None) -> JSONResponse:
    """The 401/403 answer to a refused peer message; logs the first of each reason loudly."""
    note_refusal(auth, exc, sender)
    return JSONResponse(auth_error_body(exc), status_code=exc.http_status)


def note_refusal(auth: PeerAuth, exc: AuthError, sender: str | None) -> None:
    """Count a refused peer message by reason; log the first of each reason loudly."""
    count = auth.rejections_logged.get(exc.reason, 0) + 1
    auth.rejections_logged[exc.reason] = count
    if count == 1 or count % 1000 == 0:
        log.warning("refused a peer message from %s (%s, #%d of this kind): %s",
                    sender or "an unknown sender", exc.reason, count, exc)


def auth_error_body(exc: AuthError) -> dict[str, object]:
    """OpenAI-style error body for a refused peer message."""
    return {
        "error": {
            "message": f"peer authentication failed: {exc}",
            "type": "authentication_error",
            "param": None,
            "code": f"peer_auth_{exc.reason}",
        }
    }


class ApiKeyCheck:
    """Optional bearer-token check of the client API: the operator key (``--api-key``) and
    the tenants' keys (``--api-keys FILE``), see core/tenants.py."""

    def __init__(self, api_key: str, tenant_keys: Mapping[str, str] | None = None) -> None:
        self.keys = ApiKeys(api_key, tenant_keys)

    @property
    def enabled(self) -> bool:
        return self.keys.enabled

    @property
    def rejected(self) -> int:
        return self.keys.rejected

    def caller(self, authorization: str | None) -> Caller | None:
        """Who sent it (None: no known key)."""
        return self.keys.caller(authorization)

    def allows(self, authorization: str | None) -> bool:
        return self.caller(authorization) is not None

    @staticmethod
    def error_body() -> dict[str, object]:
        return {
            "error": {
                "message": "missing or invalid API key (send 'Authorization: Bearer <key>')",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }


class ApiKeyMiddleware:
    """ASGI middleware: the client API and observability routes need the bearer token."""

    def __init__(self, app: ASGIApp, check: ApiKeyCheck) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and path.startswith(API_PROTECTED_PREFIXES):
            raw = dict(scope.get("headers") or []).get(b"authorization")
            caller = self.check.caller(None if raw is None else raw.decode("latin-1"))
            if caller is None:
                response = JSONResponse(ApiKeyCheck.error_body(), status_code=401,
                                        headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            if not caller.operator and not path.startswith("/v1/"):
                await JSONResponse(_tenant_refused(), status_code=403)(scope, receive, send)
                return
            scope.setdefault("state", {})[TENANT_STATE] = caller.tenant
        await self.app(scope, receive, send)


def _tenant_refused() -> dict[str, object]:
    return {"error": {"message": "a tenant's API key opens /v1/* only (/mesh, /metrics and "
                      "/admin need the operator key, --api-key)", "type": "permission_error",
                      "param": None, "code": "tenant_key_not_allowed"}}


def request_tenant(state: Mapping[str, Any]) -> str | None:
    """The tenant the API-key middleware found for a request (None: operator or open)."""
    tenant = state.get(TENANT_STATE)
    return tenant if isinstance(tenant, str) else None


def install_api_key_check(app: Any, check: ApiKeyCheck) -> None:
    """Require the bearer token on ``app`` when ``check`` holds a key (no-op otherwise)."""
    if check.enabled:
        app.add_middleware(ApiKeyMiddleware, check=check)
