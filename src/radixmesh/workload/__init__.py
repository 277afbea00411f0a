"""Workloads: MMLU loader, synthetic MMLU-shaped generator, skew, schedules, JSONL traces.

Pure apart from reading the MMLU directory and trace files, so the simulator can use it.
"""

from radixmesh.workload.build import WorkloadSpec, build
from radixmesh.workload.request import Message, Request
from radixmesh.workload.schedule import Schedule

__all__ = ["Message", "Request", "Schedule", "WorkloadSpec", "build"]
