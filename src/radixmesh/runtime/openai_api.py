"""OpenAI-compatible request validation and response shaping (no IO, no routing).

Theory of operation
-------------------
Client bodies are parsed by hand, field by field, so that every problem becomes an OpenAI-style
error body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, never a 500
and never FastAPI's own 422 shape::

    raw bytes ──parse_json──▶ dict ──parse_completion / parse_chat──▶ ApiRequest
                                                                        │ (tokenize: node)
    GenerateResult ──completion_body / chat_body──▶ JSON       tokens ──StreamShaper──▶ SSE

Only what the engine can honour is accepted; the rest is a 400 naming the parameter (code
``unsupported_value``), never silently ignored: ``n``/``best_of`` other than 1, tool and
function calling (``tools``, ``tool_choice``, ``functions``, ``function_call``, a message's
``tool_calls``), ``response_format`` other than ``{"type": "text"}``, a non-empty
``logit_bias``, ``logprobs``/``top_logprobs``, ``echo``, ``suffix`` and non-zero penalties.
Accepted and harmless: ``user``, ``seed`` (used), ``stream_options`` (only applies when
streaming), chat's ``max_completion_tokens`` (``max_tokens`` is its alias), ``role: "tool"``
messages (when the chat template renders them).

Defaults (also under ``radixmesh`` in each ``/v1/models`` entry): ``max_tokens`` is
:data:`DEFAULT_MAX_TOKENS` (16) on both endpoints — chat included, unlike OpenAI's "up to the
context"; ``temperature`` is :data:`DEFAULT_TEMPERATURE` (0, greedy, unlike OpenAI's 1):
outputs are then identical whichever node serves a request, which is what experiments compare.

Stop strings are matched by :class:`Detokenizer` on the node that answers the client, on the
tokens as they arrive (runtime/app.py); a match ends the request there and stops the engine.

Why one file over 400 lines: validation, response shaping and the detokenizer are the whole
OpenAI contract; kept together, every accepted field and its error body sit side by side.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.base import SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024  # chat messages in one request (each costs template work before limits)
DEFAULT_MAX_TOKENS = 16  # both endpoints, when the client gives no limit (OpenAI's legacy one)
DEFAULT_TEMPERATURE = 0.0  # greedy: the same answer whichever node serves (module doc)


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
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated client request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_text: str | None  # completions with a text prompt
    prompt_ids: tuple[int, ...] | None  # completions with a token-id prompt
    messages: tuple[dict[str, str], ...]  # chat
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def sampling(self, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=stop_token_ids,
        )


# --------------------------------------------------------------------------- primitives
def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.")
    return data


def _type_error(param: str, expected: str, value: object) -> ApiError:
    got = type(value).__name__ if value is not None else "null"
    return ApiError(f"'{param}' must be {expected}, got {got}.", param=param, code="invalid_type")


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a number", value)
    if not math.isfinite(value):
        raise ApiError(f"'{name}' must be finite.", param=name, code="invalid_value")
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _in_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    bad = value <= low if low_open else value < low
    if bad or value > high:
        bracket = "(" if low_open else "["
        raise ApiError(
            f"{value} is not a valid value for '{name}': must be in {bracket}{low}, {high}].",
            param=name,
            code="invalid_value",
        )


# --------------------------------------------------------------------------- shared fields
_TOOL_PARAMS = ("tools", "tool_choice", "functions", "function_call")


def _unsupported_error(name: str, why: str) -> ApiError:
    return ApiError(f"'{name}' is not supported: {why}.", param=name, code="unsupported_value")


def _unsupported(body: dict[str, Any]) -> None:
    """Parameters the engine cannot honour: 400 naming the parameter, never silently ignored."""
    for name in ("n", "best_of"):
        if _int(body, name, 1) != 1:
            raise ApiError(f"Only {name}=1 is supported.", param=name, code="unsupported_value")
    for name in _TOOL_PARAMS:
        if body.get(name) is not None:
            raise _unsupported_error(name, "this server does not do tool or function calling")
    _no_logprobs(body)
    _logit_bias(body)
    _response_format(body)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, 0.0)
        _in_range(name, value, -2.0, 2.0)
        if value != 0.0:
            raise _unsupported_error(name, "penalties are not supported yet (only 0)")


def _no_logprobs(body: dict[str, Any]) -> None:
    why = "the engine does not return log probabilities"
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and logprobs is not False:  # chat: a boolean; completions: an int
        raise _unsupported_error("logprobs", why)
    if top is not None and (type(top) is not int or top != 0):
        raise _unsupported_error("top_logprobs", why)
    if _bool(body, "echo", False):
        raise _unsupported_error("echo", "the prompt is never echoed")


def _logit_bias(body: dict[str, Any]) -> None:
    value = body.get("logit_bias")
    if value is None or value == {}:
        return
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object", value)
    raise _unsupported_error("logit_bias", "only an empty map is accepted")


def _response_format(body: dict[str, Any]) -> None:
    value = body.get("response_format")
    if value is None:
        return
    if not isinstance(value, dict):
        raise _type_error("response_format", "an object", value)
    if value != {"type": "text"}:
        raise _unsupported_error("response_format", 'only {"type": "text"} is supported')


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(items) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in items):
        raise ApiError(f"'stop' allows at most {MAX_STOP_SEQUENCES} sequences of "
                       f"{MAX_STOP_CHARS} characters.", param="stop", code="invalid_value")
    return tuple(s for s in items if s)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = _bool(options, "include_usage", False)
    return stream, stream and include_usage  # without streaming: nothing to apply it to


def _model(body: dict[str, Any], models: Sequence[str]) -> str:
    model = body.get("model")
    if model is None:
        raise ApiError("You must provide a model parameter.", param="model", code="missing")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model not in models:
        raise ApiError(
            f"The model '{model}' does not exist. Available: {', '.join(models)}.",
            status=404,
            param="model",
            code="model_not_found",
        )
    return model


def _max_tokens(body: dict[str, Any], keys: Sequence[str]) -> int:
    """The first of ``keys`` present (chat: ``max_completion_tokens``, then its older alias
    ``max_tokens``), else :data:`DEFAULT_MAX_TOKENS`."""
    for key in keys:
        value = _int(body, key, None)
        if value is None:
            continue
        if value < 1:
            raise ApiError(f"'{key}' must be >= 1.", param=key, code="invalid_value")
        return value
    return DEFAULT_MAX_TOKENS


def _common(body: dict[str, Any], models: Sequence[str], max_tokens_keys: Sequence[str]
            ) -> dict[str, Any]:
    model = _model(body, models)
    _unsupported(body)
    max_tokens = _max_tokens(body, max_tokens_keys)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)  # see the module doc
    _in_range("temperature", temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0)
    _in_range("top_p", top_p, 0.0, 1.0, low_open=True)
    seed = _int(body, "seed", None)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string", user)
    stream, include_usage = _stream(body)
    return {
        "model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
        "seed": seed, "stop": _stop(body), "stream": stream, "include_usage": include_usage,
        "user": user,
    }


# --------------------------------------------------------------------------- endpoints
def parse_completion(body: dict[str, Any], models: Sequence[str]) -> ApiRequest:
    """Validate a ``/v1/completions`` body."""
    common = _common(body, models, ("max_tokens",))
    if body.get("suffix") not in (None, ""):
        raise _unsupported_error("suffix", "insertion (text after the completion) is not "
                                 "supported")
    text, ids = _prompt(body.get("prompt"))
    return ApiRequest(kind="completion", prompt_text=text, prompt_ids=ids, messages=(),
                      **common)


def _prompt(value: object) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        if any(t < 0 for t in value):
            raise ApiError("Token ids must be >= 0.", param="prompt", code="invalid_value")
        return None, tuple(value)
    if isinstance(value, list) and len(value) > 1:
        raise ApiError("Batched prompts are not supported; send one prompt per request.",
                       param="prompt", code="unsupported_value")
    if value is None:
        raise ApiError("You must provide a prompt.", param="prompt", code="missing")
    raise _type_error("prompt", "a string or an array of token ids", value)


# "tool": accepted when the chat template renders it (the node's tokenizer; else a 400 naming
# "messages"); tool *calls* are refused (no tool calling: see ``_TOOL_PARAMS``)
_ROLES = ("system", "user", "assistant", "developer", "tool")


def parse_chat(body: dict[str, Any], models: Sequence[str]) -> ApiRequest:
    """Validate a ``/v1/chat/completions`` body."""
    common = _common(body, models, ("max_completion_tokens", "max_tokens"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty array of messages", messages)
    if len(messages) > MAX_MESSAGES:
        raise ApiError(f"'messages' allows at most {MAX_MESSAGES} messages, got "
                       f"{len(messages)}.", param="messages", code="invalid_value")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    return ApiRequest(kind="chat", prompt_text=None, prompt_ids=None, messages=parsed, **common)


def _message(value: object, index: int) -> dict[str, str]:
    param = f"messages.[{index}]"
    if not isinstance(value, dict):
        raise _type_error(param, "an object", value)
    role = value.get("role")
    if role not in _ROLES:
        raise ApiError(f"'{param}.role' must be one of {', '.join(_ROLES)}.",
                       param=f"{param}.role", code="invalid_value")
    if value.get("tool_calls") is not None or value.get("function_call") is not None:
        name = "tool_calls" if value.get("tool_calls") is not None else "function_call"
        raise _unsupported_error(f"{param}.{name}", "this server does not do tool calling")
    content = value.get("content")
    if isinstance(content, list):
        content = _text_parts(content, f"{param}.content")
    if not isinstance(content, str):
        raise _type_error(f"{param}.content", "a string or an array of text parts", content)
    return {"role": "system" if role == "developer" else str(role), "content": content}


def _text_parts(parts: list[Any], param: str) -> str:
    texts: list[str] = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ApiError("Only text content parts are supported.", param=param,
                           code="unsupported_value")
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(param, "text parts with a string 'text'", text)
        texts.append(text)
    return "".join(texts)


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


def response_body(
    req: ApiRequest, rid: str, text: str, finish: str, usage: dict[str, object]
) -> dict[str, object]:
    created = int(time.time())
    if req.kind == "chat":
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model,
            "choices": [choice], "usage": usage}


def sse(data: dict[str, object] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class StreamShaper:
    """Builds the SSE chunks of one streamed response (OpenAI chunk shapes)."""

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

    def start(self) -> bytes | None:
        if self.req.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def text(self, piece: str) -> bytes:
        if self.req.kind == "chat":
            choice: dict[str, object] = {"index": 0, "delta": {"content": piece},
                                         "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
        return self._chunk([choice])

    def finish(self, reason: str) -> bytes:
        if self.req.kind == "chat":
            choice: dict[str, object] = {"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
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
