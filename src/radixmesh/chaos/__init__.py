"""Fault injection and soak tests against real nodes (``radixmesh chaos``)."""
