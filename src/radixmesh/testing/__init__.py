"""In-memory twins shipped with the package: a deterministic fake network and a cluster harness.

They let tests, benchmarks and users drive real :class:`radixmesh.core.node.NodeCore` instances
over a simulated network (delay, jitter, loss, duplication, reordering, partitions) on a
virtual clock, in microseconds of real time.
"""

from radixmesh.testing.fakenet import Datagram, FakeNetwork, LinkConfig, VirtualClock
from radixmesh.testing.twin import TwinCluster

__all__ = ["Datagram", "FakeNetwork", "LinkConfig", "TwinCluster", "VirtualClock"]
