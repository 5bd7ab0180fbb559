"""Ports for the servers this project starts: free, and outside the range the kernel gives outgoing connections."""

import socket
import sys

import pytest

from sgl_dspark.tools import launch
from sgl_dspark.tools.launch import HOST, ephemeral_start, free_port, free_port_run, port_in_use


def test_free_ports_lie_below_the_ephemeral_range_and_are_free():
    lo = ephemeral_start()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < lo and not port_in_use(p) for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((HOST, 0))  # a port the kernel hands out (the old choice) is never one of ours
        assert held.getsockname()[1] >= lo


def test_a_run_of_ports_is_free_and_the_range_file_falls_back(tmp_path):
    first = free_port_run(3)
    assert not any(port_in_use(first + i) for i in range(3))
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ephemeral_start(tmp_path / "range") == 40000
    assert ephemeral_start(tmp_path / "missing") == 32768


# SGLang's crash path sleeps 5 s before its diagnostics when either of these reads true (tokenizer_manager).
CRASH_DIAGNOSTICS = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")


@pytest.mark.parametrize("outer, seen", [(None, "False"), ("true", "True")])
def test_a_spawned_server_skips_sglangs_crash_dump_sleep_unless_the_caller_asks(tmp_path, monkeypatch, outer, seen):
    """`stop` ends the process group, which SGLang's parent takes for a crash: without the defaults its crash path
    sleeps 5 s before a py-spy dump and a CUDA core dump (every server stop in CI paid it). Read as SGLang reads
    them, in the spawned process; a value in the caller's environment wins."""
    for name in CRASH_DIAGNOSTICS:
        if outer is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, outer)
    script = ("from sglang.srt.environ import envs; "
              f"print(any(getattr(envs, n).get() for n in {CRASH_DIAGNOSTICS!r}))")
    monkeypatch.setattr(launch.ServerSpec, "command", lambda self: [sys.executable, "-c", script])
    server = launch.spawn(launch.ServerSpec("m", port=free_port()), tmp_path)
    assert server.process.wait(timeout=60) == 0
    assert server.log_text().strip() == seen
