"""The draft client that drafts in a separate process (`ProcessDraftClient`), with its supervisor.

Owns the worker's lifetime (start, bounded waits, restart with bounded backoff, clean shutdown), the client-side
shared-memory arenas, and the record of which KV slots hold context in the current worker generation.
Must not import SGLang; the SGLang worker sees only the DraftClient protocol and DraftWorkerUnavailable.
"""

import json
import logging
import os
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import msgspec
import torch
import zmq

from sgl_dspark.draft_worker.client import ContextUpdate, DraftBatch, DraftWorkerUnavailable
from sgl_dspark.draft_worker.messages import (Ack, Error, Init, Message, Propose, Proposed, Ready, Shutdown,
                                              WriteContext)
from sgl_dspark.draft_worker.process import launch_command
from sgl_dspark.draft_worker.shm import ALIGN, DEFAULT_DIR, DTYPES, GrowingArena
from sgl_dspark.draft_worker.transport import Channel, ipc_address
from sgl_dspark.drafter.checkpoint import CONFIG_FILE
from sgl_dspark.drafter.config import TargetSpec, parse_drafter_config
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.tree import DraftTree

logger = logging.getLogger(__name__)
POLL_S = 0.05  # while waiting for a reply, check this often that the worker is still alive


class DraftWorkerError(DraftWorkerUnavailable):
    """The worker answered with an error (it keeps serving, no restart); the caller decodes without drafts."""


@dataclass(frozen=True)
class WorkerSettings:
    """How to run the worker; the SGLang seam builds it from DSparkConfig (knobs) and the server args."""

    drafter_path: str  # drafter checkpoint folder
    target_path: str  # target HF safetensors folder (embedding; lm_head unless tied)
    target: TargetSpec
    knobs: DraftKnobs
    num_slots: int  # target KV slots
    run_dir: str  # ipc sockets live here (a Unix socket path holds at most 107 bytes: keep it short)
    seed: int = 0
    dtype: str = "float32"  # drafter dtype in the worker
    torch_threads: int = 1
    gemm: str = "native"  # "onednn": pack the drafter's linear layers (sgl_dspark.packed_gemm)
    shm_dir: str = DEFAULT_DIR  # RAM-backed directory for the arenas
    max_step_tokens: int = 8192  # initial request arena: context tokens written in one call
    max_batch: int = 8  # initial reply arena: requests proposed in one call (both arenas grow on demand)
    start_timeout_s: float = 60.0  # spawn -> Ready
    write_timeout_s: float = 10.0
    propose_timeout_s: float = 3.0
    stop_timeout_s: float = 5.0  # Shutdown -> exit, then SIGKILL
    restart_backoff_s: tuple[float, float] = (0.5, 30.0)  # first and longest wait before a restart attempt
    max_restart_attempts: int = 8  # consecutive failed starts before the supervisor gives up

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES or self.num_slots < 1 or self.torch_threads < 1:
            raise ValueError(f"WorkerSettings: bad dtype {self.dtype!r}, num_slots {self.num_slots} or "
                             f"torch_threads {self.torch_threads}")
        timeouts = (self.start_timeout_s, self.write_timeout_s, self.propose_timeout_s, self.stop_timeout_s)
        first, longest = self.restart_backoff_s
        if min(timeouts) <= 0 or not 0 <= first <= longest or self.max_restart_attempts < 1:
            raise ValueError("WorkerSettings: timeouts must be > 0, restart_backoff_s (first <= longest), "
                             "max_restart_attempts >= 1")


def reply_bytes(batch: int, tree_size: int, vocab: int) -> int:
    """Upper bound of a Proposed reply's arena use: tokens, parents, confidence and draft_probs of every node."""
    return batch * tree_size * (8 + 8 + 4 + 4 * vocab) + 4 * ALIGN


def arena_sizes(settings: WorkerSettings) -> tuple[int, int]:
    """(request, reply) initial arena bytes, from the drafter's config.json and the step limits."""
    cfg = parse_drafter_config(json.loads((Path(settings.drafter_path) / CONFIG_FILE).read_text()))
    request = settings.max_step_tokens * (4 * cfg.num_features * cfg.hidden_size + 16) + 4 * ALIGN
    tree_size = settings.knobs.resolve(cfg.gamma).max_nodes + 1
    return request, reply_bytes(settings.max_batch, tree_size, cfg.vocab_size)


def backoff(settings: WorkerSettings, failures: int) -> float:
    first, longest = settings.restart_backoff_s
    return min(first * 2 ** max(failures - 1, 0), longest)


class WorkerHandle:
    """One generation of the worker: its process, its channel and what it reported at Ready."""

    def __init__(self, process: subprocess.Popen, channel: Channel) -> None:
        self.process, self.channel = process, channel
        self.ready: Ready | None = None

    @staticmethod
    def start(settings: WorkerSettings, init: Init, cancel: threading.Event) -> "WorkerHandle":
        """Spawn, send Init, wait (bounded) for Ready. DraftWorkerUnavailable, nothing left running, on failure."""
        address = ipc_address(settings.run_dir, f"dspark-draft-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        channel = Channel.client(address)
        try:
            handle = WorkerHandle(subprocess.Popen(launch_command(address, os.getpid())), channel)
        except OSError as exc:
            channel.close()
            raise DraftWorkerUnavailable(f"draft worker could not be spawned: {exc}") from exc
        try:
            reply = handle.request(init, settings.start_timeout_s, cancel)
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
            if self.process.poll() is not None:
                raise DraftWorkerUnavailable(f"draft worker {self.pid} died (exit code {self.process.returncode})")
            deadline = time.monotonic() + timeout_s
            self.channel.send(message, timeout_s)
            while (left := deadline - time.monotonic()) > 0 and not (cancel and cancel.is_set()):
                reply = self.channel.recv(min(POLL_S, left))
                if reply is not None:
                    return reply
                if self.process.poll() is not None:
                    code = self.process.returncode
                    raise DraftWorkerUnavailable(f"draft worker {self.pid} died (exit code {code})")
        except (zmq.ZMQError, msgspec.MsgspecError) as exc:
            if self.process.poll() is not None:  # a send to a dead worker times out: say why
                code = self.process.returncode
                raise DraftWorkerUnavailable(f"draft worker {self.pid} died (exit code {code})") from exc
            raise DraftWorkerUnavailable(f"draft worker {self.pid}: {name}: {type(exc).__name__}: {exc}") from exc
        if cancel and cancel.is_set():
            raise DraftWorkerUnavailable(f"draft worker {self.pid}: {name} cancelled (client closing)")
        raise DraftWorkerUnavailable(f"draft worker {self.pid} did not answer {name} within {timeout_s:g} s")

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


class SlotLedger:
    """Which KV slots hold context written to the current worker generation (cleared when the worker is lost)."""

    def __init__(self, num_slots: int) -> None:
        self.written = torch.zeros(num_slots, dtype=torch.bool)  # [num_slots]

    def mark(self, slots: torch.Tensor) -> None:
        self.written[slots.cpu()] = True

    def clear(self) -> None:
        self.written.zero_()

    def stale(self, contexts: tuple[torch.Tensor, ...]) -> list[int]:
        """Indices of the requests whose context has a slot not written in this generation."""
        if not contexts:
            return []
        lengths = torch.tensor([c.numel() for c in contexts])
        owner = torch.repeat_interleave(torch.arange(len(contexts)), lengths)  # [sum L_i] request of each slot
        missing = ~self.written[torch.cat(list(contexts)).cpu().long()]
        counts = torch.zeros(len(contexts), dtype=torch.long).index_add_(0, owner, missing.long())
        return counts.nonzero().flatten().tolist()


def anchor_only(batch: DraftBatch, i: int, vocab: int) -> DraftTree:
    """The no-draft tree of request i (the anchor alone): the request decodes one token, as without speculation."""
    sampled = bool(batch.sampling) and not batch.sampling[i].is_greedy
    return DraftTree(batch.anchors[i:i + 1].cpu().long(), torch.tensor([-1]), torch.ones(1),
                     torch.zeros(1, vocab) if sampled else None)


def unpack(reply: Proposed, arena: GrowingArena) -> list[DraftTree]:
    """Copy the trees out of the reply arena (it is overwritten by the next step)."""
    sizes = list(reply.sizes)
    tokens, parents, confidence = (arena.view(r).clone().split(sizes)
                                   for r in (reply.tokens, reply.parents, reply.confidence))
    probs = iter(())
    if reply.draft_probs is not None:
        probs = iter(arena.view(reply.draft_probs).clone().split([n for n, p in zip(sizes, reply.has_probs) if p]))
    return [DraftTree(t, p, c, next(probs) if has else None)
            for t, p, c, has in zip(tokens, parents, confidence, reply.has_probs)]


class ProcessDraftClient:
    """DraftClient whose engine (exactly LocalDraftClient) runs in a separate process.

    Failure: when the worker dies, stalls past a deadline or answers garbage, the call raises
    DraftWorkerUnavailable, one warning is logged ("draft worker died/stalled; serving without speculation;
    restarting"), and the worker is restarted in the background with bounded backoff. Until the new worker is
    up every call raises DraftWorkerUnavailable; the caller decodes without drafts (no request lost, no wrong token).

    Context contract: a restarted worker has an empty context store, and `generation` counts restarts. Context
    written before a restart is stale: `propose` never drafts from it — a request whose context slots were not
    all written (write_context) in the current generation gets an anchor-only tree (no draft tokens; draft_probs
    a zero row when sampled) until the caller rewrites that context. `stale_requests(batch)` names those
    requests beforehand. Context rewritten in the current generation drafts exactly as LocalDraftClient would.
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        request_bytes, reply_bytes_ = arena_sizes(settings)
        self.requests = GrowingArena(settings.shm_dir, request_bytes, "req")
        self.replies = GrowingArena(settings.shm_dir, reply_bytes_, "rep")
        self.ledger = SlotLedger(settings.num_slots)
        self._generation, self._failures = 0, 0
        self.ahead_hits = 0
        self._lock, self._closing = threading.Lock(), threading.Event()
        self._pending: WorkerHandle | None = None
        self._restarter: threading.Thread | None = None
        try:
            self._handle: WorkerHandle | None = self._start()
        except BaseException:
            self.requests.close()
            self.replies.close()
            raise

    # ---- the DraftClient protocol ----------------------------------------------------------------------------

    def write_context(self, update: ContextUpdate) -> None:
        self._live()
        refs = self.requests.put_all([update.slots, update.positions, update.features])
        self._call(WriteContext(*refs), self.settings.write_timeout_s, Ack)
        self.ledger.mark(update.slots)

    def propose(self, batch: DraftBatch) -> list[DraftTree]:
        ready = self._live().ready
        stale = set(self.ledger.stale(batch.context_slots))
        fresh = [i for i in range(batch.anchors.shape[0]) if i not in stale]
        sub = batch.select(fresh) if stale else batch
        trees = dict(zip(fresh, self._propose(sub))) if fresh else {}
        trees |= {i: anchor_only(batch, i, ready.probs_width) for i in stale}
        return [trees[i] for i in range(batch.anchors.shape[0])]

    def draft_ahead(self, batch: DraftBatch) -> None:
        """Only for a batch whose context is all written in this generation (else the worker drafts nothing)."""
        if self._handle is not None and not self.ledger.stale(batch.context_slots):
            self._propose(batch, ahead=True)

    def close(self) -> None:
        """Shut the worker down (Shutdown, wait, SIGKILL after stop_timeout_s) and free the arenas. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._restarter is not None:
            self._restarter.join()
        for handle in (self._handle, self._pending):
            if handle is not None:
                handle.stop(self.settings.stop_timeout_s)
        self._handle = self._pending = None
        self.requests.close()
        self.replies.close()

    # ---- state the caller may read ---------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """0 for the first worker, +1 per restart that took over (context written before it is stale)."""
        return self._generation

    @property
    def available(self) -> bool:
        return not self._closing.is_set() and (self._handle is not None or self._pending is not None)

    @property
    def pid(self) -> int | None:
        return None if self._handle is None else self._handle.pid

    def stale_requests(self, batch: DraftBatch) -> list[int]:
        """Requests whose context must be rewritten before they are drafted for again."""
        return self.ledger.stale(batch.context_slots)

    def __enter__(self) -> "ProcessDraftClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------------------------

    def _propose(self, batch: DraftBatch, ahead: bool = False) -> list[DraftTree]:
        lengths = tuple(s.numel() for s in batch.context_slots)
        slots, anchors, positions = self.requests.put_all([torch.cat(batch.context_slots), batch.anchors,
                                                           batch.anchor_positions])
        ready = self._handle.ready
        self.replies.ensure(reply_bytes(len(lengths), ready.max_tree_size, ready.probs_width))
        message = Propose(slots, lengths, anchors, positions, tuple(batch.sampling), self.replies.path, ahead)
        if ahead:
            self._call(message, self.settings.write_timeout_s, Ack)
            return []
        reply = self._call(message, self.settings.propose_timeout_s, Proposed)
        self.ahead_hits += reply.ahead
        return unpack(reply, self.replies)

    def _call(self, message: Message, timeout_s: float, expect: type) -> Message:
        handle = self._live()
        try:
            reply = handle.request(message, timeout_s)
        except DraftWorkerUnavailable as exc:
            self._fail(exc)
        if isinstance(reply, Error):
            logger.warning("draft worker error on %s: %s", type(message).__name__, reply.message)
            raise DraftWorkerError(reply.message)
        if not isinstance(reply, expect):
            self._fail(DraftWorkerUnavailable(f"draft worker answered {type(reply).__name__} to "
                                              f"{type(message).__name__}"))
        self._failures = 0
        return reply

    # ---- supervision -----------------------------------------------------------------------------------------

    def _start(self) -> WorkerHandle:
        s = self.settings
        init = Init(s.drafter_path, s.target_path, s.target, s.knobs, s.num_slots, s.seed, s.dtype,
                    s.torch_threads, (self.requests.path, self.replies.path), s.gemm)
        return WorkerHandle.start(s, init, self._closing)

    def _live(self) -> WorkerHandle:
        """The serving worker, installing a restarted one first; DraftWorkerUnavailable when there is none."""
        if self._closing.is_set():
            raise DraftWorkerUnavailable("draft client is closed")
        if self._handle is None:
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is None:
                raise DraftWorkerUnavailable("draft worker is restarting")
            self._handle, self._generation = pending, self._generation + 1
            self.ledger.clear()
            logger.info("draft worker restarted (pid %d, generation %d); stale context must be rewritten",
                        pending.pid, self._generation)
        return self._handle

    def _fail(self, exc: DraftWorkerUnavailable) -> NoReturn:
        handle, self._handle = self._handle, None
        self.ledger.clear()
        self._failures += 1
        logger.warning("draft worker died/stalled (%s); serving without speculation; restarting", exc)
        handle.kill()
        self._restarter = threading.Thread(target=self._restart, name="dspark-draft-restart", daemon=True)
        self._restarter.start()
        raise exc

    def _restart(self) -> None:
        """Background: start a new worker after a backoff; hand it over via _pending (installed by _live)."""
        for attempt in range(self.settings.max_restart_attempts):
            if self._closing.wait(backoff(self.settings, self._failures + attempt)):
                return
            try:
                handle = self._start()
            except DraftWorkerUnavailable as exc:
                if not self._closing.is_set():
                    logger.warning("draft worker restart failed: %s", exc)
                continue
            with self._lock:
                if not self._closing.is_set():
                    self._pending = handle
                    return
            handle.stop(self.settings.stop_timeout_s)
            return
        logger.error("draft worker: %d restarts failed; serving without speculation from now on",
                     self.settings.max_restart_attempts)
