"""The one transport between the draft client and the draft-worker process: msgspec messages over a ZMQ ipc:// pair.

The client binds a REQ socket at an address under the run directory (a fresh address per worker generation, so a
killed worker's late reply can never reach its successor); the worker connects a REP socket. Both sides receive
with a timeout. Must not interpret messages.
"""

from pathlib import Path

import zmq

from sgl_dspark.draft_worker.messages import Message, decode, encode

MAX_IPC_PATH = 107  # sun_path limit of a Unix socket address (bytes, without the terminating NUL)


def ipc_address(run_dir: str | Path, name: str) -> str:
    """ipc://<run_dir>/<name>.sock; the run directory is created. Refuses paths a Unix socket cannot hold."""
    directory = Path(run_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.sock"
    if len(str(path).encode()) > MAX_IPC_PATH:
        raise ValueError(f"transport: ipc path {path} is longer than {MAX_IPC_PATH} bytes; use a shorter run_dir")
    return f"ipc://{path}"


def ipc_path(address: str) -> Path:
    return Path(address.removeprefix("ipc://"))


class Channel:
    """One end of the request/reply pair; owns its ZMQ context and socket."""

    def __init__(self, kind: int, address: str, bind: bool) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address, self.bound = address, bind
        if bind:
            self.socket.bind(address)
        else:
            self.socket.connect(address)

    @staticmethod
    def client(address: str) -> "Channel":
        return Channel(zmq.REQ, address, bind=True)

    @staticmethod
    def server(address: str) -> "Channel":
        return Channel(zmq.REP, address, bind=False)

    def send(self, message: Message, timeout_s: float) -> None:
        """Send, or raise zmq.Again when the peer cannot take it within timeout_s (a REQ socket whose worker
        died has no peer, and a plain send would block forever)."""
        if not self.socket.poll(max(0, int(timeout_s * 1000)), zmq.POLLOUT):
            raise zmq.Again(f"no peer took the message within {timeout_s:g} s")
        self.socket.send(encode(message), copy=False, flags=zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or None when none arrives within timeout_s."""
        if not self.socket.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        return decode(self.socket.recv(copy=True))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
        if self.bound and self.address.startswith("ipc://"):
            ipc_path(self.address).unlink(missing_ok=True)
