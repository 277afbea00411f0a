"""Shared fixtures for engine tests: tiny random models, built locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixmesh.engine.testing import save_random_model_dir


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model_dir(tmp_path_factory.mktemp("micro_model"), preset="micro", seed=0)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    # On a shared 2-core box, torch's default intra-op threads spin against other processes and
    # make tiny forwards ~100x slower; one thread is what a multi-node cluster uses anyway.
    torch.set_num_threads(1)
