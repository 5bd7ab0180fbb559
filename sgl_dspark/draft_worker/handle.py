"""One generation of the draft worker: its process, its channel, and requests answered within a deadline.

Every way a request can fail (the process died, the deadline passed, the bytes were no message, the socket broke)
comes out as DraftWorkerUnavailable with its cause. Must not decide about restarts (the client does: remote.py).
"""

import os
import subprocess
import threading
import time
import uuid

import msgspec
import zmq

from sgl_dspark.draft_worker.client import DraftWorkerUnavailable
from sgl_dspark.draft_worker.messages import Init, Message, Ready, Shutdown
from sgl_dspark.draft_worker.process import launch_command
from sgl_dspark.draft_worker.reply import garbled
from sgl_dspark.draft_worker.transport import Channel, ipc_address

POLL_S = 0.05  # while waiting for a reply, check this often that the worker is still alive


class WorkerHandle:
    """One generation of the worker: its process, its channel and what it reported at Ready."""

    def __init__(self, process: subprocess.Popen, channel: Channel) -> None:
        self.process, self.channel = process, channel
        self.ready: Ready | None = None

    @staticmethod
    def start(run_dir: str, init: Init, timeout_s: float, cancel: threading.Event) -> "WorkerHandle":
        """Spawn with its socket in `run_dir`, send Init, wait up to timeout_s for Ready. DraftWorkerUnavailable,
        nothing left running, on failure."""
        address = ipc_address(run_dir, f"dspark-draft-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        channel = Channel.client(address)
        try:
            handle = WorkerHandle(subprocess.Popen(launch_command(address, os.getpid())), channel)
        except OSError as exc:
            channel.close()
            raise DraftWorkerUnavailable(f"draft worker could not be spawned: {exc}", "dead") from exc
        try:
            reply = handle.request(init, timeout_s, cancel)
            if not isinstance(reply, Ready):
                raise DraftWorkerUnavailable(f"draft worker failed to start: {getattr(reply, 'message', reply)}")
        except BaseException:
            handle.kill()
            raise
        handle.ready = reply
        return handle

    @property
    def pid(self) -> int:
        return self.process.pid

    def request(self, message: Message, timeout_s: float, cancel: threading.Event | None = None) -> Message:
        """Send, then wait for the reply; DraftWorkerUnavailable when the process dies or the deadline passes."""
        name = type(message).__name__
        try:
            self.check_alive()
            deadline = time.monotonic() + timeout_s
            self.channel.send(message, timeout_s)
            while (left := deadline - time.monotonic()) > 0 and not (cancel and cancel.is_set()):
                reply = self.channel.recv(min(POLL_S, left))
                if reply is not None:
                    return reply
                self.check_alive()
        except msgspec.MsgspecError as exc:
            raise garbled(f"{name}: {type(exc).__name__}: {exc}") from exc
        except zmq.ZMQError as exc:
            self.check_alive()  # a send to a dead worker times out: say why
            raise DraftWorkerUnavailable(f"draft worker {self.pid}: {name}: {type(exc).__name__}: {exc}") from exc
        if cancel and cancel.is_set():
            raise DraftWorkerUnavailable(f"draft worker {self.pid}: {name} cancelled (client closing)", "closed")
        raise DraftWorkerUnavailable(f"draft worker {self.pid} did not answer {name} within {timeout_s:g} s",
                                     "stalled")

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            code = self.process.returncode
            raise DraftWorkerUnavailable(f"draft worker {self.pid} died (exit code {code})", "dead")

    def stop(self, timeout_s: float) -> None:
        """Shutdown, wait for the exit, SIGKILL after the timeout."""
        try:
            self.request(Shutdown(), timeout_s)
            self.process.wait(timeout_s)
        except (DraftWorkerUnavailable, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.channel.close()
