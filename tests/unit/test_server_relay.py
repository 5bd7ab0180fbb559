"""The server relay (sgl_dspark.tools.launch.relay): each server starts while the one before it is in use, at most
two run at once, and none is left behind; `serving_together` starts several at once. With stand-in servers (a
process answering /health_generate)."""

import sys

import pytest

from sgl_dspark.tools import launch
from sgl_dspark.tools.launch import ServerError, ServerSpec, free_port, port_in_use, relay, serving_together

# A stand-in server: answers every GET with 200 on the port it is given.
STAND_IN = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Ok(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.ServerSpec, "command", lambda self: [sys.executable, "-c", STAND_IN, str(self.port)])
    return {name: (ServerSpec("m", port=free_port()), tmp_path / name) for name in "abc"}


def running(job) -> bool:
    return port_in_use(job[0].port)


def test_each_server_starts_while_the_one_before_it_is_in_use_and_none_is_left(jobs):
    with relay(jobs) as servers:
        with servers.serving("a") as a:
            assert a.spec == jobs["a"][0] and running(jobs["a"])
            assert (jobs["b"][1] / f"server-{jobs['b'][0].port}.log").exists()  # b spawned ahead
            assert not (jobs["c"][1]).exists()  # c not yet
        assert not running(jobs["a"])
        with servers.serving("b"):
            assert running(jobs["b"])
        with servers.serving("c"):
            assert running(jobs["c"]) and not running(jobs["b"])
        assert not any(running(job) for job in jobs.values())


def test_a_name_asked_out_of_order_stops_the_one_started_ahead(jobs):
    with relay(jobs) as servers:
        with servers.serving("a"):
            pass
        with servers.serving("c"):  # b was started ahead: stopped, c started now
            assert running(jobs["c"]) and not running(jobs["b"])
    assert not any(running(job) for job in jobs.values())


def test_the_server_started_ahead_is_stopped_when_the_relay_ends_early(jobs):
    with pytest.raises(RuntimeError):
        with relay(jobs) as servers:
            with servers.serving("a"):
                launch._wait_healthy(servers._ahead[1])  # b is up, ahead
                raise RuntimeError("a test failed")
    assert not any(running(job) for job in jobs.values())


def test_servers_started_together_are_all_up_then_all_stopped(jobs):
    with serving_together(list(jobs.values())) as servers:
        assert [s.spec for s in servers] == [job[0] for job in jobs.values()]
        assert all(running(job) for job in jobs.values())
    assert not any(running(job) for job in jobs.values())


def test_one_that_fails_to_start_stops_the_others(jobs, monkeypatch):
    failing = jobs["b"][0].port
    command = launch.ServerSpec.command
    monkeypatch.setattr(launch.ServerSpec, "command", lambda self: [sys.executable, "-c", "raise SystemExit(3)"]
                        if self.port == failing else command(self))
    with pytest.raises(ServerError, match="exited with code 3"):
        with serving_together(list(jobs.values())):
            pass
    assert not any(running(job) for job in jobs.values())
