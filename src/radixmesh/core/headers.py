"""The ``x-radixmesh-*`` HTTP header names, each defined once: the wire vocabulary of a node.

Theory of operation
-------------------
A node's HTTP front end (runtime/app.py) reads the request headers below and writes the
response headers on every completion; the peer transport writes the peer headers on gossip,
forwards and links; the benchmark and chaos clients read the response headers into their
records. All of them import the names from here, so a rename is one edit. The module is pure
constants in ``core`` because ``core.auth`` (which core alone may import) names the token's
header, and bench, chaos and runtime may all import core without pulling the runtime's
web stack. Names are lower case: HTTP header names are case-insensitive and the clients'
header maps compare them so.
"""

from __future__ import annotations

# Requests from a client (or the entry node, forwarding) to a node.
HEADER_HOP = "x-radixmesh-hop"  # already forwarded once: execute here (hop limit 1)
HEADER_TARGET = "x-radixmesh-target"  # experiments: forward to this peer id (fallbacks apply)
HEADER_SESSION = "x-session-id"  # a session key, as prompt_cache_key (core/sessions.py)
HEADER_ADAPTER_DIGEST = "x-radixmesh-adapter-digest"  # pins an adapter's digest (adapters.py)

# Responses of a node to its client.
HEADER_NODE = "x-radixmesh-node"  # the entry node that answered the client
HEADER_SERVED_BY = "x-radixmesh-served-by"  # the node whose engine ran the request
HEADER_ROUTE = "x-radixmesh-route"  # local | forwarded | fallback
HEADER_EXPECTED = "x-radixmesh-expected-cached-tokens"  # the router's estimate it routed on
HEADER_PLACEMENT = "x-radixmesh-placement"  # the router's tag of the choice (cost policy)
HEADER_REQUEST = "x-radixmesh-request"  # the entry node's number of the request (its decisions)
HEADER_CACHED = "x-radixmesh-cached-tokens"  # prompt tokens from cache (a stream: index match)
HEADER_QUEUE = "x-radixmesh-queue-s"  # seconds the request waited for the serving engine
HEADER_SERVICE = "x-radixmesh-service-s"  # seconds the serving engine spent on it
# A stream's headers leave before the engine has run: its last event before ``[DONE]`` is this
# SSE comment (clients ignore comments) with the queue and service times in Server-Timing form.
STREAM_TIMING_COMMENT = ": server-timing "
HEADER_OVERHEAD = "x-radixmesh-forward-overhead-s"  # forwarded: client time minus remote's

# Peer to peer (gossip, forwards, links).
HEADER_AUTH = "x-radixmesh-auth"  # the signed token of core.auth
HEADER_FROM = "x-radixmesh-from"  # sender's node id
HEADER_FROM_ADDRESS = "x-radixmesh-from-address"  # sender's host:port

__all__ = [
    "HEADER_AUTH",
    "HEADER_CACHED",
    "HEADER_EXPECTED",
    "HEADER_FROM",
    "HEADER_FROM_ADDRESS",
    "HEADER_HOP",
    "HEADER_NODE",
    "HEADER_OVERHEAD",
    "HEADER_PLACEMENT",
    "HEADER_QUEUE",
    "HEADER_REQUEST",
    "HEADER_ROUTE",
    "HEADER_SERVED_BY",
    "HEADER_SERVICE",
    "HEADER_SESSION",
    "HEADER_TARGET",
]
