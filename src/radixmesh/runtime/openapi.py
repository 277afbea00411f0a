"""The node's OpenAPI 3.1 document (``GET /openapi.json``): the client API as clients see it.

The handlers read raw bodies (so every error is an OpenAI-style body, never FastAPI's 422), so
FastAPI cannot infer request schemas; this document states them by hand. It is what the
schemathesis run in ``tests/fuzz`` generates requests from, and it declares that every 4xx
answer is an OpenAI error object — which that run checks. Peer and admin endpoints are not in
it: they are not part of the client API.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_STOP = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "null"},
    ]
}


def _sampling(model: str, max_tokens_name: str) -> dict[str, Any]:
    """What the node accepts (positive examples); anything else is a 4xx."""
    return {
        "model": {"type": "string", "enum": [model]},
        max_tokens_name: {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "n": {"type": ["integer", "null"], "enum": [1, None]},
        "seed": {"type": ["integer", "null"]},
        "stop": _STOP,
        "stream": {"type": ["boolean", "null"]},
        "presence_penalty": {"enum": [0, None]},
        "frequency_penalty": {"enum": [0, None]},
        "user": {"type": ["string", "null"]},
        "stream_options": {  # applies only when streaming; ignored otherwise
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": ["boolean", "null"]}},
        },
        # accepted only in these harmless forms; anything else is a 400 naming the parameter
        # (so are tools, tool_choice, functions, function_call: no tool calling)
        "response_format": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["type"], "additionalProperties": False,
            "properties": {"type": {"const": "text"}}}]},
        "logit_bias": {"type": ["object", "null"], "maxProperties": 0},
        "logprobs": {"enum": [False, None]},
    }


def _completion_request(model: str) -> dict[str, Any]:
    props = _sampling(model, "max_tokens")
    props["prompt"] = {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
             "minItems": 1},
        ]
    }
    props["echo"] = {"enum": [False, None]}
    props["best_of"] = {"enum": [1, None]}
    return {"type": "object", "required": ["model", "prompt"], "properties": props}


def _chat_request(model: str) -> dict[str, Any]:
    props = _sampling(model, "max_completion_tokens")
    props["max_tokens"] = {"type": ["integer", "null"], "minimum": 1}
    content_part = {
        "type": "object",
        "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
    }
    props["messages"] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"type": "string",
                         "enum": ["system", "user", "assistant", "developer", "tool"]},
                "content": {
                    "oneOf": [{"type": "string"}, {"type": "array", "items": content_part}]
                },
            },
        },
    }
    return {"type": "object", "required": ["model", "messages"], "properties": props}


def _json_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {
        "type": "object"}}}}


def _errors(*codes: str) -> dict[str, Any]:
    err = {"description": "OpenAI-style error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
    return {code: err for code in codes}


def _generation(summary: str, body_ref: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": body_ref}}},
            },
            "responses": {
                "200": {
                    "description": "the completion (JSON, or server-sent events when streaming)",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {}},
                },
                **_errors("400", "401", "404", "413"),
            },
        }
    }


def openapi_document(model: str, version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI document of a node serving ``model``."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixmesh node", "version": version},
        "paths": {
            "/v1/completions": _generation("text completion",
                                           "#/components/schemas/CompletionRequest"),
            "/v1/chat/completions": _generation("chat completion",
                                                "#/components/schemas/ChatRequest"),
            "/v1/models": {"get": {"summary": "served models (each entry's ``radixmesh``: "
                                              "default_max_tokens, default_temperature, "
                                              "max_stop_sequences)",
                                   "responses": {"200": _json_response("model list"),
                                                 **_errors("401")}}},
            "/v1/models/{model}": {"get": {
                "summary": "one served model (OpenAI's retrieve model)",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": _json_response("the model"), **_errors("401", "404")}}},
            "/health": {"get": {"summary": "liveness", "responses": {
                "200": _json_response("node status")}}},
            "/mesh": {"get": {"summary": "this node's view of the mesh",
                              "responses": {"200": _json_response("mesh state"),
                                            **_errors("401")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors("401")}}},
        },
        "components": {
            "schemas": {
                "Error": _ERROR,
                "CompletionRequest": _completion_request(model),
                "ChatRequest": _chat_request(model),
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def install_openapi(app: FastAPI, model: str) -> None:
    """Serve :func:`openapi_document` at ``GET /openapi.json``."""
    doc = openapi_document(model)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(doc)
