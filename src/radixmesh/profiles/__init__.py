"""Shipped step-time profiles (TOML package data): see :mod:`radixmesh.core.profile`."""
