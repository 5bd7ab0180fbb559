"""Ports for the servers this project starts: free, and outside the range the kernel gives outgoing connections."""

import socket

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
