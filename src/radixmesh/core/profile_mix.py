"""Mixed hardware: which step-time profile each node of a mesh runs.

Theory of operation
-------------------
``--profiles h100-llama3-8b:4,a10g-llama3-8b:12`` (``radixmesh bench --engine emulated`` and
``radixmesh sim`` share the syntax and this one parser) deals profiles to nodes in order: the
first 4 nodes run the H100 profile, the next 12 the A10G's; a bare name is every node. Every
name must resolve (:func:`radixmesh.core.profile.resolve`), the counts must add up to the node
count, and all profiles must serve one model (a mesh serves one model: nodes refuse peers of
another).
"""

from __future__ import annotations

import re

from radixmesh.core.profile import resolve


def parse_profiles(text: str, nodes: int) -> list[str]:
    """``name:count,...`` (or one bare name for every node) -> one profile name per node.
    ValueError when the counts do not add up to ``nodes`` or a profile does not resolve."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("--profiles: name at least one profile")
    if len(parts) == 1 and ":" not in parts[0]:
        resolve(parts[0])
        return [parts[0]] * nodes
    out: list[str] = []
    for part in parts:
        m = re.fullmatch(r"(.+):(\d+)", part)
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"--profiles: {part!r} is not NAME:COUNT with COUNT >= 1")
        resolve(m.group(1))  # refused here, naming the field, rather than in 16 processes
        out += [m.group(1)] * int(m.group(2))
    if len(out) != nodes:
        raise ValueError(f"--profiles: the counts add up to {len(out)} engines for {nodes} nodes")
    models = sorted({resolve(p).model for p in set(out)})
    if len(models) > 1:  # nodes refuse peers of another model: the mesh would fall apart
        raise ValueError(f"--profiles: the engines would serve different models "
                         f"({'; '.join(models)}); a mesh serves one model")
    return out
