"""What a run produces, shared by the benchmark harness and the simulator (below both).

``records``: the per-request :class:`~radixmesh.results.records.Record` (one ``requests.jsonl``
line); ``summary``: the per-run ``summary.json`` figures computed from records.
"""
