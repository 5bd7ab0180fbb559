"""Shared fixtures: the prepared default model and the GPU marker rule (GPU tests skip cleanly without one)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from sgl_dspark.tools.models import prepare

    return str(prepare("float32").path)
