"""radixmesh: peer-to-peer LLM serving with prefix-cache-aware routing and no coordinator."""

__version__ = "0.1.0"
