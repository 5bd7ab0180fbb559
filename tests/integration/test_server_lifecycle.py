"""Start-up failures give one clear line; a stopped server leaves no process and frees its port."""

import os
import socket

import pytest

from sgl_dspark.tools.launch import HOST, ServerError, ServerSpec, free_port, port_in_use, start, stop


def test_port_in_use_is_refused_with_one_line(default_model_path):
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} .* in use"):
            start(ServerSpec(default_model_path, port=port))


def test_server_that_fails_to_start_reports_the_cause(tmp_path):
    bogus = tmp_path / "not-a-model"
    bogus.mkdir()
    with pytest.raises(ServerError, match="exited with code") as info:
        start(ServerSpec(str(bogus), port=free_port(), startup_timeout_s=120), log_dir=tmp_path)
    assert "\n" not in str(info.value)


def test_stop_leaves_no_process_and_frees_the_port(default_model_path, tmp_path):
    server = start(ServerSpec(default_model_path, port=free_port()), log_dir=tmp_path)
    group = server.process.pid
    stop(server)
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    assert not port_in_use(server.spec.port)
