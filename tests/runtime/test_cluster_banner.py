"""``radixmesh cluster --model DIR`` tells the user the model it really serves."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import httpx

from radixmesh.engine.testing import save_random_model_dir
from radixmesh.runtime.cluster import LocalCluster, banner, served_model


def test_the_banner_names_the_model_directory_and_its_request_works(tmp_path: Path) -> None:
    model_dir = save_random_model_dir(tmp_path / "my-model", preset="micro", seed=0)
    options = {"model": str(model_dir), "threads": 1, "gossip_interval": 0.2}
    with LocalCluster(1, options, ready_timeout=120, log_dir=tmp_path / "logs") as cluster:
        model = served_model(cluster)
        assert model == "my-model"
        text = banner(cluster, model)
        assert "serving model 'my-model'" in text and '"model": "tiny"' not in text
        [curl] = [line for line in text.splitlines() if line.strip().startswith("-d ")]
        body = json.loads(shlex.split(curl.strip())[1])  # the body exactly as printed
        assert body["model"] == "my-model"
        resp = httpx.post(cluster.urls[0] + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "my-model"
