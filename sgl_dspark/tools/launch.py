"""Launch and stop the real SGLang HTTP server on this machine (CPU flags from the facts file, or a GPU).

Used by the demo, the integration tests and the benchmarks. Owns process lifetime: a server started here
is always stopped here (whole process group), and its port is free again afterwards.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import requests

HOST = "127.0.0.1"
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
# Defaults for a server started here (the caller's environment wins): `stop` ends the whole process group, so
# SGLang's parent sees its scheduler die and runs its crash path, which sleeps 5 s when either diagnostic is on (a
# py-spy dump of the schedulers, a CUDA core dump; both default on); a deliberate stop needs neither (and py-spy is
# not installed by `make install`).
SERVER_ENV_DEFAULTS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "false", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "false"}


class ServerError(RuntimeError):
    """A one-line, user-facing reason why the server could not be started."""


@dataclass(frozen=True)
class ServerSpec:
    model_path: str
    port: int = 30000
    dtype: str = "float32"
    max_total_tokens: int = 8192
    max_running_requests: int = 4
    speculative_args: tuple[str, ...] = ()  # e.g. ("--speculative-algorithm", "NGRAM")
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None  # the server's working directory (None: this process's)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path, "--host", HOST, "--port", str(self.port),
            "--dtype", self.dtype, "--max-total-tokens", str(self.max_total_tokens),
            "--max-running-requests", str(self.max_running_requests),
            *device_args(), *self.speculative_args, *self.extra_args,
        ]  # fmt: skip


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


CPU_SETTINGS = {"device": "cpu", "sleep_on_idle": True, "skip_server_warmup": True}  # SGLang's ServerArgs fields


def device_settings() -> dict[str, Any]:
    """The ServerArgs fields this host's servers get: on a host without CUDA, CPU_SETTINGS; else none."""
    return {} if has_cuda() else dict(CPU_SETTINGS)


def device_args() -> tuple[str, ...]:
    """device_settings() as launch_server flags: {"device": "cpu", "sleep_on_idle": True} -> ("--device", "cpu",
    "--sleep-on-idle")."""
    args: list[str] = []
    for name, value in device_settings().items():
        args += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return tuple(args)


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
    return False


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SERVER_PORTS = 8000  # how many ports below the kernel's ephemeral range free_port picks from


def ephemeral_start(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest local port the kernel gives outgoing connections (Linux's default where it cannot be read)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the ephemeral range. A port the kernel would hand out (binding port 0 gives one) can be
    taken by an outgoing connection (a health poll, SGLang's own sockets) between this choice and the server's
    bind, and the server then dies with 'address already in use' (seen in CI)."""
    lo = ephemeral_start()
    first = max(1024, lo - SERVER_PORTS)
    for _ in range(200):
        port = random.randrange(first, lo)
        if not port_in_use(port):
            return port
    raise ServerError(f"no free port found in [{first}, {lo}) on {HOST}")


def free_port_run(count: int, tries: int = 50) -> int:
    """The first of `count` consecutive free ports (servers started side by side on port, port + 1, ...)."""
    for _ in range(tries):
        first = free_port()
        if first + count <= 65536 and not any(port_in_use(first + i) for i in range(1, count)):
            return first
    raise ServerError(f"no {count} consecutive free ports found on {HOST}")


@dataclass
class RunningServer:
    spec: ServerSpec
    process: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def _last_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[-400:]
    return lines[-1][-400:] if lines else "no output"


def _wait_healthy(server: RunningServer) -> None:
    deadline = time.monotonic() + server.spec.startup_timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerError(f"SGLang server exited with code {server.process.returncode} during start-up: "
                              f"{_last_error_line(server.log_text())} (log: {server.log_path})")
        try:
            if requests.get(f"{server.base_url}/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise ServerError(f"SGLang server not healthy after {server.spec.startup_timeout_s:.0f}s (log: {server.log_path})")


def stop(server: RunningServer, grace_s: float = 20.0) -> None:
    """SIGTERM the whole process group, SIGKILL what is left after `grace_s`, then wait for the port."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(server.process.pid, sig)
        except ProcessLookupError:
            break
        if _group_gone(server.process, wait_s):
            break
    deadline = time.monotonic() + 15.0
    while port_in_use(server.spec.port) and time.monotonic() < deadline:
        time.sleep(0.5)
    from sgl_dspark.draft_worker.shm import sweep_stale

    sweep_stale()  # shared-memory arenas of the draft worker the server's death left behind


def _group_gone(process: subprocess.Popen, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    process_exited = False
    while time.monotonic() < deadline:
        if not process_exited and process.poll() is not None:
            process_exited = True
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM the server when whoever started it dies (Linux), so a killed test run
    or demo never leaves a server behind."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(spec: ServerSpec, log_dir: Path | None = None) -> RunningServer:
    """Start the server's process and return at once (`start` also waits until it is healthy; a multi-node
    rank other than 0 serves no requests, so it is spawned and its node 0 waited on)."""
    if port_in_use(spec.port):
        raise ServerError(f"port {spec.port} on {HOST} is in use: stop what holds it or pick another port")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sgl-dspark-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{spec.port}.log"
    env = {**SERVER_ENV_DEFAULTS, **os.environ, **({} if has_cuda() else CPU_ENV), **spec.env}
    with log_path.open("w") as log:
        process = subprocess.Popen(spec.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=spec.cwd,
                                   start_new_session=True, preexec_fn=_die_with_parent)
    return RunningServer(spec, process, log_path)


def start(spec: ServerSpec, log_dir: Path | None = None) -> RunningServer:
    return _healthy(spawn(spec, log_dir))


def _healthy(server: RunningServer) -> RunningServer:
    """`server` once it answers; stopped if it never does."""
    try:
        _wait_healthy(server)
    except BaseException:
        stop(server)
        raise
    return server


@contextmanager
def serving(spec: ServerSpec, log_dir: Path | None = None) -> Iterator[RunningServer]:
    """Start the server, yield it once healthy, always stop it."""
    server = start(spec, log_dir)
    try:
        yield server
    finally:
        stop(server)


@contextmanager
def serving_together(jobs: list[tuple[ServerSpec, Path]]) -> Iterator[list[RunningServer]]:
    """Several servers (spec, log directory) started at once, yielded once all are healthy, always all stopped."""
    servers: list[RunningServer] = []
    try:
        for spec, log_dir in jobs:
            servers.append(spawn(spec, log_dir))
        for server in servers:
            _wait_healthy(server)
        yield servers
    finally:
        for server in servers:
            stop(server)


class ServerRelay:
    """Servers used one after another, each started while the one before it is in use: a start is mostly Python
    imports and set-up on a core the running server leaves idle (~30 s of CI time each). `jobs`: name -> (spec, log
    directory), in the order they will be asked for; a name asked out of order is started then (the server started
    ahead for another name is stopped). At most two servers run at once."""

    def __init__(self, jobs: dict[str, tuple[ServerSpec, Path]]):
        self._jobs = jobs
        self._order = list(jobs)
        self._ahead: tuple[str, RunningServer] | None = None

    @contextmanager
    def serving(self, name: str) -> Iterator[RunningServer]:
        """The server of `name`, healthy; the next name's is started before this one is yielded; always stopped."""
        server = _healthy(self._take(name))
        following = self._order.index(name) + 1
        if following < len(self._order):
            self._ahead = (self._order[following], spawn(*self._jobs[self._order[following]]))
        try:
            yield server
        finally:
            stop(server)

    def _take(self, name: str) -> RunningServer:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead[0] == name:
                return ahead[1]
            stop(ahead[1])
        return spawn(*self._jobs[name])

    def close(self) -> None:
        """Stop the server started ahead, if one is left."""
        if self._ahead is not None:
            stop(self._ahead[1])
            self._ahead = None


@contextmanager
def relay(jobs: dict[str, tuple[ServerSpec, Path]]) -> Iterator[ServerRelay]:
    """A `ServerRelay` over `jobs`, whose server started ahead is always stopped."""
    servers = ServerRelay(jobs)
    try:
        yield servers
    finally:
        servers.close()


@contextmanager
def serving_two_nodes(spec: ServerSpec, log_dir: Path) -> Iterator[tuple[RunningServer, RunningServer]]:
    """`spec` (its flags set the TP size, e.g. `--tp-size 2`) as node 0 and node 1 of `--nnodes 2` on this machine:
    a loopback `--dist-init-addr`, node 1 a second process with its own port (SGLang starts a dummy health server
    there) bound to its own core (each node's only rank sees gpu_id 0). Yields (node 0, node 1) once node 0
    serves; node 1 serves no requests and is stopped with it."""
    init = f"{HOST}:{free_port()}"
    nodes = [replace(spec, port=spec.port if rank == 0 else free_port(),
                     extra_args=(*spec.extra_args, "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
                                 init),
                     env={**spec.env, "SGLANG_CPU_OMP_THREADS_BIND": str(rank)}) for rank in (0, 1)]
    node1 = spawn(nodes[1], log_dir)
    try:
        with serving(nodes[0], log_dir) as node0:
            yield node0, node1
    finally:
        stop(node1)


@contextmanager
def routing(workers: list[str], log_path: Path, policy: str = "cache_aware") -> Iterator[str]:
    """`sglang-router` (the PyPI package) in front of the `workers` URLs with `policy`; its own /metrics on a free
    port (its fixed default would collide with a second router). Yields its URL once it answers a one-token request
    (its /health can answer before the workers are registered); always stopped."""
    port, metrics_port = free_port(), free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", HOST,
                                    "--port", str(port), "--prometheus-host", HOST, "--prometheus-port",
                                    str(metrics_port), "--policy", policy, "--worker-urls", *workers],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=_die_with_parent)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"sglang-router did not start: {_last_error_line(Path(log_path).read_text())} "
                                  f"(log: {log_path})")
            time.sleep(1.0)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        body = {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
        return requests.post(f"{url}/generate", json=body, timeout=60).status_code == 200
    except requests.RequestException:
        return False
