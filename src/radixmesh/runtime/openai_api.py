"""OpenAI-compatible request schema, validation and response shaping (no IO, no routing).

Theory of operation
-------------------
The request bodies are pydantic models (:class:`CompletionRequest`, :class:`ChatRequest`):
FastAPI validates bodies with them and generates ``/openapi.json`` from them (runtime/app.py,
runtime/openapi.py). Every problem becomes an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status — a pydantic
``ValidationError`` through :func:`validation_error` (never FastAPI's 422 shape) — then
:func:`parse_completion` / :func:`parse_chat` check what a schema cannot (the model exists,
refused values) and return an :class:`ApiRequest`::

    body ──pydantic model──▶ parse_completion / parse_chat ──▶ ApiRequest ──(node: tokenize,
    one execution per prompt x n)──▶ outcomes ──response_body / StreamShaper──▶ JSON / SSE

Supported on the built-in engine: ``n`` (samples of one prompt share its cached prefix:
samples after the first run where the first ran, after it, and reuse its KV; sample ``j`` of a
seeded request uses ``seed + j``), batched prompts on completions (a list of strings or of
token-id lists; each prompt is its own request through the node, routed on its own; choice
``index`` = prompt * n + sample, as OpenAI numbers them), ``echo``, ``logprobs`` (completions:
an int k, OpenAI's legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``; with ``echo`` the prompt's tokens come first, the first with null), chat's
``logprobs`` + ``top_logprobs`` (``choices[i].logprobs.content``), ``presence_penalty`` /
``frequency_penalty``, ``max_completion_tokens``, ``user`` (accepted, ignored), ``seed``.
Log-probabilities are those of the model's raw distribution (before penalties, temperature
and top-p); a completion's logprobs also list the stop token that ended it (it is not in the
text), so ``echo`` + ``max_tokens: 1`` always has one generated entry; ``max_tokens: 0`` is
accepted with ``echo`` (score the prompt only). Requests with penalties or log-probabilities
run on the node that receives them (the forward protocol does not carry them), and prompt
log-probabilities compute the whole prompt (engine/builtin.py: a cached prefix has no logits).

Refused with a 400 naming the parameter (code ``unsupported_value``), never silently
ignored: ``best_of`` other than ``n``, tool and function calling (``tools``, ``tool_choice``,
``functions``, ``function_call``, a message's ``tool_calls``), ``response_format`` other than
``{"type": "text"}``, a non-empty ``logit_bias``, ``suffix``; penalties and log-probabilities
on an engine without them (``extended_sampling``: external engines today). Unknown fields are
ignored.

Defaults (also under ``radixmesh`` in each ``/v1/models`` entry): ``temperature`` is
:data:`DEFAULT_TEMPERATURE` (1, as OpenAI; send 0 for greedy, the same answer whichever node
serves); ``max_tokens`` is :data:`DEFAULT_MAX_TOKENS` (16) on both endpoints — chat included,
unlike OpenAI's "up to the context".

Tenancy fields (core/tenants.py): ``cache_salt`` (vLLM's) and ``prompt_cache_key`` (OpenAI's)
are strings of at most 256 characters (else a 400 naming the field); the salt, with the
caller's tenant (``--api-keys``), picks the request's cache namespace; the key is a session's
routing hint (core/sessions.py).

Stop strings are matched by :class:`Detokenizer` on the node that answers the client, on the
tokens as they arrive (runtime/app.py); a match ends the request there and stops the engine.

Why one file over 400 lines: the schema, its checks, response shaping and the detokenizer are
the whole OpenAI contract; kept together, every accepted field and its error body sit side
by side.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    create_model,
)

from radixmesh.core.messages import SEED_MAX, SEED_MIN
from radixmesh.core.tenants import MAX_CACHE_FIELD_CHARS
from radixmesh.engine.base import MAX_LOGPROBS, SamplingParams, TokenLogprob

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024  # chat messages in one request (each costs template work before limits)
MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_CHOICES = 128  # prompts x n
DEFAULT_MAX_TOKENS = 16  # both endpoints, when the client gives no limit (OpenAI's legacy one)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's
LOGPROB_FLOOR = -9999.0  # what -inf is sent as (JSON has no infinity)


class ApiError(Exception):
    """A client error: becomes an OpenAI error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    # a message quoting the client's text may hold a lone surrogate (JSON's "\ud800"), which
    # no UTF-8 response can carry: escaped, so the client still gets its 4xx
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --------------------------------------------------------------------------- schema
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenIds = Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=1)]
StopString = Annotated[str, Field(strict=True, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None
# A parameter the engine cannot honour is typed ``None`` (or its harmless form): the document
# says what is accepted; anything else fails validation on that field, and
# ``validation_error`` turns it into the 400 ``unsupported_value`` of ``_REFUSED``.
_NO_TOOLS = "this server does not do tool or function calling"
_REFUSED = {
    "tools": _NO_TOOLS, "tool_choice": _NO_TOOLS, "functions": _NO_TOOLS,
    "function_call": _NO_TOOLS, "tool_calls": _NO_TOOLS,
    "logit_bias": "only an empty map is accepted",
    "response_format": 'only {"type": "text"} is supported',
    "suffix": "insertion (text after the completion) is not supported",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body of the client API."""

    error: ErrorDetail


CacheField = Annotated[StrictStr, Field(max_length=MAX_CACHE_FIELD_CHARS)] | None


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class _Sampling(BaseModel):
    """The fields both endpoints share (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    seed: Annotated[int, Field(strict=True, ge=SEED_MIN, le=SEED_MAX - MAX_N)] | None = None
    stop: Stop = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    user: StrictStr | None = None
    cache_salt: CacheField = Field(None, description="vLLM's: prefixes are shared only with "
                                   "requests of the same salt (and tenant)")
    prompt_cache_key: CacheField = Field(None, description="OpenAI's: requests with the same "
                                         "key go to the node that served it last")
    logit_bias: Annotated[dict[str, Number], Field(max_length=0)] | None = Field(
        None, description="only an empty map (no bias) is accepted")
    response_format: ResponseFormat | None = Field(
        None, description='only {"type": "text"} is accepted')
    tools: None = Field(None, description="refused: no tool calling")
    tool_choice: None = Field(None, description="refused: no tool calling")
    functions: None = Field(None, description="refused: no function calling")
    function_call: None = Field(None, description="refused: no function calling")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: (StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = Field(
        None, description="0 only with echo (score the prompt)")
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | Literal[False] | None = (
        Field(None, description="alternatives per token (false: none)"))
    echo: StrictBool | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="only equal to n")
    suffix: Annotated[StrictStr, Field(max_length=0)] | None = Field(
        None, description="only empty")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr = Field(description='only "text" parts are accepted')
    text: StrictStr | None = None


ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatMessage(BaseModel):
    # "tool": accepted when the chat template renders it (else a 400 naming "messages"); tool
    # *calls* are refused (no tool calling)
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: None = Field(None, description="refused: no tool calling")
    function_call: None = Field(None, description="refused: no function calling")


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = Field(
        None, description="the older alias of max_completion_tokens")
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Literal[False] | None = Field(None, description="only false: a completions "
                                        "parameter")


# --------------------------------------------------------------------------- response schema
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class LegacyLogprobs(BaseModel):
    """Completions' logprobs (with echo the prompt's tokens first; the first one's are null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    """A completion, or (``object`` the same) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ContentLogprob] | None
    refusal: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ServerDefaults(BaseModel):
    """This server's defaults and limits (``radixmesh`` in a model entry)."""

    default_max_tokens: int
    default_temperature: float
    max_stop_sequences: int
    max_n: int
    max_prompts: int
    max_logprobs: int


class ModelEntry(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    radixmesh: ServerDefaults
    parent: str | None = None  # a LoRA adapter's base model (core/adapters.py)
    digest: str | None = None  # ... and its content digest
    remote: bool = False  # an adapter only peers serve (advertised in gossip): forwarded


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


def server_defaults() -> ServerDefaults:
    return ServerDefaults(default_max_tokens=DEFAULT_MAX_TOKENS,
                          default_temperature=DEFAULT_TEMPERATURE,
                          max_stop_sequences=MAX_STOP_SEQUENCES, max_n=MAX_N,
                          max_prompts=MAX_PROMPTS, max_logprobs=MAX_LOGPROBS)


def served_request_models(models: Sequence[str]
                          ) -> tuple[type[CompletionRequest], type[ChatRequest]]:
    """The request models of a node serving ``models``: the same fields and validation (an
    unknown model is still a 404, not a schema error), the schema's ``model`` listing the
    served names (so clients and generated examples see which)."""
    served: Any = (StrictStr, Field(json_schema_extra={"enum": list(models)}))
    return (create_model("CompletionRequest", __base__=CompletionRequest, model=served),
            create_model("ChatRequest", __base__=ChatRequest, model=served))


_FIELDS = frozenset().union(*(m.model_fields for m in (
    CompletionRequest, ChatRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat)))

_EXPECTED = {  # unions: one message, not one per member
    "prompt": "a string, an array of strings, an array of token ids or an array of those",
    "stop": f"a string or an array of at most {MAX_STOP_SEQUENCES} strings",
    "content": "a string or an array of text parts",
}


def validation_error(exc: ValidationError | Sequence[Any]) -> ApiError:
    """The first problem of a failed validation as an OpenAI error (400, ``param`` named as
    OpenAI does: ``messages.[1].role``)."""
    errors = list(exc.errors() if isinstance(exc, ValidationError) else exc)
    if not errors:
        return ApiError("Invalid request body.")
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        return ApiError("We could not parse the JSON body of your request.", code="invalid_json")
    parts = _param_parts(loc)
    param = ".".join(parts) or None
    if param is None:
        return ApiError("The request body must be a JSON object.", code="invalid_type")
    if param == "model" and kind == "missing":
        return ApiError("You must provide a model parameter.", param="model", code="missing")
    if kind == "missing":
        return ApiError(f"Missing required parameter: '{param}'.", param=param, code="missing")
    return _invalid_field(first, kind, loc, parts, param)


def _param_parts(loc: Sequence[Any]) -> list[str]:
    """A validation error's location as OpenAI's ``param`` parts (``messages``, ``[1]``,
    ``role``), up to a union member's tag."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in _FIELDS:
            parts.append(p)
        else:  # a union member's tag: the message names the whole field
            break
    return parts


def _invalid_field(first: Any, kind: str, loc: Sequence[Any], parts: list[str],
                   param: str) -> ApiError:
    """A field that is there but refused: unsupported, too long a stop, the wrong type or
    value."""
    refused = next((p for p in parts if p in _REFUSED), None)
    if refused is not None:
        at = ".".join(parts[: parts.index(refused) + 1])
        return _unsupported_error(at, _REFUSED[refused])
    if parts[0] == "stop" and kind == "string_too_long":
        return ApiError(f"'stop' allows at most {MAX_STOP_SEQUENCES} sequences of "
                        f"{MAX_STOP_CHARS} characters.", param="stop", code="invalid_value")
    tagged = any(isinstance(p, str) and p not in _FIELDS for p in loc)
    name = next((p for p in reversed(parts) if not p.startswith("[")), parts[0])
    if tagged and name in _EXPECTED:
        return ApiError(f"'{param}' must be {_EXPECTED[name]}.", param=param,
                        code="invalid_type")
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return ApiError(f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param,
                    code=code)


# --------------------------------------------------------------------------- validated
@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated client request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # completions: one entry per prompt
    messages: tuple[dict[str, str], ...]  # chat
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    user: str | None = None
    n: int = 1
    echo: bool = False
    logprobs: int | None = None  # alternatives per generated token (None: no logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: str | None = None  # "" reads as None (core/tenants.check_cache_field)
    prompt_cache_key: str | None = None

    @property
    def prompt_text(self) -> str | None:
        """The first prompt when it is text."""
        first = self.prompts[0] if self.prompts else None
        return first if isinstance(first, str) else None

    @property
    def prompt_ids(self) -> tuple[int, ...] | None:
        """The first prompt when it is token ids."""
        first = self.prompts[0] if self.prompts else None
        return first if isinstance(first, tuple) else None

    @property
    def prompt_logprobs(self) -> int | None:
        """Completions with ``echo`` and ``logprobs``: the prompt's log-probabilities too."""
        return self.logprobs if self.echo and self.kind == "completion" else None

    @property
    def extended(self) -> str | None:
        """The first parameter that needs an engine with ``extended_sampling``, if any."""
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.logprobs is not None:
            return "logprobs"
        return None

    def sampling(self, stop_token_ids: tuple[int, ...] = (), sample: int = 0) -> SamplingParams:
        """The engine's parameters for sample ``sample`` of a prompt (seeded: ``seed + j``;
        only the first sample scores the prompt, the others reuse its cached KV)."""
        seed = None if self.seed is None else self.seed + sample
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            stop_token_ids=stop_token_ids,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs if sample == 0 else None,
        )


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object from raw bytes (admin endpoints; the client API goes through FastAPI)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.")
    return data


def _unsupported_error(name: str, why: str) -> ApiError:
    return ApiError(f"'{name}' is not supported: {why}.", param=name, code="unsupported_value")


def _validated(model: type[_Sampling], body: dict[str, Any] | _Sampling) -> Any:
    if isinstance(body, model):
        return body
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _model(name: str, models: Sequence[str]) -> str:
    if name not in models:
        raise ApiError(
            f"The model '{name}' does not exist. Available: {', '.join(models)}.",
            status=404, param="model", code="model_not_found",
        )
    return name


def _common(req: _Sampling, models: Sequence[str]) -> dict[str, Any]:
    model = _model(req.model, models)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    stream = bool(req.stream)
    include_usage = stream and bool(req.stream_options and req.stream_options.include_usage)
    return {
        "model": model,
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "seed": req.seed,
        "stop": tuple(s for s in stop if s), "stream": stream, "include_usage": include_usage,
        "user": req.user, "n": req.n or 1,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "cache_salt": req.cache_salt or None,
        "prompt_cache_key": req.prompt_cache_key or None,
    }


def parse_completion(body: dict[str, Any] | CompletionRequest, models: Sequence[str]
                     ) -> ApiRequest:
    """Validate a ``/v1/completions`` body."""
    req: CompletionRequest = _validated(CompletionRequest, body)
    common = _common(req, models)
    if req.best_of is not None and req.best_of != common["n"]:
        raise _unsupported_error("best_of", "only best_of equal to n (no server-side ranking)")
    echo = bool(req.echo)
    logprobs = None if req.logprobs is False else req.logprobs
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not (echo and logprobs is not None):
        raise ApiError("'max_tokens' must be >= 1 (0 only with echo and logprobs: scoring "
                       "the prompt).", param="max_tokens", code="invalid_value")
    prompts = _prompts(req.prompt)
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise ApiError(f"At most {MAX_CHOICES} choices (prompts x n) per request.",
                       param="prompt", code="invalid_value")
    return ApiRequest(kind="completion", prompts=prompts, messages=(), max_tokens=max_tokens,
                      echo=echo, logprobs=logprobs, **common)


def _prompts(value: str | list[Any]) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        return (value,)
    if all(isinstance(t, int) for t in value):
        return (tuple(value),)
    if len(value) > MAX_PROMPTS:
        raise ApiError(f"At most {MAX_PROMPTS} prompts per request.", param="prompt",
                       code="invalid_value")
    return tuple(p if isinstance(p, str) else tuple(p) for p in value)


def parse_chat(body: dict[str, Any] | ChatRequest, models: Sequence[str]) -> ApiRequest:
    """Validate a ``/v1/chat/completions`` body."""
    req: ChatRequest = _validated(ChatRequest, body)
    common = _common(req, models)
    if req.echo:
        raise _unsupported_error("echo", "chat completions never echo the prompt")
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise ApiError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs",
                       code="invalid_value")
    parsed = tuple(_message(m, i) for i, m in enumerate(req.messages))
    return ApiRequest(kind="chat", prompts=(), messages=parsed, max_tokens=max_tokens,
                      logprobs=logprobs, **common)


def _message(msg: ChatMessage, index: int) -> dict[str, str]:
    param = f"messages.[{index}]"
    content = msg.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise ApiError("Only text content parts are supported.", param=f"{param}.content",
                           code="unsupported_value")
        content = "".join(part.text or "" for part in content)
    if content is None:
        raise ApiError(f"'{param}.content' must be a string or an array of text parts.",
                       param=f"{param}.content", code="invalid_type")
    role = "system" if msg.role == "developer" else msg.role
    return {"role": role, "content": content}


# --------------------------------------------------------------------------- log-probabilities
def _lp(value: float) -> float:
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


class LogprobShaper:
    """Token texts and log-probability objects, both OpenAI formats; ``decode`` is the
    tokenizer's. A token's text is ``decode([id])`` (a byte token of a multi-byte character
    decodes to U+FFFD); ``text_offset`` is the length of the decoded text before the token."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(ids)

    def token(self, tok: int) -> str:
        return self._decode([tok])

    def offsets(self, ids: Sequence[int], base: int = 0) -> list[int]:
        """Character offset of each of ``ids`` in ``decode(ids)``, plus ``base``."""
        out: list[int] = []
        for i in range(len(ids)):
            out.append(base + len(self._decode(ids[:i]).rstrip("\ufffd")) if i else base)
        return out

    def legacy(self, entries: Sequence[TokenLogprob | None], ids: Sequence[int],
               offsets: Sequence[int]) -> dict[str, list[Any]]:
        """Completions: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for tok, entry in zip(ids, entries, strict=True):
            tokens.append(self.token(tok))
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_lp(entry.logprob))
            top: dict[str, float] = {}
            for alt, value in entry.top:
                top.setdefault(self.token(alt), _lp(value))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": list(offsets)}

    def chat(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat: ``content`` items ``{token, logprob, bytes, top_logprobs}``."""
        def item(tok: int, value: float) -> dict[str, Any]:
            text = self.token(tok)
            return {"token": text, "logprob": _lp(value), "bytes": list(text.encode())}

        return [{**item(e.token_id, e.logprob),
                 "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries]


# --------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, object]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished choice: its text and its logprobs object (None without logprobs)."""

    index: int
    text: str
    finish_reason: str
    logprobs: object = None


def response_body(
    req: ApiRequest, rid: str, choices: Sequence[Choice] | str, finish: str | None = None,
    usage: dict[str, object] | None = None,
) -> dict[str, object]:
    """The whole (non-streamed) response; ``choices`` may be one text (with ``finish``)."""
    if isinstance(choices, str):
        choices = [Choice(0, choices, finish or "stop")]
    created = int(time.time())
    shaped: list[dict[str, object]] = []
    for c in sorted(choices, key=lambda c: c.index):
        if req.kind == "chat":
            logprobs = None if c.logprobs is None else {"content": c.logprobs, "refusal": None}
            shaped.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                           "logprobs": logprobs, "finish_reason": c.finish_reason})
        else:
            shaped.append({"index": c.index, "text": c.text, "logprobs": c.logprobs,
                           "finish_reason": c.finish_reason})
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": shaped, "usage": usage}


def sse(data: dict[str, object] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class StreamShaper:
    """Builds the SSE chunks of one streamed response (OpenAI chunk shapes); ``index`` is the
    choice's, ``logprobs`` the chunk's logprobs object (legacy dict or chat content list)."""

    def __init__(self, req: ApiRequest, rid: str) -> None:
        self.req = req
        self.rid = rid
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, object]], usage: object = None) -> bytes:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        body: dict[str, object] = {"id": self.rid, "object": obj, "created": self.created,
                                   "model": self.req.model, "choices": choices}
        if self.req.include_usage:
            body["usage"] = usage
        return sse(body)

    def _logprobs(self, logprobs: object) -> object:
        if logprobs is None or self.req.kind != "chat":
            return logprobs
        return {"content": logprobs, "refusal": None}

    def start(self, index: int = 0) -> bytes | None:
        if self.req.kind != "chat":
            return None
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def text(self, piece: str, index: int = 0, logprobs: object = None) -> bytes:
        if self.req.kind == "chat":
            choice: dict[str, object] = {"index": index, "delta": {"content": piece},
                                         "logprobs": self._logprobs(logprobs),
                                         "finish_reason": None}
        else:
            choice = {"index": index, "text": piece, "logprobs": logprobs,
                      "finish_reason": None}
        return self._chunk([choice])

    def finish(self, reason: str, index: int = 0, logprobs: object = None) -> bytes:
        if self.req.kind == "chat":
            choice: dict[str, object] = {"index": index, "delta": {},
                                         "logprobs": self._logprobs(logprobs),
                                         "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": logprobs,
                      "finish_reason": reason}
        return self._chunk([choice])

    def usage(self, usage: dict[str, object]) -> bytes | None:
        return self._chunk([], usage) if self.req.include_usage else None

    @staticmethod
    def error(err: ApiError) -> bytes:
        return sse(err.body())

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- text
class Detokenizer:
    """Incremental detokenization with stop strings.

    Emits only text that can no longer change: bytes of an incomplete UTF-8 character and a
    tail that could still become a stop string are held back until more tokens arrive.
    """

    def __init__(self, decode: Any, stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._emitted = 0  # characters already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        hit = self._find_stop(text)
        if hit is not None:
            self.stopped = True
            return self._take(text[:hit], len(text[:hit]))
        safe = len(text)
        while safe > self._emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        safe = min(safe, len(text) - self._holdback(text))
        return self._take(text, max(safe, self._emitted))

    def flush(self) -> str:
        """End of generation: everything left (up to a stop string) is final."""
        if self.stopped:
            return ""
        text = self._decode(self._ids)
        return self._take(text, len(text))

    def _take(self, text: str, upto: int) -> str:
        piece = text[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return piece

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        found = [i for s in self._stop if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
