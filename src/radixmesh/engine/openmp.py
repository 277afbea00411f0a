"""Let go of the calling thread's OpenMP team (torch's intra-op worker threads).

Why
---
torch's CPU build runs its intra-op parallelism on OpenMP (libgomp in the Linux wheels). Every
thread that enters a parallel region gets a team of its own, whose workers live as long as that
thread does, and libgomp counts them all: once it manages more threads than the machine has
CPUs, its barriers stop spinning and sleep on a futex at once (``do_spin`` in libgomp's
``config/linux/wait.h``: ``gomp_managed_threads > gomp_available_cpus`` selects the
"throttled" spin count, 100 iterations by default). A node builds its model on the main thread
(its team stays behind it, idle) and steps it on the engine thread (a second team): on a 2-CPU
machine every parallel region of every step then ends in futex sleeps. Measured on this
project's 2-core machine, the same runner stepped by a second thread after the main thread built
the model: 14,936 context switches against 230 stepped by the main thread itself, a 500-token
prefill 60-86 ms against 37-53 ms, a batch-8 decode step 13-19 ms against 8-14 ms.

OpenMP 5.0's ``omp_pause_resource_all`` frees the calling thread's team (libgomp:
``gomp_pause_host`` -> ``gomp_free_thread``), so the engine thread's team is the only one again.
A later parallel region on the calling thread makes a new team (correct, only slower for the
engine). Nothing happens where torch's OpenMP runtime is not loaded or lacks the call.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("radixmesh.engine")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free threads, keep the runtime's state
_RUNTIMES = ("libgomp", "libomp", "libiomp5")


def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already loaded in this process (torch's), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so")
                     or ".so." in line}
    except OSError:  # not Linux: leave the runtime alone
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES):
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return lib
    return None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP worker team; True when a runtime took the call."""
    lib = _runtime()
    if lib is None:
        return False
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    ok = int(lib.omp_pause_resource_all(OMP_PAUSE_SOFT)) == 0
    if not ok:
        log.debug("omp_pause_resource_all refused (inside a parallel region?)")
    return ok
