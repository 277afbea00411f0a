"""The node's HTTP surface (FastAPI): OpenAI client API, peer endpoints, admin, observability.

No routing logic lives here: handlers validate and shape; ``NodeService`` decides and executes.
Over 400 lines because it is one FastAPI app: its client, peer and admin routes share the same
auth, body-limit and error-shaping plumbing, and splitting them would scatter a single surface.

Client API   POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
             GET /v1/models/{id} (404 model_not_found); bodies are the pydantic models of
             runtime/openai_api.py (FastAPI validates them; a failure is an OpenAI error with
             400, never FastAPI's 422) after ``BodyLimit`` read them (413 over the limit).
             A response's choices are one execution each (prompts x n), started through
             the node's request path one after the other; where each runs is the core's
             decision (``RequestArrived.plain``, ``sample_of``: its other samples go where
             the first went, reusing its cached prompt; sampling the forward protocol cannot
             carry stays here).
             Stop strings are matched here, on the
             tokens as they arrive (also for a forwarded request, which then streams tokens
             even if the client asked for one JSON body): a match ends the request as done and
             stops the engine through the same abort as a client that went away
Observe      GET /health, GET /version, GET /metrics (Prometheus text), GET /mesh (JSON),
             GET /mesh/decisions?limit=&placement=&request= (the routing decisions kept, and
             the verdicts on peers' forwards: core/decisions.py; ``request`` is the
             ``x-radixmesh-request`` header's number)
Peers        POST /peer/gossip (raw gossip bytes), POST /peer/forward (an encoded
             ForwardRequest, executed here; the body of the answer is framed ForwardReply
             messages: ForwardAdmitted first, or ForwardBusy when the core refuses — queue
             at the push-back threshold, or slower than the sender's ``beat_s``);
             POST /peer/link (many forwards over one open exchange: runtime/peer_link.py);
             both are served by the ``PeerForward`` middleware, not FastAPI routes
Admin        GET|POST /admin/partition (loopback clients only): cut this node off from peers;
             /admin/netem, /admin/engine-delay, /admin/debug: fault injection (runtime/debug.py)

Peer endpoints verify ``x-radixmesh-auth`` (HMAC, runtime/peer_auth.py) when the node has a
cluster key, and with --peer-tls-* a CA-verified TLS client certificate (peer_tls.py); the
client API and /mesh, /metrics need ``Authorization: Bearer`` with --api-key.

Request headers understood on the client API:
  ``x-radixmesh-hop``     the request was already forwarded once: execute here (hop limit 1)
  ``x-radixmesh-target``  experiments: forward to this peer id (fallbacks still apply)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixmesh import __version__
from radixmesh.core.adapters import Adapter, AmbiguousAdapter, UnknownAdapter, given_digest
from radixmesh.core.auth import AuthError
from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.forward_codec import decode_forward_request, decode_link_open
from radixmesh.core.headers import (
    HEADER_ADAPTER_DIGEST,
    HEADER_CACHED,
    HEADER_EXPECTED,
    HEADER_FROM,
    HEADER_FROM_ADDRESS,
    HEADER_HOP,
    HEADER_NODE,
    HEADER_OVERHEAD,
    HEADER_PLACEMENT,
    HEADER_QUEUE,
    HEADER_REQUEST,
    HEADER_ROUTE,
    HEADER_SERVED_BY,
    HEADER_SERVICE,
    HEADER_SESSION,
    HEADER_TARGET,
    STREAM_TIMING_COMMENT,
)
from radixmesh.core.messages import ForwardRequest
from radixmesh.core.router import Tag
from radixmesh.core.tenants import check_cache_field
from radixmesh.engine.base import SamplingParams, TokenLogprob, isolates
from radixmesh.runtime.debug import install_debug_routes
from radixmesh.runtime.execution import Execution, Outcome
from radixmesh.runtime.node import NodeService, Overloaded
from radixmesh.runtime.openai_api import (
    ApiError,
    ApiRequest,
    ChatCompletionResponse,
    ChatRequest,
    Choice,
    CompletionRequest,
    CompletionResponse,
    Detokenizer,
    ErrorResponse,
    LogprobShaper,
    ModelEntry,
    ModelList,
    StreamShaper,
    error_body,
    new_id,
    parse_chat,
    parse_completion,
    parse_json,
    response_body,
    served_request_models,
    server_defaults,
    usage_body,
    validation_error,
)
from radixmesh.runtime.openapi import install_openapi
from radixmesh.runtime.peer_auth import (
    GOSSIP_PURPOSE,
    forward_purpose,
    install_api_key_check,
    note_refusal,
    refused,
    request_tenant,
)
from radixmesh.runtime.peer_client import FORWARD_MEDIA_TYPE, FORWARD_PATH
from radixmesh.runtime.peer_link import LINK_PATH, Refused, headers_of, serve_link
from radixmesh.runtime.peer_tls import install_peer_tls

log = logging.getLogger("radixmesh.app")

PLACEMENT_TAGS = frozenset(t.value for t in Tag)  # what /mesh/decisions?placement= takes
LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_PEER_BODY = 64 * 1024 * 1024  # forward bodies (encoded prompts); gossip has its own limit
# uvicorn closes a connection idle for ``timeout_keep_alive`` (default 5 s, httpx's own idle
# expiry too; aiohttp keeps one 15 s, Go's net/http 90 s). A request a client sends on a
# connection the server is closing at that instant is lost (ECONNRESET: httpx.ReadError, before
# any header). The server must be the last to give an idle connection up: well past the clients'.
KEEP_ALIVE_S = 120.0


def create_app(service: NodeService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        log.info("node %s ready at http://%s (incarnation %d)", service.node_id,
                 service.address, service.incarnation)
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="radixmesh node", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service
    _install_errors(app, service)
    _client_routes(app, service)
    _peer_routes(app, service)
    _admin_routes(app, service)
    install_debug_routes(app, service)
    install_openapi(app)  # generated from the routes' pydantic models
    app.add_middleware(PeerForward, service=service)  # innermost: auth and TLS checks apply
    app.add_middleware(BodyLimit, limit=service.config.max_body_bytes, service=service)
    install_api_key_check(app, service.api_key)
    install_peer_tls(app, service)  # --peer-tls-*: /peer/* needs a CA-signed client cert
    return app


def node_server(config: Any, service: NodeService) -> Any:
    """uvicorn's server for ``service``'s app: when it stops, it ends the links peers opened
    first (uvicorn waits for open requests, and a link does not end by itself)."""
    return node_server_class()(config, service)


@functools.cache
def node_server_class() -> type[Any]:
    import uvicorn

    class NodeServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, service: NodeService) -> None:
            super().__init__(config)
            self.service = service

        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            self.service.links.close_all()
            await super().shutdown(sockets)

    return NodeServer


# ---------------------------------------------------------------------------------- errors
def error_response(err: ApiError, service: NodeService | None = None) -> JSONResponse:
    if service is not None:
        service.metrics.client_errors[err.status] += 1
    return JSONResponse(err.body(), status_code=err.status)


def _install_errors(app: FastAPI, service: NodeService) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        service.metrics.client_errors[exc.status_code] += 1
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()), service)  # 400, not 422

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        service.metrics.client_errors[500] += 1
        return JSONResponse(error_body(f"Internal error: {type(exc).__name__}", "server_error"),
                            status_code=500)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"Request body too large (limit {limit} bytes).", status=413,
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"Request body too large (limit {limit} bytes).", status=413,
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------- client
class BodyLimit:
    """ASGI middleware: a client API body over ``limit`` bytes is a 413 (OpenAI error body),
    read here whole before FastAPI parses and validates it; then replayed to the app (later
    ``receive`` calls go to the client: disconnect detection). These endpoints take JSON
    only, so the body is parsed as JSON whatever its content type (``curl -d`` sends
    ``application/x-www-form-urlencoded``)."""

    def __init__(self, app: ASGIApp, limit: int, service: NodeService) -> None:
        self.app, self.limit, self.service = app, limit, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _BODY_PATHS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = ApiError(f"Request body too large (limit {self.limit} bytes).", status=413,
                       code="request_too_large")
        await error_response(err, self.service)(scope, receive, send)


_BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": "OpenAI-style error"}
            for code in codes}


def _generation_responses(model: type[Any]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "the completion (JSON), or server-sent "
                  "events of chunks of the same shape when streaming",
                  "content": {"text/event-stream": {}}},
            **_errors(400, 401, 404, 413, 429, 503)}


def _client_routes(app: FastAPI, service: NodeService) -> None:
    models = [service.engine.model_name, *service.adapters]  # (tenants) adapters by name
    _generation_routes(app, service, models)
    _model_routes(app, service, models)
    _node_routes(app, service)


def _generation_routes(app: FastAPI, service: NodeService, models: list[str]) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""
    completion_body, chat_body = served_request_models(models)

    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await _generate(request, service, models, body)

    async def chat(request: Request, body: ChatRequest) -> Response:
        return await _generate(request, service, models, body)

    # the served subclasses (their schema names the served model): set here, not as string
    # annotations, which FastAPI would resolve in this module's globals
    completions.__annotations__["body"] = completion_body
    chat.__annotations__["body"] = chat_body
    app.post("/v1/completions", summary="text completion",
             responses=_generation_responses(CompletionResponse))(completions)
    app.post("/v1/chat/completions", summary="chat completion",
             responses=_generation_responses(ChatCompletionResponse))(chat)


def _model_routes(app: FastAPI, service: NodeService, models: list[str]) -> None:
    """``/v1/models`` and ``/v1/models/{model_id}``."""
    created = int(time.time())

    @app.get("/v1/models", summary="served models, with this server's defaults and limits",
             response_model=ModelList, responses=_errors(401))
    async def list_models() -> ModelList:
        listed = [*models, *_remote_adapters(service, models)]
        return ModelList(object="list", data=[_model_entry(service, m, created) for m in listed])

    @app.get("/v1/models/{model_id:path}", summary="one served model (OpenAI's retrieve model)",
             response_model=ModelEntry, responses=_errors(401, 404))
    async def retrieve_model(model_id: str) -> Response:
        if model_id not in models and model_id not in _remote_adapters(service, models):
            return error_response(ApiError(f"The model '{model_id}' does not exist.",
                                           status=404, param="model", code="model_not_found"),
                                  service)
        return JSONResponse(_model_entry(service, model_id, created).model_dump())


def _node_routes(app: FastAPI, service: NodeService) -> None:
    """``/health``, ``/version``, ``/mesh``, ``/mesh/decisions`` and ``/metrics``."""

    @app.get("/health", summary="liveness (503 while leaving)",
             responses={503: {"description": "the node is leaving (draining)"}})
    async def health() -> Response:
        body = service.health()  # leaving (SIGTERM drain): 503, so readiness probes drop it
        return JSONResponse(body, status_code=503 if body["status"] == "leaving" else 200)

    @app.get("/version", summary="this server's version (vLLM's shape)")
    async def version() -> dict[str, str]:
        # SMG 1.13 identifies a worker by it (else: SGLang's info routes, past its timeout at 64)
        return {"version": __version__, "server": "radixmesh"}

    @app.get("/mesh", summary="this node's view of the mesh", responses=_errors(401))
    async def mesh() -> dict[str, object]:
        return service.mesh()

    @app.get("/mesh/decisions", summary="this node's recent routing decisions",
             responses=_errors(400, 401))
    async def decisions(limit: int = 100, placement: str | None = None,
                        request: int | None = None) -> Response:
        if limit < 1:
            return error_response(ApiError("limit must be >= 1", param="limit"), service)
        if placement is not None and placement not in PLACEMENT_TAGS:
            known = ", ".join(sorted(PLACEMENT_TAGS))
            return error_response(ApiError(f"unknown placement {placement!r}; known: {known}",
                                           param="placement"), service)
        return JSONResponse(service.decisions(limit, placement, request))

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
             responses=_errors(401))
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.prometheus(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def _remote_adapters(service: NodeService, models: Sequence[str]) -> list[str]:
    """The adapters live peers advertise (gossip) that this node does not serve itself."""
    return sorted(service.core.adapter_names().difference(models))


def _model_entry(service: NodeService, model: str, created: int) -> ModelEntry:
    """OpenAI's model object, plus this server's limits and defaults (``radixmesh``); an
    adapter names its base model (``parent``, as vLLM) and its content digest; one only
    peers serve is ``remote`` (its digest: none when peers serve different weights as it)."""
    adapter = service.adapters.get(model)
    remote = adapter is None and model != service.engine.model_name
    if remote:
        with contextlib.suppress(UnknownAdapter, AmbiguousAdapter):
            adapter = service.core.adapter(model, {}, None)
    return ModelEntry(id=model, object="model", created=created, owned_by="radixmesh",
                      max_model_len=service.engine.max_context, radixmesh=server_defaults(),
                      parent=service.engine.model_name if adapter or remote else None,
                      digest=None if adapter is None else adapter.digest, remote=remote)


@dataclass(slots=True)
class _Sample:
    """One choice of a response: sample ``index`` (OpenAI's numbering: prompt * n + j)."""

    index: int
    prompt: list[int]
    ex: Execution
    first: _Sample | None = None  # the prompt's first sample (n > 1: its prompt logprobs)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # its answer is complete


async def _generate(request: Request, service: NodeService, models: Sequence[str],
                    body: CompletionRequest | ChatRequest) -> Response:
    try:
        known = [*models, *sorted(service.core.adapter_names().difference(models))]
        api = (parse_completion(body, known) if isinstance(body, CompletionRequest)
               else parse_chat(body, known))
        _check_engine(service, api)
        adapter = _adapter(request, service, api.model)
        namespace, session = _namespace(request, service, api, adapter)
        prompts = _tokenize(service, api)
        samples = await _start(request, service, api, prompts, namespace, session, adapter)
    except ApiError as err:
        return error_response(err, service)
    except Overloaded as full:
        return _overloaded(service, full)
    rid = new_id(api.kind)
    if api.stream:
        return StreamingResponse(_sse(service, api, samples, rid), media_type="text/event-stream",
                                 headers=_start_headers(service, samples[0].ex))
    try:
        answer = await _unless_disconnected(request, _answers(service, api, samples))
    except Exception:
        if not any(service.cut_by_drain(s.ex) for s in samples):
            raise
        cut = error_response(_drain_cut(service), service)  # 503: retry on another node
        cut.headers["retry-after"] = "1"
        return cut
    if answer is None:  # nobody to answer: the work was stopped through the core's Abort
        service.metrics.client_disconnects += 1
        return Response(status_code=499)
    choices, outcomes = answer
    return JSONResponse(response_body(api, rid, choices, usage=_usage(samples, outcomes)),
                        headers=_outcome_headers(service, samples[0].ex, outcomes[0]))


def _check_engine(service: NodeService, api: ApiRequest) -> None:
    """Penalties and log-probabilities need an engine that honours them (never ignored)."""
    param = api.extended
    if param is not None and not getattr(service.engine, "extended_sampling", False):
        raise ApiError(f"'{param}' is not supported: this node's engine does not compute it.",
                       param=param, code="unsupported_value")
    if api.max_tokens == 0 and api.n > 1:
        raise ApiError("'n' must be 1 with max_tokens 0 (the samples would be identical).",
                       param="n", code="unsupported_value")


def _adapter(request: Request, service: NodeService, model: str) -> Adapter | None:
    """The adapter ``model`` names, served here or by a peer (core/adapters.py ``resolve``;
    None: the base model): 404 when no node serves it, 409 when peers serve different weights
    under the name and the request pins no digest (``x-radixmesh-adapter-digest``)."""
    raw = request.headers.get(HEADER_ADAPTER_DIGEST)
    pin = None if raw is None else given_digest(raw.strip().lower())
    if raw is not None and pin is None:
        raise ApiError(f"{HEADER_ADAPTER_DIGEST} must be 16-64 hex digits (sha256:HEX or HEX).",
                       param=HEADER_ADAPTER_DIGEST, code="invalid_value")
    if model == service.engine.model_name and pin is None:
        return None
    try:
        return service.core.adapter(model, service.adapters, pin)
    except UnknownAdapter as exc:
        raise ApiError(f"The model '{model}' does not exist: {exc}.", status=404,
                       param="model", code="model_not_found") from None
    except AmbiguousAdapter as exc:
        raise ApiError(f"{exc}.", status=409, param="model", code="model_ambiguous") from None


def _namespace(request: Request, service: NodeService, api: ApiRequest,
               adapter: Adapter | None = None) -> tuple[str | None, int | None]:
    """The request's cache namespace — its tenant (``--api-keys``) and ``cache_salt``
    (core/tenants.py); refused (400) on an engine that would share its cache anyway — and
    its session id (``prompt_cache_key``, else ``x-session-id``; core/sessions.py)."""
    try:
        header = check_cache_field(HEADER_SESSION, request.headers.get(HEADER_SESSION))
    except ValueError as exc:
        raise ApiError(f"{exc}.", param=HEADER_SESSION, code="invalid_value") from None
    tenant = request_tenant(request.scope.get("state") or {})
    key = api.prompt_cache_key or header
    session = None if key is None else service.namespacer.session_id(tenant, key)
    namespace = service.namespacer.namespace_id(tenant, api.cache_salt,
                                                None if adapter is None else adapter.digest)
    if namespace is not None and not isolates(service.engine):
        raise ApiError("'cache_salt' and tenant keys need an engine that keeps cache "
                       "namespaces apart; this node's engine does not.", param="cache_salt",
                       code="unsupported_value")
    return namespace, session


async def _start(request: Request, service: NodeService, api: ApiRequest,
                 prompts: list[list[int]], namespace: str | None = None,
                 session: int | None = None, adapter: Adapter | None = None) -> list[_Sample]:
    """One execution per prompt and sample, each through the node's request path, in order:
    a prompt's first sample, then its others, reported with the node that serves the first
    (the core sends them there: they reuse its cached prompt; the engine runs requests in
    order)."""
    hop = request.headers.get(HEADER_HOP) is not None
    target = request.headers.get(HEADER_TARGET) or None
    tokens = api.stream or bool(api.stop)  # stop strings: tokens as they come, matched here
    tenant = service.quota_key(request_tenant(request.scope.get("state") or {}))
    over = _over_quota(service, api, prompts, tenant)  # once, for every sample and prompt
    samples: list[_Sample] = []
    try:
        for p, prompt in enumerate(prompts):
            # where each runs is the core's (sampling the forward protocol cannot carry
            # stays here; the other samples go where the first went: RequestArrived)
            ex = await service.execute(prompt, _sampling(api, 0), tokens, local_only=hop,
                                       target=target, namespace=namespace, session=session,
                                       adapter=adapter, tenant=tenant,
                                       over_quota=over and p == 0)
            first = _Sample(p * api.n, prompt, ex)
            samples.append(first)
            for j in range(1, api.n):
                more = await service.execute(prompt, _sampling(api, j), tokens,
                                             local_only=hop, sample_of=ex.served_by,
                                             namespace=namespace, adapter=adapter,
                                             tenant=tenant)
                samples.append(_Sample(p * api.n + j, prompt, more, first))
    except BaseException:
        await _abandon([s.ex for s in samples])
        raise
    return samples


def _over_quota(service: NodeService, api: ApiRequest, prompts: list[list[int]],
                tenant: str | None) -> bool:
    """Whether the tenant is over its share of this node for all of this request's samples
    and prompts together (core/quotas.py: the first's verdict; the others ride on it); 400
    when they exceed its cap, as they can never run here at once."""
    tokens = sum(len(p) + api.max_tokens for p in prompts) * api.n
    try:
        return service.over_quota(tenant, tokens, len(prompts) * api.n)
    except ValueError as exc:
        raise ApiError(f"{exc}.", param="n", code="exceeds_tenant_quota") from None


async def _abandon(executions: Sequence[Execution]) -> None:
    """Stop started executions (a later one of the same request could not start): each ends
    as cancelled through the core's Abort, like a client that went away."""
    tasks = [asyncio.ensure_future(ex.result()) for ex in executions]
    await asyncio.sleep(0)  # each is tracked now (reachable by the core's Abort)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _usage(samples: Sequence[_Sample], outcomes: Sequence[Outcome]) -> dict[str, object]:
    """OpenAI's: each prompt counted once (its first sample's cached tokens), every choice's
    completion tokens."""
    firsts = [o for s, o in zip(samples, outcomes, strict=True) if s.first is None]
    return usage_body(sum(o.prompt_tokens for o in firsts),
                      sum(len(o.output_ids) for o in outcomes),
                      sum(o.cached_tokens for o in firsts))


def _drain_cut(service: NodeService) -> ApiError:
    """A request still running when this node's drain grace ended (SIGTERM): 503."""
    return ApiError("This node shut down before the request finished (its drain grace "
                    f"of {service.config.drain_grace:g} s ended); retry it.", status=503,
                    type_="server_error", code="node_shutting_down")


def _overloaded(service: NodeService, full: Overloaded) -> JSONResponse:
    """HTTP 429 with ``Retry-After``: this node is full (or, ``full.quota``, the caller's
    tenant is over its share of it: core/quotas.py) and no peer had room."""
    retry = f"Retry after {full.retry_after_s:.0f} s."
    err = (ApiError("Your tenant's share of this node's queue is in use and no other node had "
                    f"room for this request now. {retry}", status=429,
                    type_="rate_limit_error", code="tenant_quota_exceeded") if full.quota else
           ApiError(f"The mesh is overloaded: no node has room for this request now. {retry}",
                    status=429, type_="rate_limit_error", code="overloaded"))
    response = error_response(err, service)
    response.headers["retry-after"] = str(max(1, math.ceil(full.retry_after_s)))
    return response


_T = TypeVar("_T")


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """``work`` (an execution's answer), or None once the client went away first (local,
    queued or forwarded work alike is then stopped: reported to the core as cancelled)."""
    result = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if result.done():
        return result.result()
    result.cancel()
    await asyncio.gather(result, return_exceptions=True)
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was already read whole)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _tokenize(service: NodeService, api: ApiRequest) -> list[list[int]]:
    """Every prompt's token ids (chat: the one templated conversation)."""
    tok = service.engine.tokenizer
    param = "messages" if api.kind == "chat" else "prompt"
    try:
        if api.kind == "chat":
            prompts = [list(tok.apply_chat_template(list(api.messages)))]
        else:
            prompts = [list(p) if isinstance(p, tuple) else tok.encode(p) for p in api.prompts]
    except ValueError as exc:  # a role the template refuses, text no UTF-8 holds
        raise ApiError(str(exc), param=param) from None
    for ids in prompts:
        _check_prompt(service, api, ids)
    return prompts


def _check_prompt(service: NodeService, api: ApiRequest, ids: list[int]) -> None:
    param = "messages" if api.kind == "chat" else "prompt"
    if not ids:
        raise ApiError("The prompt is empty.", param=param, code="invalid_value")
    limit = service.engine.max_context
    if len(ids) + api.max_tokens > limit or len(ids) >= limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + api.max_tokens} tokens ({len(ids)} in the prompt, {api.max_tokens} "
            "for the completion). Please reduce the prompt or the completion length.",
            param=param, code="context_length_exceeded",
        )
    if max(ids) >= service.engine.tokenizer.vocab_size:
        raise ApiError(f"Token ids must be below {service.engine.tokenizer.vocab_size}.",
                       param=param, code="invalid_value")


def _sampling(api: ApiRequest, sample: int) -> SamplingParams:
    try:
        return api.sampling(sample=sample)
    except ValueError as exc:
        raise ApiError(str(exc), code="invalid_value") from None


# --------------------------------------------------------------------- answers and streams
class _ChoiceText:
    """One choice's text and log-probabilities as its tokens arrive (stop strings matched
    here: a match takes the tokens so far as the answer, ``Execution.stop``)."""

    def __init__(self, service: NodeService, api: ApiRequest, sample: _Sample) -> None:
        self.api, self.sample = api, sample
        decode = service.engine.tokenizer.decode
        self.det = Detokenizer(decode, api.stop)
        self.shaper = LogprobShaper(decode)
        self.chars = 0  # characters of this choice's text sent so far (echo included)
        self.scored = 0  # generated log-probability entries sent so far

    def echo(self, prompt_logprobs: Sequence[TokenLogprob | None]) -> tuple[str, object]:
        """The echoed prompt (completions with ``echo``) and its logprobs object."""
        text = self._echo_text()
        lp: object = None
        if self.api.logprobs is not None:
            ids = self.sample.prompt
            entries = list(prompt_logprobs) or [None] * len(ids)
            lp = self.shaper.legacy(entries, ids, self.shaper.offsets(ids))
        self.chars = len(text)
        return text, lp

    def _echo_text(self) -> str:
        api, prompt = self.api, self.sample.prompt
        index = self.sample.index // api.n
        source = api.prompts[index] if index < len(api.prompts) else None
        return source if isinstance(source, str) else self.shaper.decode(prompt)

    def logprobs_of(self, entries: Sequence[TokenLogprob]) -> object:
        """The logprobs object of ``entries``, the next generated ones (None without any)."""
        if self.api.logprobs is None or not entries:
            return None
        self.scored += len(entries)
        if self.api.kind == "chat":
            return self.shaper.chat(entries)
        ids = [e.token_id for e in entries]
        offsets = self.shaper.offsets(ids, self.chars)
        return self.shaper.legacy(entries, ids, offsets)

    def advance(self, piece: str) -> None:
        self.chars += len(piece)


async def _token_pieces(ex: Execution, det: Detokenizer, per_token: bool = False
                       ) -> AsyncGenerator[tuple[str, list[int]], None]:
    """(new final text, the token ids it came with) as ``ex``'s tokens arrive: ``per_token``
    one item per token (its text may be empty: held back), else only non-empty text. On a
    stop-string match ``ex.stop`` takes the tokens so far as the answer, and closing the token
    stream stops the work (reported to the core as done: ``NodeService._ended``)."""
    ids: list[int] = []
    pending: list[int] = []
    async with aclosing(ex.tokens()) as tokens:
        async for tok in tokens:
            ids.append(tok)
            pending.append(tok)
            piece = det.push(tok)
            if det.stopped:
                ex.stop(ids)
                yield piece, pending
                return
            if piece or per_token:
                yield piece, pending
                pending = []
    tail = det.flush()
    if tail or pending:
        yield tail, pending


async def _pieces(ex: Execution, det: Detokenizer) -> AsyncGenerator[str, None]:
    """The text of ``ex``'s tokens as it becomes final (stop strings: see _token_pieces)."""
    async with aclosing(_token_pieces(ex, det)) as pieces:
        async for piece, _ in pieces:
            if piece:
                yield piece


def _choice_pieces(text: _ChoiceText) -> AsyncGenerator[tuple[str, list[int]], None]:
    return _token_pieces(text.sample.ex, text.det, text.api.logprobs is not None)


async def _answer(service: NodeService, api: ApiRequest, sample: _Sample
                  ) -> tuple[Choice, Outcome]:
    """One choice of a non-streamed response."""
    ex = sample.ex
    text = _ChoiceText(service, api, sample)
    if api.stop:
        body = "".join([piece async for piece, _ in _choice_pieces(text)])
        assert ex.outcome is not None
        outcome = ex.outcome
    else:
        outcome = await ex.result()
        body = service.engine.tokenizer.decode(outcome.output_ids)
    sample.settled.set()
    prefix, lp = "", None
    if api.kind == "completion" and api.echo:
        scored = outcome.prompt_logprobs
        if sample.first is not None and api.logprobs is not None:  # the first sample scored
            await sample.first.settled.wait()
            assert sample.first.ex.outcome is not None
            scored = sample.first.ex.outcome.prompt_logprobs
        prefix, lp = text.echo(scored)
    if api.logprobs is not None:
        # completions list the stop token that ended the answer too; chat does not
        entries = outcome.logprobs if api.kind == "completion" else outcome.logprobs[
            : len(outcome.output_ids)]
        gen = text.logprobs_of(entries)
        if api.kind == "chat":
            lp = gen or []
        elif lp is None:
            lp = gen or text.shaper.legacy([], [], [])
        elif isinstance(gen, dict) and isinstance(lp, dict):
            lp = {key: lp[key] + gen[key] for key in lp}
    return Choice(sample.index, prefix + body, outcome.finish_reason, lp), outcome


async def _answers(service: NodeService, api: ApiRequest, samples: Sequence[_Sample]
                   ) -> tuple[list[Choice], list[Outcome]]:
    try:
        async with asyncio.TaskGroup() as group:  # one fails or is cancelled: all stop
            tasks = [group.create_task(_answer(service, api, s)) for s in samples]
    except ExceptionGroup as failed:  # the first failure, as one request would raise it
        raise failed.exceptions[0] from None
    results = [t.result() for t in tasks]
    return [c for c, _ in results], [o for _, o in results]


async def _stream_choice(service: NodeService, api: ApiRequest, sample: _Sample,
                         shaper: StreamShaper, out: asyncio.Queue[bytes | None]) -> Outcome:
    """Put one choice's chunks on ``out`` (None when it ends, whatever the way)."""
    text = _ChoiceText(service, api, sample)
    ex, echoed = sample.ex, not (api.kind == "completion" and api.echo)
    try:
        async with aclosing(_choice_pieces(text)) as pieces:  # closed with us: the work stops
            async for piece, ids in pieces:
                if not echoed:
                    echoed = True
                    await out.put(_echo_chunk(text, shaper, sample))
                entries = ex.logprobs[text.scored : text.scored + len(ids)]
                await out.put(shaper.text(piece, sample.index, text.logprobs_of(entries)))
                text.advance(piece)
        outcome = ex.outcome
        assert outcome is not None
        if not echoed:
            await out.put(_echo_chunk(text, shaper, sample))
        rest = outcome.logprobs[text.scored :] if api.kind == "completion" else []
        await out.put(shaper.finish(outcome.finish_reason, sample.index,
                                    text.logprobs_of(rest)))
        return outcome
    finally:
        out.put_nowait(None)


def _echo_chunk(text: _ChoiceText, shaper: StreamShaper, sample: _Sample) -> bytes:
    first = sample.first.ex if sample.first is not None else sample.ex
    prompt_text, lp = text.echo(first.prompt_logprobs)
    return shaper.text(prompt_text, sample.index, lp)


async def _sse(service: NodeService, api: ApiRequest, samples: Sequence[_Sample], rid: str
               ) -> AsyncIterator[bytes]:
    shaper = StreamShaper(api, rid)
    for sample in samples:
        first = shaper.start(sample.index)
        if first is not None:
            yield first
    out: asyncio.Queue[bytes | None] = asyncio.Queue()
    tasks = [asyncio.create_task(_stream_choice(service, api, s, shaper, out)) for s in samples]
    try:
        running = len(tasks)
        while running:
            chunk = await out.get()
            if chunk is None:
                running -= 1
            else:
                yield chunk
        outcomes = [t.result() for t in tasks]  # raises what a choice raised
        usage = shaper.usage(_usage(samples, outcomes))
        if usage is not None:
            yield usage
        yield _timing_comment(outcomes[0])
    except Exception as exc:  # headers are gone: report in-band, like OpenAI does
        if any(service.cut_by_drain(s.ex) for s in samples):
            err = _drain_cut(service)
            service.metrics.client_errors[err.status] += 1
            yield shaper.error(err)
        else:
            log.exception("stream failed", exc_info=exc)
            service.metrics.client_errors[500] += 1
            yield shaper.error(ApiError(f"Internal error: {type(exc).__name__}", status=500,
                                        type_="server_error"))
    finally:  # the client went away (or a choice failed): every other choice stops too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    yield shaper.done()


def _timing_comment(out: Outcome) -> bytes:
    """A stream's headers leave before the engine has run: its queue and service times follow
    as an SSE comment (clients ignore comments; ``bench.client`` reads it)."""
    return (f"{STREAM_TIMING_COMMENT}queue;dur={out.queue_s * 1000:.3f}, "
            f"service;dur={out.service_s * 1000:.3f}\n\n").encode()


def _start_headers(service: NodeService, ex: Execution) -> dict[str, str]:
    return {
        HEADER_NODE: service.node_id,
        HEADER_SERVED_BY: ex.served_by,
        HEADER_ROUTE: ex.route,
        HEADER_EXPECTED: str(ex.expected_cached),
        HEADER_CACHED: str(ex.cached_estimate),  # streaming: the server's match at acceptance
        "cache-control": "no-cache",
    } | _choice_headers(ex)


def _outcome_headers(service: NodeService, ex: Execution, out: Outcome) -> dict[str, str]:
    headers = {
        HEADER_NODE: service.node_id,
        HEADER_SERVED_BY: out.served_by,
        HEADER_ROUTE: out.route,
        HEADER_EXPECTED: str(ex.expected_cached),
        HEADER_CACHED: str(out.cached_tokens),
        HEADER_QUEUE: f"{out.queue_s:.6f}",
        HEADER_SERVICE: f"{out.service_s:.6f}",
    }
    if out.forward_overhead_s is not None:
        headers[HEADER_OVERHEAD] = f"{out.forward_overhead_s:.6f}"
    return headers | _choice_headers(ex)


def _choice_headers(ex: Execution) -> dict[str, str]:
    """The entry node's number of the request (its routing decisions at ``/mesh/decisions``),
    and what its choice does to the prefix's copies (``core.router.Tag``; only where the
    policy places prefixes: ``cost``)."""
    out = {} if ex.ctx.rid is None else {HEADER_REQUEST: str(ex.ctx.rid)}
    if ex.placement is not None:
        out[HEADER_PLACEMENT] = ex.placement
    return out


# ---------------------------------------------------------------------------------- peers
def _peer_routes(app: FastAPI, service: NodeService) -> None:
    gossip_limit = service.node_config.gossip.max_message_bytes

    @app.post("/peer/gossip")
    async def gossip(request: Request) -> Response:
        try:
            data = await read_body(request, gossip_limit)
        except ApiError as err:
            service.metrics.gossip_oversize += 1
            return error_response(err)
        try:
            service.auth.verify(request.headers, GOSSIP_PURPOSE, data)
        except AuthError as exc:
            return refused(service.auth, exc, request.headers.get(HEADER_FROM))
        accepted = service.receive_gossip(data, request.headers.get(HEADER_FROM),
                                          request.headers.get(HEADER_FROM_ADDRESS))
        return Response(status_code=204 if accepted else 503)



def _parse_forward(service: NodeService, raw: bytes) -> ForwardRequest:
    """The peer's request, decoded by the one codec, then checked against this engine."""
    try:
        req = decode_forward_request(raw)
    except RemoteProtocolError as exc:
        raise ApiError(f"malformed forward: {exc}", param="body") from None
    if len(req.prompt) + req.max_tokens > service.engine.max_context:
        raise ApiError("prompt + max_tokens exceed the context", code="context_length_exceeded")
    if max(req.prompt) >= service.engine.tokenizer.vocab_size:
        raise ApiError("token id out of range", param="prompt")
    if req.namespace is not None and not isolates(service.engine):
        raise ApiError("this node's engine does not keep cache namespaces apart",
                       param="namespace", code="unsupported_value")
    if req.adapter is not None and service.adapter_of(req.adapter) is None:
        raise ApiError(f"no adapter of digest {req.adapter} is served here", status=404,
                       param="adapter", code="model_not_found")
    return req


class PeerForward:
    """ASGI middleware serving ``POST /peer/forward``: a forwarded request, answered with the
    framed replies of :meth:`NodeService.serve_forward`.

    Served here rather than as a FastAPI route: a forward pays this node's HTTP handling on
    top of the entry node's, and FastAPI's routing, dependency solving and
    ``StreamingResponse`` (a task group per response, every frame through each middleware's
    ``send``) cost more than the rest of the peer's side (benchmarks.md, "Node: forwarding
    overhead"). Installed innermost, so the API-key and peer-TLS middlewares still apply."""

    def __init__(self, app: ASGIApp, service: NodeService) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in (FORWARD_PATH, LINK_PATH):
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":  # as FastAPI answers for its own routes
            await error_response(ApiError("Method Not Allowed", status=405),
                                 self.service)(scope, receive, send)
            return
        service, request = self.service, Request(scope, receive)
        sender = request.headers.get(HEADER_FROM)
        if service.netem.drop_incoming(sender, request.headers.get(HEADER_FROM_ADDRESS)):
            response: Response = JSONResponse(error_body("partitioned", "unavailable"),
                                              status_code=503)
            await response(scope, receive, send)
            return
        if scope["path"] == LINK_PATH:
            await self._link(request, scope, receive, send)
            return
        try:
            raw = await read_body(request, MAX_PEER_BODY)
            service.auth.verify(request.headers, forward_purpose(FORWARD_PATH), raw)
            req = _parse_forward(service, raw)
        except AuthError as exc:
            response = refused(service.auth, exc, sender)
        except ApiError as err:
            service.metrics.forwards_rejected += 1
            response = error_response(err)
        else:
            await _stream_frames(service.serve_forward(req), request, send)
            return
        await response(scope, receive, send)

    async def _link(self, request: Request, scope: Scope, receive: Receive,
                    send: Send) -> None:
        """``POST /peer/link``: many forwards over one exchange (runtime/peer_link.py). The
        opening is authenticated like any peer request, then each forward on its own."""
        service = self.service
        sender = request.headers.get(HEADER_FROM)
        address = request.headers.get(HEADER_FROM_ADDRESS)
        purpose = forward_purpose(LINK_PATH)
        if service.links.closing:  # this server is stopping
            await JSONResponse(error_body("stopping", "unavailable"),
                               status_code=503)(scope, receive, send)
            return
        try:
            service.auth.verify(request.headers, purpose, b"")
        except AuthError as exc:
            await refused(service.auth, exc, sender)(scope, receive, send)
            return

        def admit(body: bytes) -> ForwardRequest:
            if service.netem.drop_incoming(sender, address):
                raise Refused(503, "partitioned")
            try:
                token, raw = decode_link_open(body)
            except RemoteProtocolError as exc:
                service.metrics.forwards_rejected += 1
                raise Refused(400, f"malformed forward: {exc}") from None
            try:
                service.auth.verify(headers_of(token), purpose, raw)
            except AuthError as exc:
                note_refusal(service.auth, exc, sender)
                raise Refused(exc.http_status, f"peer authentication failed: {exc}") from None
            try:
                return _parse_forward(service, raw)
            except ApiError as err:
                service.metrics.forwards_rejected += 1
                raise Refused(err.status, err.message) from None

        await serve_link(receive, send, service.links, admit, service.serve_forward)


_FORWARD_HEADERS = [(b"content-type", FORWARD_MEDIA_TYPE.encode())]


async def _stream_frames(frames: AsyncGenerator[bytes, None], request: Request,
                         send: Send) -> None:
    """Send ``frames`` as a chunked 200 response. The sender going away (``http.disconnect``
    before the end) cancels this task, so the frames' generator is closed and its
    ``finally`` aborts the work; nothing is raised to the server for it."""
    task = asyncio.current_task()
    assert task is not None
    finished = gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        if not finished:
            gone = True
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await send({"type": "http.response.start", "status": 200, "headers": _FORWARD_HEADERS})
        async with aclosing(frames) as replies:
            async for frame in replies:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # the sender went away: nothing left to answer
    finally:
        finished = True
        watcher.cancel()


# ---------------------------------------------------------------------------------- admin
def _admin_routes(app: FastAPI, service: NodeService) -> None:
    def _loopback(request: Request) -> None:
        host = request.client.host if request.client else ""
        if host not in LOOPBACK:
            raise ApiError("admin endpoints accept loopback clients only", status=403,
                           type_="permission_error")

    @app.get("/admin/partition")
    async def get_partition(request: Request) -> Response:
        try:
            _loopback(request)
        except ApiError as err:
            return error_response(err)
        return JSONResponse({"partitioned_from": sorted(service.netem.partitioned)})

    @app.post("/admin/partition")
    async def set_partition(request: Request) -> Response:
        try:
            _loopback(request)
            body = parse_json(await read_body(request, 1 << 20))
            peers = body.get("peers")
            if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
                raise ApiError("'peers' must be an array of node ids or host:port strings",
                               param="peers")
        except ApiError as err:
            return error_response(err)
        service.netem.set_partition(peers)
        log.warning("partitioned from %s", sorted(service.netem.partitioned) or "nobody")
        return JSONResponse({"partitioned_from": sorted(service.netem.partitioned)})
