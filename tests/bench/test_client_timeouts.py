"""The bench client's timeouts stretch with ``--time-scale``, as the nodes' do."""

from __future__ import annotations

import asyncio

from radixmesh.bench.replay import new_http_client


def test_the_clients_timeouts_scale_with_the_time_scale() -> None:
    async def timeouts(scale: float) -> tuple[float | None, float | None]:
        async with new_http_client(scale) as http:
            return http.timeout.connect, http.timeout.read

    assert asyncio.run(timeouts(1.0)) == (10.0, 600.0)
    assert asyncio.run(timeouts(450.0)) == (4500.0, 270000.0)
