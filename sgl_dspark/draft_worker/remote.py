"""The draft client that drafts in a separate process (`ProcessDraftClient`), with its supervisor.

Owns the worker's lifetime (start, restart with bounded backoff, clean shutdown; one generation is a `WorkerHandle`),
the client-side shared-memory arenas and the run directory, and checks every reply before the caller sees it.
Must not import SGLang; the SGLang worker sees only the DraftClient protocol and DraftWorkerUnavailable.
"""

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch

from sgl_dspark.draft_worker.client import (ContextUpdate, DraftBatch, DraftReplyInvalid, DraftWorkerUnavailable,
                                            ShmFull)
from sgl_dspark.draft_worker.handle import WorkerHandle
from sgl_dspark.draft_worker.ledger import SlotLedger
from sgl_dspark.draft_worker.messages import Ack, Error, Init, Message, Propose, Proposed, WriteContext
from sgl_dspark.draft_worker.reply import ReplyLimits, garbled, unpack
from sgl_dspark.draft_worker.shm import ALIGN, DEFAULT_DIR, DTYPES, GrowingArena, arena_prefix, space
from sgl_dspark.drafter.checkpoint import read_drafter_config
from sgl_dspark.drafter.config import DrafterConfig, TargetSpec
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.streams import DRAFT, stream_seed
from sgl_dspark.tree import DraftTree

logger = logging.getLogger(__name__)


class DraftWorkerError(DraftWorkerUnavailable):
    """The worker answered with an error (it keeps serving, no restart); the caller decodes without drafts."""


@contextmanager
def shm_errors(directory: str) -> Iterator[None]:
    """An arena that cannot be created, grown or written (ENOSPC and any other OSError) -> ShmFull saying where,
    how full it is and what to do."""
    try:
        yield
    except OSError as exc:
        raise ShmFull(f"draft arenas: {directory} ({space(directory)}): {exc.strerror or exc}; enlarge it (docker "
                      f"run --shm-size=2g, or mount -o remount,size=2G {directory}) or free space there") from exc


@contextmanager
def unavailable_on_error(call: str) -> Iterator[None]:
    """Whatever else goes wrong in a client call reaches the caller as DraftWorkerUnavailable (cause "error"), never
    as OSError, ValueError and the like."""
    try:
        yield
    except DraftWorkerUnavailable:
        raise
    except Exception as exc:
        message = f"draft client {call}: {type(exc).__name__}: {exc}".replace("\n", " ")
        raise DraftWorkerUnavailable(message, "error") from exc


@dataclass(frozen=True)
class WorkerSettings:
    """How to run the worker; the SGLang seam builds it from DSparkKnobs (knobs) and the server args."""

    drafter_path: str  # drafter checkpoint folder
    target_path: str  # target HF safetensors folder (embedding; lm_head unless tied)
    target: TargetSpec
    knobs: DraftKnobs
    num_slots: int  # target KV slots
    run_dir: str | None = None  # ipc sockets live here (<= 107-byte socket paths); None: a fresh temporary one
    seed: int = 0  # --random-seed; each start's drafter stream derives from it (sgl_dspark.streams)
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
    drafter_config: DrafterConfig | None = None  # the drafter's config.json as the launch read it; None: read it

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
    """(request, reply) initial arena bytes, from the drafter's config and the step limits."""
    cfg = settings.drafter_config or read_drafter_config(settings.drafter_path)
    request = settings.max_step_tokens * (4 * cfg.num_features * cfg.hidden_size + 16) + 4 * ALIGN
    tree_size = settings.knobs.resolve(cfg.gamma).max_nodes + 1
    return request, reply_bytes(settings.max_batch, tree_size, cfg.vocab_size)


def backoff(settings: WorkerSettings, failures: int) -> float:
    first, longest = settings.restart_backoff_s
    return min(first * 2 ** max(failures - 1, 0), longest)


def anchor_only(batch: DraftBatch, i: int, vocab: int) -> DraftTree:
    """The no-draft tree of request i (the anchor alone): the request decodes one token, as without speculation."""
    sampled = bool(batch.sampling) and not batch.sampling[i].is_greedy
    return DraftTree(batch.anchors[i:i + 1].cpu().long(), torch.tensor([-1]), torch.ones(1),
                     torch.zeros(1, vocab) if sampled else None)


def sampled_rows(batch: DraftBatch) -> tuple[bool, ...]:
    """[B] whether request i samples (its tree must carry draft_probs)."""
    if not batch.sampling:
        return (False,) * batch.anchors.shape[0]
    return tuple(not s.is_greedy for s in batch.sampling)


class ProcessDraftClient:
    """DraftClient whose engine (exactly LocalDraftClient) runs in a separate process.

    Failure: every failure reaches the caller as DraftWorkerUnavailable, whose `cause` names it (client.CAUSES);
    the caller decodes that step without drafts (no request lost, no wrong token). When the worker dies, stalls
    past a deadline or answers garbage (a reply of the wrong type, or a Proposed whose framing is wrong:
    DraftReplyInvalid with garbled=True), one warning is logged ("... serving without speculation; restarting")
    and the worker is restarted in the background with bounded backoff; until the new worker is up every call
    raises DraftWorkerUnavailable (cause "restarting"). A Proposed whose numbers only are wrong (token ids,
    confidences, probabilities: garbled=False), an Error reply (DraftWorkerError) and a full shared-memory
    directory (ShmFull, cause "shm_full") fail that call only: the worker keeps serving.

    Context contract: a restarted worker has an empty context store, and `generation` counts restarts. Context
    written before a restart is stale: `propose` never drafts from it. A request drafts from the part of its
    context written (write_context) in the current generation (SlotLedger.drafted_part), and gets an anchor-only
    tree (no draft tokens; draft_probs a zero row when sampled) only while nothing of its context is written;
    `stale_requests(batch)` names the requests with some stale context. Drafts never change the output (the target
    verifies them), only how many are accepted. A request whose context is all written in the current generation
    drafts exactly as LocalDraftClient would.

    Files: the arenas live in settings.shm_dir; the ipc sockets in settings.run_dir, or, when it is None, in a
    temporary directory the client creates and removes in close().
    """

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.run_dir = settings.run_dir or tempfile.mkdtemp(prefix="dspark-")  # short: socket paths <= 107 bytes
        self._owns_run_dir = settings.run_dir is None
        self.ledger = SlotLedger(settings.num_slots)
        self._generation, self._failures, self._drafted = 0, 0, 0
        self.rows_copied = 0  # context rows the current worker copied out of its slot store, as it last reported
        self._starts = 0  # worker processes started: each draws from a stream of its own
        self.ahead_hits = 0
        self._lock, self._closing = threading.Lock(), threading.Event()
        self._pending: WorkerHandle | None = None
        self._restarter: threading.Thread | None = None
        self._gave_up = False
        with ExitStack() as undo:  # on any failure below, undo what was made
            undo.callback(self._remove_run_dir)
            request_bytes, reply_bytes_ = arena_sizes(settings)
            with shm_errors(settings.shm_dir):
                self.requests = GrowingArena(settings.shm_dir, request_bytes, "req")
                undo.callback(self.requests.close)
                self.replies = GrowingArena(settings.shm_dir, reply_bytes_, "rep")
                undo.callback(self.replies.close)
            self._handle: WorkerHandle | None = self._start()
            undo.pop_all()

    # ---- the DraftClient protocol ----------------------------------------------------------------------------

    def write_context(self, update: ContextUpdate) -> None:
        with unavailable_on_error("write_context"):
            self._live()
            slots = update.slots.cpu()  # the worker process drafts on the CPU: features cross to the host here
            with shm_errors(self.settings.shm_dir):
                refs = self.requests.put_all([slots, update.positions.cpu(), update.features.cpu()])
            self._call(WriteContext(*refs, restart=update.restart), self.settings.write_timeout_s, Ack)
            self.ledger.mark(slots)

    def propose(self, batch: DraftBatch) -> list[DraftTree]:
        with unavailable_on_error("propose"):
            width = self._live().ready.probs_width
            part, rows = self.ledger.drafted_part(batch)
            trees = dict(zip(rows, self._propose(part))) if rows else {}
            return [trees[i] if i in trees else anchor_only(batch, i, width) for i in range(batch.anchors.shape[0])]

    def draft_ahead(self, batch: DraftBatch) -> None:
        """Drafts what `propose` would (the written part of each context), so the keys match next step."""
        with unavailable_on_error("draft_ahead"):
            if self._handle is None:
                return
            part, rows = self.ledger.drafted_part(batch)
            if rows:
                self._propose(part, ahead=True)

    def close(self) -> None:
        """Shut the worker down (Shutdown, wait, SIGKILL after stop_timeout_s), free the arenas and remove the run
        directory the client made. Idempotent."""
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
        self._remove_run_dir()

    # ---- state the caller may read ---------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """0 for the first worker, +1 per restart that took over (context written before it is stale)."""
        return self._generation

    @property
    def worker_drafted(self) -> int:
        """Draft nodes (anchors excluded) the current generation's worker produced, as it last reported (0 right
        after a restart)."""
        return self._drafted

    @property
    def arena_bytes(self) -> int:
        """Shared-memory bytes the client's arenas hold now (0 once closed)."""
        return 0 if self._closing.is_set() else self.requests.arena.size + self.replies.arena.size

    @property
    def available(self) -> bool:
        return not self._closing.is_set() and (self._handle is not None or self._pending is not None)

    @property
    def pid(self) -> int | None:
        return None if self._handle is None else self._handle.pid

    def stale_requests(self, batch: DraftBatch) -> list[int]:
        """Requests with context written before the current generation (drafted from the rest of it only)."""
        return self.ledger.stale(batch.context_slots)

    def __enter__(self) -> "ProcessDraftClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------------------------

    def _propose(self, batch: DraftBatch, ahead: bool = False) -> list[DraftTree]:
        lengths = tuple(s.numel() for s in batch.context_slots)
        ready = self._handle.ready
        with shm_errors(self.settings.shm_dir):
            slots, anchors, positions = self.requests.put_all([torch.cat(batch.context_slots), batch.anchors,
                                                               batch.anchor_positions])
            self.replies.ensure(reply_bytes(len(lengths), ready.max_tree_size, ready.probs_width))
        message = Propose(slots, lengths, anchors, positions, tuple(batch.sampling), self.replies.path, ahead,
                          batch.rids)
        if ahead:
            self._call(message, self.settings.write_timeout_s, Ack)
            return []
        limits = ReplyLimits(sampled_rows(batch), ready.max_tree_size, ready.probs_width)
        reply, trees = self._call(message, self.settings.propose_timeout_s, Proposed,
                                  lambda r: (r, unpack(r, self.replies, limits)))
        self.ahead_hits += reply.ahead
        self._drafted, self.rows_copied = reply.drafted_total, reply.rows_copied_total
        return trees

    def _call(self, message: Message, timeout_s: float, expect: type, read: Callable | None = None):
        """The worker's reply to `message`, of type `expect`, passed through `read` (which validates it). A lost
        worker or a garbled reply restarts it (_fail); an Error reply or a reply with bad numbers does not."""
        handle = self._live()
        try:
            reply = handle.request(message, timeout_s)
            if isinstance(reply, Error):
                logger.warning("draft worker error on %s: %s", type(message).__name__, reply.message)
                raise DraftWorkerError(f"draft worker error on {type(message).__name__}: {reply.message}")
            if not isinstance(reply, expect):
                raise garbled(f"{type(reply).__name__} in answer to {type(message).__name__}")
            result = reply if read is None else read(reply)
        except DraftWorkerError:
            raise
        except DraftReplyInvalid as exc:
            if exc.garbled:
                self._fail(exc)
            raise
        except DraftWorkerUnavailable as exc:
            self._fail(exc)
        self._failures = 0
        return result

    # ---- supervision -----------------------------------------------------------------------------------------

    def _start(self) -> WorkerHandle:
        s, start = self.settings, self._starts
        self._starts += 1
        seed = stream_seed(s.seed, DRAFT, start)
        init = Init(s.drafter_path, s.target_path, s.target, s.knobs, s.num_slots, seed, s.dtype, s.torch_threads,
                    (self.requests.path, self.replies.path), arena_prefix(s.shm_dir), s.gemm)
        return WorkerHandle.start(self.run_dir, init, s.start_timeout_s, self._closing)

    def _live(self) -> WorkerHandle:
        """The serving worker, installing a restarted one first; DraftWorkerUnavailable when there is none."""
        if self._closing.is_set():
            raise DraftWorkerUnavailable("draft client is closed", "closed")
        if self._handle is None:
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is None and self._gave_up:
                raise DraftWorkerUnavailable(f"draft worker is down: {self.settings.max_restart_attempts} restarts "
                                             f"failed", "dead")
            if pending is None:
                raise DraftWorkerUnavailable("draft worker is restarting", "restarting")
            self._handle, self._generation, self._drafted, self.rows_copied = pending, self._generation + 1, 0, 0
            self.ledger.clear()
            logger.info("draft worker restarted (pid %d, generation %d); drafting from context written from now on",
                        pending.pid, self._generation)
        return self._handle

    def _fail(self, exc: DraftWorkerUnavailable) -> NoReturn:
        handle, self._handle = self._handle, None
        self.ledger.clear()
        self._failures += 1
        logger.warning("draft worker failed (%s: %s); serving without speculation; restarting", exc.cause, exc)
        handle.kill()
        self._restarter = threading.Thread(target=self._restart, name="dspark-draft-restart", daemon=True)
        self._restarter.start()
        raise exc

    def _remove_run_dir(self) -> None:
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _restart(self) -> None:
        """Background: start a new worker after a backoff; hand it over via _pending (installed by _live)."""
        for attempt in range(self.settings.max_restart_attempts):
            if self._closing.wait(backoff(self.settings, self._failures + attempt)):
                return
            try:
                handle = self._start()
            except Exception as exc:  # whatever it is, the next attempt may succeed; this thread must not die
                if not self._closing.is_set():
                    logger.warning("draft worker restart failed: %s", exc)
                continue
            with self._lock:
                if not self._closing.is_set():
                    self._pending = handle
                    return
            handle.stop(self.settings.stop_timeout_s)
            return
        self._gave_up = True
        logger.error("draft worker: %d restarts failed; serving without speculation from now on",
                     self.settings.max_restart_attempts)
