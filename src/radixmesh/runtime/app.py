"""The node's HTTP surface (FastAPI): OpenAI client API, peer endpoints, admin, observability.

No routing logic lives here: handlers validate and shape; ``NodeService`` decides and executes.
Over 400 lines because it is one FastAPI app: its client, peer and admin routes share the same
auth, body-limit and error-shaping plumbing, and splitting them would scatter a single surface.

Client API   POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
             GET /v1/models/{id} (404 model_not_found). Stop strings are matched here, on the
             tokens as they arrive (also for a forwarded request, which then streams tokens
             even if the client asked for one JSON body): a match ends the request as done and
             stops the engine through the same abort as a client that went away
Observe      GET /health, GET /metrics (Prometheus text), GET /mesh (JSON)
Peers        POST /peer/gossip (raw gossip bytes), POST /peer/forward (an encoded
             ForwardRequest, executed here; the body of the answer is framed ForwardReply
             messages: ForwardAccepted first, or ForwardBusy when the core refuses — queue
             at the push-back threshold, or slower than the sender's ``beat_s``)
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
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixmesh.core.auth import AuthError
from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.forward_codec import decode_forward_request
from radixmesh.core.messages import ForwardRequest
from radixmesh.engine.base import SamplingParams
from radixmesh.runtime.debug import install_debug_routes
from radixmesh.runtime.execution import Execution, Outcome
from radixmesh.runtime.node import NodeService, Overloaded
from radixmesh.runtime.openai_api import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    MAX_STOP_SEQUENCES,
    ApiError,
    ApiRequest,
    Detokenizer,
    StreamShaper,
    error_body,
    new_id,
    parse_chat,
    parse_completion,
    parse_json,
    response_body,
    usage_body,
)
from radixmesh.runtime.openapi import install_openapi
from radixmesh.runtime.peer_auth import (
    GOSSIP_PURPOSE,
    forward_purpose,
    install_api_key_check,
    refused,
)
from radixmesh.runtime.peer_client import (
    FORWARD_MEDIA_TYPE,
    FORWARD_PATH,
    HEADER_FROM,
    HEADER_FROM_ADDRESS,
)
from radixmesh.runtime.peer_tls import install_peer_tls

log = logging.getLogger("radixmesh.app")

HEADER_HOP = "x-radixmesh-hop"
HEADER_TARGET = "x-radixmesh-target"
HEADER_NODE = "x-radixmesh-node"  # the entry node that answered the client
HEADER_SERVED_BY = "x-radixmesh-served-by"
HEADER_ROUTE = "x-radixmesh-route"
HEADER_EXPECTED = "x-radixmesh-expected-cached-tokens"
HEADER_CACHED = "x-radixmesh-cached-tokens"
HEADER_QUEUE = "x-radixmesh-queue-s"
HEADER_SERVICE = "x-radixmesh-service-s"
HEADER_OVERHEAD = "x-radixmesh-forward-overhead-s"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_PEER_BODY = 64 * 1024 * 1024  # forward bodies (encoded prompts); gossip has its own limit


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
    install_openapi(app, service.engine.model_name)
    install_api_key_check(app, service.api_key)
    install_peer_tls(app, service)  # --peer-tls-*: /peer/* needs a CA-signed client cert
    return app


# ---------------------------------------------------------------------------------- errors
def error_response(err: ApiError, service: NodeService | None = None) -> JSONResponse:
    if service is not None:
        service.metrics.client_errors[err.status] += 1
    return JSONResponse(err.body(), status_code=err.status)


def _install_errors(app: FastAPI, service: NodeService) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

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
def _client_routes(app: FastAPI, service: NodeService) -> None:
    models = [service.engine.model_name]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, service, models, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, service, models, "chat")

    created = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> dict[str, object]:
        return {"object": "list", "data": [_model_entry(service, m, created) for m in models]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        if model_id not in models:
            return error_response(ApiError(f"The model '{model_id}' does not exist.",
                                           status=404, param="model", code="model_not_found"),
                                  service)
        return JSONResponse(_model_entry(service, model_id, created))

    @app.get("/health")
    async def health() -> Response:
        body = service.health()  # leaving (SIGTERM drain): 503, so readiness probes drop it
        return JSONResponse(body, status_code=503 if body["status"] == "leaving" else 200)

    @app.get("/mesh")
    async def mesh() -> dict[str, object]:
        return service.mesh()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.prometheus(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_entry(service: NodeService, model: str, created: int) -> dict[str, object]:
    """OpenAI's model object, plus this server's limits and defaults (``radixmesh``)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "radixmesh",
            "max_model_len": service.engine.max_context,
            "radixmesh": {"default_max_tokens": DEFAULT_MAX_TOKENS,
                          "default_temperature": DEFAULT_TEMPERATURE,
                          "max_stop_sequences": MAX_STOP_SEQUENCES}}


async def _generate(request: Request, service: NodeService, models: Sequence[str],
                    kind: str) -> Response:
    try:
        body = parse_json(await read_body(request, service.config.max_body_bytes))
        api = parse_completion(body, models) if kind == "completion" else parse_chat(body, models)
        prompt = _tokenize(service, api)
        ex = await service.execute(  # stop strings: tokens as they come, to match them here
            prompt, _sampling(service, api), api.stream or bool(api.stop),
            local_only=request.headers.get(HEADER_HOP) is not None,
            target=request.headers.get(HEADER_TARGET) or None,
        )
    except ApiError as err:
        return error_response(err, service)
    except Overloaded as full:
        return _overloaded(service, full)
    rid = new_id(api.kind)
    if api.stream:
        return StreamingResponse(_sse(service, api, ex, rid), media_type="text/event-stream",
                                 headers=_start_headers(service, ex))
    answer = await _unless_disconnected(request, _answer(service, api, ex))
    if answer is None:  # nobody to answer: the work was stopped through the core's Abort
        service.metrics.client_disconnects += 1
        return Response(status_code=499)
    text, outcome = answer
    usage = usage_body(outcome.prompt_tokens, len(outcome.output_ids), outcome.cached_tokens)
    return JSONResponse(response_body(api, rid, text, outcome.finish_reason, usage),
                        headers=_outcome_headers(service, ex, outcome))


def _overloaded(service: NodeService, full: Overloaded) -> JSONResponse:
    """HTTP 429 with ``Retry-After``: this node is full and no peer had room."""
    err = ApiError("The mesh is overloaded: no node has room for this request now. Retry after "
                   f"{full.retry_after_s:.0f} s.", status=429, type_="rate_limit_error",
                   code="overloaded")
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


def _tokenize(service: NodeService, api: ApiRequest) -> list[int]:
    tok = service.engine.tokenizer
    try:
        if api.kind == "chat":
            ids = list(tok.apply_chat_template(list(api.messages)))
        elif api.prompt_ids is not None:
            ids = list(api.prompt_ids)
        else:
            ids = tok.encode(api.prompt_text or "")
    except ValueError as exc:
        raise ApiError(str(exc), param="messages" if api.kind == "chat" else "prompt") from None
    _check_prompt(service, api, ids)
    return ids


def _check_prompt(service: NodeService, api: ApiRequest, ids: list[int]) -> None:
    param = "messages" if api.kind == "chat" else "prompt"
    if not ids:
        raise ApiError("The prompt is empty.", param=param, code="invalid_value")
    limit = service.engine.max_context
    if len(ids) + api.max_tokens > limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + api.max_tokens} tokens ({len(ids)} in the prompt, {api.max_tokens} "
            "for the completion). Please reduce the prompt or the completion length.",
            param=param, code="context_length_exceeded",
        )
    if max(ids) >= service.engine.tokenizer.vocab_size:
        raise ApiError(f"Token ids must be below {service.engine.tokenizer.vocab_size}.",
                       param=param, code="invalid_value")


def _sampling(service: NodeService, api: ApiRequest) -> SamplingParams:
    try:
        return api.sampling()
    except ValueError as exc:
        raise ApiError(str(exc), code="invalid_value") from None


async def _answer(service: NodeService, api: ApiRequest, ex: Execution) -> tuple[str, Outcome]:
    """The whole text and outcome of a non-streamed request (stop strings: matched as the
    tokens arrive, see :func:`_pieces`)."""
    if not api.stop:
        outcome = await ex.result()
        return service.engine.tokenizer.decode(outcome.output_ids), outcome
    det = Detokenizer(service.engine.tokenizer.decode, api.stop)
    text = "".join([piece async for piece in _pieces(ex, det)])
    assert ex.outcome is not None
    return text, ex.outcome


async def _pieces(ex: Execution, det: Detokenizer) -> AsyncGenerator[str, None]:
    """The text of ``ex``'s tokens as it becomes final. On a stop-string match ``ex.stop``
    takes the tokens so far as the answer and closing the token stream stops the work
    (reported to the core as done: ``NodeService._ended``)."""
    ids: list[int] = []
    tail = ""
    async with aclosing(ex.tokens()) as tokens:
        async for tok in tokens:
            ids.append(tok)
            piece = det.push(tok)
            if det.stopped:
                ex.stop(ids)
                tail = piece
                break
            if piece:
                yield piece
    tail += det.flush()  # nothing once stopped
    if tail:
        yield tail


async def _sse(service: NodeService, api: ApiRequest, ex: Execution, rid: str
               ) -> AsyncIterator[bytes]:
    shaper = StreamShaper(api, rid)
    det = Detokenizer(service.engine.tokenizer.decode, api.stop)
    first = shaper.start()
    if first is not None:
        yield first
    try:
        async with aclosing(_pieces(ex, det)) as pieces:  # closed with us: the work stops
            async for piece in pieces:
                yield shaper.text(piece)
        outcome = ex.outcome
        assert outcome is not None
        yield shaper.finish(outcome.finish_reason)
        usage = shaper.usage(usage_body(outcome.prompt_tokens, len(outcome.output_ids),
                                        outcome.cached_tokens))
        if usage is not None:
            yield usage
    except Exception as exc:  # headers are gone: report in-band, like OpenAI does
        log.exception("stream failed")
        service.metrics.client_errors[500] += 1
        yield shaper.error(ApiError(f"Internal error: {type(exc).__name__}", status=500,
                                    type_="server_error"))
    yield shaper.done()


def _start_headers(service: NodeService, ex: Execution) -> dict[str, str]:
    return {
        HEADER_NODE: service.node_id,
        HEADER_SERVED_BY: ex.served_by,
        HEADER_ROUTE: ex.route,
        HEADER_EXPECTED: str(ex.expected_cached),
        HEADER_CACHED: str(ex.cached_estimate),  # streaming: the server's match at acceptance
        "cache-control": "no-cache",
    }


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
    return headers


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

    @app.post("/peer/forward")
    async def forward(request: Request) -> Response:
        if service.netem.drop_incoming(request.headers.get(HEADER_FROM),
                                       request.headers.get(HEADER_FROM_ADDRESS)):
            return JSONResponse(error_body("partitioned", "unavailable"), status_code=503)
        try:
            raw = await read_body(request, MAX_PEER_BODY)
            service.auth.verify(request.headers, forward_purpose(FORWARD_PATH), raw)
            req = _parse_forward(service, raw)
        except AuthError as exc:
            return refused(service.auth, exc, request.headers.get(HEADER_FROM))
        except ApiError as err:
            service.metrics.forwards_rejected += 1
            return error_response(err)
        return StreamingResponse(service.serve_forward(req), media_type=FORWARD_MEDIA_TYPE)


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
    return req


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
