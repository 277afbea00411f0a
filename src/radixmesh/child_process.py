"""Child processes that do not outlive their parent: one ``preexec_fn`` for every launcher.

Theory of operation
-------------------
A node's engine child (runtime/launch.py), a local cluster's nodes (runtime/cluster.py) and the
emulated hosts' processes (testing/netns.py) are started with
``subprocess.Popen(..., preexec_fn=die_with_parent)``. Between fork and exec the child asks
Linux (``prctl(PR_SET_PDEATHSIG, SIGTERM)``) for SIGTERM when its parent thread dies, so a
launcher killed with SIGKILL leaves no orphans serving on its ports. Elsewhere (no
``libc.so.6``: macOS, musl) the call fails quietly and the children rely on their parent's own
shutdown. The module imports nothing of radixmesh, so every layer may use it (tests/
test_layering.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux; else a no-op).

    Meant for ``Popen(preexec_fn=...)``: it runs in the child between fork and exec."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
