"""Integration fixtures: real SGLang servers on this machine, started once per session and always stopped."""

import pytest

from sgl_dspark.server import ServerSpec, free_port, serving


@pytest.fixture(scope="session")
def plain_server(default_model_path, tmp_path_factory):
    """The default model, float32, no speculation."""
    spec = ServerSpec(default_model_path, port=free_port())
    with serving(spec, tmp_path_factory.mktemp("plain")) as server:
        yield server
