"""vLLM 0.32's OpenAI-compatible request and response shapes, as the emulated engine speaks them.

Theory of operation
-------------------
Parsing turns a JSON body into a :class:`Completion` (token-id prompts, sampling limits, what
the answer must carry) or raises :class:`BadRequest` naming the field; the server answers that
with vLLM's error shape ``{"error": {"message", "type": "BadRequestError", "param", "code":
400}}`` (``ErrorResponse`` / ``ErrorInfo`` in ``vllm/entrypoints/openai/protocol.py``). Field
names and defaults are vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``: ``prompt``
(text, token ids, or a batch of either), ``max_tokens`` (completions: 16; chat: what the
context leaves), ``stream``, ``stream_options.include_usage``, ``logprobs`` (completions: an
int; chat: a bool with ``top_logprobs``), ``return_tokens_as_token_ids`` (logprob tokens
spelled ``token_id:N``), ``ignore_eos``, ``stop_token_ids``, ``n`` (only 1). Fields that
would change the answer's shape (``echo``, ``prompt_logprobs``, tools, structured output) are
refused with a 400; sampling fields (``temperature``, ``top_p``, ``seed``, ...) and unknown
fields are accepted and ignored, as vLLM accepts unknown fields (the output is deterministic
anyway).

Builders make the response objects: ``CompletionResponse`` / ``CompletionStreamResponse`` and
the chat ones, choices with ``text`` / ``delta``, ``finish_reason`` and ``stop_reason``, and
``UsageInfo`` with ``prompt_tokens_details.cached_tokens`` (vLLM's
``--enable-prompt-tokens-details``, always on here).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixmesh.core.scheduler import Finished
from radixmesh.engine.base import Tokenizer

TOKEN_ID_PREFIX = "token_id:"
DEFAULT_MAX_TOKENS = 16  # vLLM CompletionRequest.max_tokens
VLLM_VERSION = "0.32.0"  # the release this surface pins (`make vllm-check` installs it)
UNSUPPORTED = ("echo", "prompt_logprobs", "tools", "response_format", "guided_json")


class BadRequest(ValueError):
    """A request the engine refuses with HTTP 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Completion:
    """One parsed request: one sequence per prompt."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]  # per prompt
    stop_ids: frozenset[int]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs object
    token_ids: bool  # return_tokens_as_token_ids
    chat: bool
    cache_salt: str | None = None  # vLLM's: prefixes are reused only under the same salt
    lora: str | None = None  # the LoRA adapter it names (its ``model``), if any


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else (
        "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    if value < low:
        raise BadRequest(f"{name} must be at least {low}, got {value}", name)
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, got {value!r}", name)
    return value


def _ids(value: Any, vocab: int) -> tuple[int, ...] | None:
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 or t >= vocab for t in value):
            raise BadRequest(f"token ids must be in [0, {vocab})", "prompt")
        return tuple(value)
    return None


def parse_prompts(raw: Any, tokenizer: Tokenizer, vocab: int
                  ) -> tuple[tuple[int, ...], ...]:
    """``prompt``: text, token ids (each below ``vocab``), or a non-empty list of either."""
    if isinstance(raw, str):
        return (_encoded(tokenizer, raw),) if raw else _empty()
    single = _ids(raw, vocab)
    if single is not None:
        return (single,)
    if isinstance(raw, list) and raw:
        out = []
        for item in raw:
            if isinstance(item, str) and item:
                out.append(_encoded(tokenizer, item))
                continue
            ids = _ids(item, vocab)
            if ids is None:
                raise BadRequest("each prompt of a batch must be non-empty text or token ids",
                                 "prompt")
            out.append(ids)
        return tuple(out)
    return _empty()


def _empty() -> tuple[tuple[int, ...], ...]:
    raise BadRequest("prompt must be non-empty text, token ids, or a list of them", "prompt")


def parse(body: Any, tokenizer: Tokenizer, context_length: int, *, chat: bool,
          vocab: int | None = None) -> Completion:
    """A ``/v1/completions`` (or, ``chat``, ``/v1/chat/completions``) body; token ids must be
    below ``vocab`` (default: the tokenizer's vocabulary)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompts = _chat_prompt(body, tokenizer) if chat else parse_prompts(
        body.get("prompt"), tokenizer, vocab or tokenizer.vocab_size)
    if _int(body, "n", 1, 1) != 1:
        raise BadRequest("the emulated engine generates one choice per prompt (n=1)", "n")
    for name in UNSUPPORTED:  # they change the answer's shape: refused, not silently ignored
        if body.get(name) not in (None, False):
            raise BadRequest(f"{name} is not supported by the emulated engine", name)
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    asked = _int(body, name, None if chat else DEFAULT_MAX_TOKENS, 1)
    max_tokens = tuple(asked if asked is not None else max(context_length - len(p), 1)
                       for p in prompts)
    stop_ids = _stop_ids(body, tokenizer)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    stream = _bool(body, "stream")
    if options and not stream:  # vLLM's validate_stream_options
        raise BadRequest("Stream options can only be defined when `stream=True`.",
                         "stream_options")
    return Completion(prompts, max_tokens, frozenset(stop_ids), stream,
                      bool(options.get("include_usage")), _logprobs(body, chat),
                      _bool(body, "return_tokens_as_token_ids"), chat, _salt(body))


def _chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise BadRequest("messages must be a non-empty list of {role, content} objects",
                         "messages")
    try:
        return (tuple(tokenizer.apply_chat_template(messages)),)
    except ValueError as exc:  # a role the template refuses, text no UTF-8 holds
        raise BadRequest(str(exc), "messages") from None


def _encoded(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """A text prompt's ids; text the tokenizer refuses (a lone surrogate: JSON's
    ``"\\ud800"``) is the client's error."""
    try:
        return tuple(tokenizer.encode(text))
    except ValueError as exc:
        raise BadRequest(str(exc), "prompt") from None


def _stop_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> set[int]:
    """``stop_token_ids``, and the tokenizer's EOS unless ``ignore_eos``."""
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    stop_ids = set(stop)
    eos = tokenizer.eos_token_id
    if eos is not None and not _bool(body, "ignore_eos"):
        stop_ids.add(eos)
    return stop_ids


def _salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: absent, or a non-empty string."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.",
                         "cache_salt")
    return salt


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    if chat:
        return _int(body, "top_logprobs", 0, 0) if _bool(body, "logprobs") else None
    return _int(body, "logprobs", None, 0)


# ------------------------------------------------------------------------------ responses
def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def token_name(tok: int, req: Completion, tokenizer: Tokenizer) -> str:
    return f"{TOKEN_ID_PREFIX}{tok}" if req.token_ids else tokenizer.decode([tok])


def logprobs_of(toks: Sequence[int], req: Completion, tokenizer: Tokenizer,
                offset: int) -> dict[str, Any] | None:
    """Logprobs for ``toks`` (the emulated model is certain of each: logprob 0.0)."""
    if req.logprobs is None:
        return None
    names = [token_name(t, req, tokenizer) for t in toks]
    if req.chat:
        return {"content": [{"token": n, "logprob": 0.0, "bytes": list(n.encode()),
                             "top_logprobs": [{"token": n, "logprob": 0.0,
                                               "bytes": list(n.encode())}][:req.logprobs]}
                            for n in names]}
    offsets, at = [], offset
    for t in toks:
        offsets.append(at)
        at += len(tokenizer.decode([t]))
    return {"text_offset": offsets, "token_logprobs": [0.0] * len(toks), "tokens": names,
            "top_logprobs": [{n: 0.0} if req.logprobs else None for n in names]}


def finish_fields(fin: Finished | None, req: Completion) -> dict[str, Any]:
    if fin is None:
        return {"finish_reason": None, "stop_reason": None}
    reason = "abort" if fin.reason == "abort" else fin.reason
    stop_reason = fin.output[-1] if fin.reason == "stop" and fin.output else None
    return {"finish_reason": reason, "stop_reason": stop_reason}


def usage(done: Sequence[Finished], report_cached: bool) -> dict[str, Any]:
    prompt = sum(f.prompt_tokens for f in done)
    out = sum(len(f.output) for f in done)
    body: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + out,
                            "completion_tokens": out, "prompt_tokens_details": None}
    if report_cached:
        body["prompt_tokens_details"] = {"cached_tokens": sum(f.cached_tokens for f in done)}
    return body


def envelope(rid: str, model: str, req: Completion, choices: list[dict[str, Any]],
             *, chunk: bool) -> dict[str, Any]:
    if req.chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": None}


def choice(index: int, text: str, logprobs: dict[str, Any] | None, fin: Finished | None,
           req: Completion, *, chunk: bool, first: bool = False) -> dict[str, Any]:
    fields = finish_fields(fin, req)
    if not req.chat:
        return {"index": index, "text": text, "logprobs": logprobs, **fields,
                **({} if chunk else {"prompt_logprobs": None})}
    if chunk:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "logprobs": logprobs, **fields}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, **fields}


def sglang_request(body: Any, tokenizer: Tokenizer, context: int, vocab: int
                   ) -> Completion:
    """SGLang's ``/generate`` body (``input_ids`` or ``text``, ``sampling_params``,
    ``cache_salt``) as the vLLM request it stands for, checked as vLLM's are."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object", "sampling_params")
    raw = body.get("input_ids") if "input_ids" in body else body.get("text")
    prompts = parse_prompts(raw, tokenizer, vocab)[:1]
    translated = {"prompt": [list(prompts[0])],
                  "max_tokens": params.get("max_new_tokens", 128),
                  "stop_token_ids": params.get("stop_token_ids"),
                  "ignore_eos": params.get("ignore_eos", False),
                  "cache_salt": body.get("cache_salt")}  # SGLang's, checked as vLLM's is
    return parse(translated, tokenizer, context, chat=False, vocab=vocab)
