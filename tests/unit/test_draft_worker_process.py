"""The draft-worker process: drafts exactly as the in-process engine (greedy and seeded sampling), fails fast and
restarts when killed or stalled (stale context is never drafted from), and leaves no process, socket or
shared-memory file behind after close() or after its parent dies."""

import errno
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import replace

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from sgl_dspark.draft_worker.client import (ContextUpdate, DraftBatch, DraftReplyInvalid, DraftWorkerUnavailable,
                                            ShmFull)
from sgl_dspark.draft_worker.local import GuardedDraftClient, LocalDraftClient
from sgl_dspark.draft_worker.messages import (Ack, Error, Init, Ping, Pong, Propose, Proposed, Ready, Shutdown,
                                              TensorRef, WriteContext)
from sgl_dspark.draft_worker.process import Worker, load_target_weights
from sgl_dspark.draft_worker.shm import GrowingArena, arena_prefix
from sgl_dspark.draft_worker.remote import ProcessDraftClient, WorkerSettings, arena_sizes
from sgl_dspark.drafter import DraftKnobs, TargetSpec, load_drafter, save_drafter
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter
from sgl_dspark.sampling import SamplingParams
from sgl_dspark.streams import DRAFT, stream_seed

KNOBS = DraftKnobs(tree_width=2, branch_threshold=0.6)
NUM_SLOTS = 64
SEED = 5
GREEDY, WARM, TOPK = SamplingParams(0.0), SamplingParams(0.8), SamplingParams(1.0, top_k=10)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(drafter folder, target folder with untied embed / lm_head, TargetSpec)."""
    root = tmp_path_factory.mktemp("dw")
    drafter, spec = random_drafter(tiny_hf_config(), seed=1)
    save_drafter(drafter, root / "drafter")
    (root / "target").mkdir()
    save_file({"model.embed_tokens.weight": drafter.target.embed, "lm_head.weight": drafter.target.lm_head},
              str(root / "target" / "model.safetensors"))
    return str(root / "drafter"), str(root / "target"), spec


@pytest.fixture(scope="module")
def run_dir():
    path = tempfile.mkdtemp(prefix="dspark-t-", dir="/tmp")  # short: a Unix socket path holds <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def one_thread():
    """The worker runs one torch thread; the local reference does too, so float reductions agree bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def settings(folders, run_dir, **overrides):
    drafter_path, target_path, spec = folders
    fields = dict(drafter_path=drafter_path, target_path=target_path, target=spec, knobs=KNOBS, num_slots=NUM_SLOTS,
                  run_dir=run_dir, seed=SEED, max_step_tokens=4, max_batch=1, propose_timeout_s=2.0,
                  restart_backoff_s=(0.0, 0.1))
    return WorkerSettings(**(fields | overrides))


def local_client(folders, start=0):
    """The in-process engine drawing from the stream the worker's `start`-th process draws from."""
    drafter_path, target_path, spec = folders
    drafter = load_drafter(drafter_path, spec, load_target_weights(target_path))
    return LocalDraftClient(drafter, KNOBS, NUM_SLOTS, stream_seed(SEED, DRAFT, start))


def context(lengths=(5, 3, 7), seed=0):
    """Per request: a ContextUpdate at its own slots, and its slot ids."""
    g = torch.Generator().manual_seed(seed)
    updates, start = [], 0
    for n in lengths:
        slots = torch.arange(start, start + n) * 3 % NUM_SLOTS  # scattered, distinct slots
        updates.append(ContextUpdate(slots, torch.arange(n), torch.randn(n, 64, generator=g)))
        start += n
    return updates


def batch(updates, sampling, anchors=(7, 11, 23), rids=""):
    """rids: a prefix of request ids (each request's context then kept in a buffer of its own on the drafting
    side); empty: no ids."""
    n = len(updates)
    return DraftBatch(tuple(u.slots for u in updates), torch.tensor(anchors[:n]),
                      torch.tensor([u.slots.numel() for u in updates]), sampling[:n],
                      tuple(f"{rids}{i}" for i in range(n)) if rids else ())


def assert_same_trees(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        torch.testing.assert_close(a.confidence, b.confidence, rtol=0, atol=0)
        assert (a.draft_probs is None) == (b.draft_probs is None)
        if a.draft_probs is not None:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=0, atol=0)


def shm_files():
    return set(glob.glob(f"/dev/shm/sgl_dspark_{os.getpid()}_*"))


def wait_until_served(client, b):
    """Propose until the restarted worker answers (DraftWorkerUnavailable meanwhile), for as long as the supervisor
    itself waits for a start: its first backoff plus the start timeout (a spawn that imports torch and loads the
    drafter took over 20 s beside CI's servers)."""
    end = time.monotonic() + client.settings.restart_backoff_s[0] + client.settings.start_timeout_s
    while True:
        try:
            return client.propose(b)
        except DraftWorkerUnavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def gone(pid):
    """Exited (a zombie counts: the container's init may never reap an orphan)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def wait_gone(pid, deadline_s=5.0):
    end = time.monotonic() + deadline_s
    while not gone(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return gone(pid)


def sockets(run_dir):
    return set(glob.glob(os.path.join(run_dir, "*.sock")))


def live_children():
    """Pids of this process's children that have not exited (from /proc: state and ppid follow the name)."""
    out = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == os.getpid() and state != "Z":
            out.add(int(stat.split("/")[2]))
    return out


@pytest.fixture(scope="module")
def remote(folders, run_dir):
    client = ProcessDraftClient(settings(folders, run_dir))
    yield client
    client.close()


@pytest.fixture()
def written(folders, run_dir):
    """A client of its own (its worker gets spoiled or killed) with context() written: (client, updates)."""
    client = ProcessDraftClient(settings(folders, run_dir))
    updates = context()
    for u in updates:
        client.write_context(u)
    yield client, updates
    client.close()


def test_load_target_weights_tied_and_untied(tmp_path):
    embed, head = torch.randn(10, 4), torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)},
              str(tmp_path / "a.safetensors"))
    tied = load_target_weights(tmp_path)
    assert torch.equal(tied.embed, embed) and tied.lm_head is tied.embed
    save_file({"lm_head.weight": head}, str(tmp_path / "b.safetensors"))
    untied = load_target_weights(tmp_path, torch.bfloat16)
    assert torch.equal(untied.lm_head, head.bfloat16()) and untied.embed.dtype == torch.bfloat16


@pytest.mark.parametrize(("sampling", "rids"), [((GREEDY, GREEDY, GREEDY), False), ((WARM, GREEDY, TOPK), False),
                                               ((GREEDY, GREEDY, GREEDY), True)],
                         ids=["greedy", "sampled", "greedy-buffered"])  # one sampled case: the worker's stream
# (module-scoped) and a fresh local one agree only until one of them samples
def test_remote_drafts_exactly_as_local(folders, remote, one_thread, sampling, rids):
    local = local_client(folders)
    for u in context():
        local.write_context(u)
        remote.write_context(u)
    rids = uuid.uuid4().hex if rids else ""  # the worker (module-scoped) outlives a test: ids of this test's own
    copied = remote.rows_copied
    b = batch(context(), sampling, rids=rids)
    for _ in range(2):  # the second step checks that both generators advanced alike
        assert_same_trees(remote.propose(b), local.propose(b))
    grown = [ContextUpdate(u.slots[-1:] + 1, u.positions[-1:] + 1, u.features[-1:]) for u in context()]
    for u in grown:  # a step later: one more context row each (buffers take just that row)
        local.write_context(u)
        remote.write_context(u)
    later_updates = [ContextUpdate(torch.cat([u.slots, g.slots]), None, None) for u, g in zip(context(), grown)]
    later = batch(later_updates, sampling, rids=rids)
    assert_same_trees(remote.propose(later), local.propose(later))
    if rids:  # request 0 prefilled again (retracted, then back) at other slots with other rows: the restart
        # crosses to the worker, which drops its buffer and drafts it from the new rows, as the local engine does
        prefill = context(lengths=(8,), seed=1)[0]
        again = replace(prefill, slots=prefill.slots + 2, restart=(f"{rids}0",))  # slots no other request holds
        local.write_context(again)
        remote.write_context(again)
        moved = batch([again, *later_updates[1:]], sampling, rids=rids)
        assert_same_trees(remote.propose(moved), local.propose(moved))
    rows = sum(len(u.slots) for u in context())
    # buffered: every row once, the one new row each, then the restarted request's 8 rows (the others unchanged);
    # padded: every row at each of the three calls, +1 each
    assert remote.rows_copied - copied == local.rows_copied == (rows + 3 + 8 if rids else 3 * rows + 3)
    initial = arena_sizes(remote.settings)
    assert remote.requests.arena.size > initial[0] and remote.replies.arena.size > initial[1]  # both grew
    assert remote.generation == 0 and remote.stale_requests(b) == []


def assert_close_trees(got, want):
    """Same tokens and tree; confidences up to rounding (a request drafted alone pads its context differently)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)


def test_drafts_made_ahead_are_reused_only_where_the_request_is_unchanged(folders, remote, one_thread):
    local = local_client(folders)
    updates = context(seed=5)
    for u in updates:
        local.write_context(u)
        remote.write_context(u)
    greedy = (GREEDY, GREEDY, GREEDY)
    b = batch(updates, greedy)
    hits = remote.ahead_hits
    remote.draft_ahead(b)
    assert_close_trees(remote.propose(b), local.propose(b))
    assert remote.ahead_hits - hits == 3
    moved = batch(updates, greedy, anchors=(7, 12, 23))  # request 1 has another anchor: drafted afresh
    remote.draft_ahead(b)
    assert_close_trees(remote.propose(moved), local.propose(moved))
    assert remote.ahead_hits - hits == 3 + 2
    remote.draft_ahead(b)
    remote.write_context(updates[0])  # new context rows: nothing drafted ahead is trusted
    assert_close_trees(remote.propose(b), local.propose(b))
    assert remote.ahead_hits - hits == 3 + 2


def test_killed_worker_fails_fast_restarts_and_drafts_again_after_rewrite(folders, written, one_thread, caplog):
    client, updates = written
    b = batch(updates, (WARM, GREEDY, TOPK))
    client.propose(b)
    first = client.pid
    os.kill(first, signal.SIGKILL)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(DraftWorkerUnavailable, match="died"):
        client.propose(b)
    assert time.monotonic() - start < 1.5  # a dead process is noticed long before the deadline
    warned = [r.message for r in caplog.records if "draft worker failed (dead" in r.message]
    assert len(warned) == 1 and "serving without speculation; restarting" in warned[0] and not client.pid
    stale = wait_until_served(client, b)  # the new worker never drafts from pre-restart context
    assert client.generation == 1 and client.pid != first
    assert [t.size for t in stale] == [1, 1, 1] and stale[1].draft_probs is None
    assert torch.equal(stale[0].draft_probs, torch.zeros(1, 50))
    assert client.stale_requests(b) == [0, 1, 2]
    client.write_context(updates[1])  # rewrite one (greedy: no draw from the reseeded generator)
    assert client.stale_requests(b) == [0, 2]
    assert [t.size > 1 for t in client.propose(b)] == [False, True, False]
    local = local_client(folders, start=1)  # the restarted process draws from a stream of its own
    for u in updates:
        local.write_context(u)
        client.write_context(u)
    assert_same_trees(client.propose(b), local.propose(b))


def test_stalled_worker_times_out_and_close_mid_restart_leaves_nothing(folders, run_dir):
    baseline = shm_files(), sockets(run_dir), live_children()
    client = ProcessDraftClient(settings(folders, run_dir, propose_timeout_s=1.0, restart_backoff_s=(0.3, 0.3)))
    updates = context()
    for u in updates:
        client.write_context(u)
    b = batch(updates, (GREEDY, GREEDY, GREEDY))
    stalled = client.pid
    os.kill(stalled, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(DraftWorkerUnavailable, match="within 1 s"):
        client.propose(b)
    assert 1.0 <= time.monotonic() - start < 3.0 and gone(stalled)  # the stalled process was killed
    with pytest.raises(DraftWorkerUnavailable, match="restarting"):
        client.write_context(updates[0])
    time.sleep(0.5)  # the restart is under way now: close() must stop it too
    client.close()
    client.close()  # idempotent
    assert not client.available and (shm_files(), sockets(run_dir), live_children()) == baseline


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    from sgl_dspark.draft_worker.remote import ProcessDraftClient, WorkerSettings
    from sgl_dspark.drafter import DraftKnobs, TargetSpec
    drafter, target, run_dir = sys.argv[1:4]
    client = ProcessDraftClient(WorkerSettings(drafter, target, TargetSpec(32, 50, 6), DraftKnobs(), 64, run_dir))
    print(client.pid, client.requests.path, client.replies.path, flush=True)
    time.sleep(60)
""")


def test_worker_exits_and_cleans_up_when_its_parent_dies(folders, run_dir):
    drafter_path, target_path, _ = folders
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, drafter_path, target_path, run_dir],
                              stdout=subprocess.PIPE, text=True)
    try:
        worker, *arenas = parent.stdout.readline().split()
        assert all(os.path.exists(a) for a in arenas)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(int(worker))
    assert not any(os.path.exists(a) for a in arenas)
    assert not glob.glob(os.path.join(run_dir, f"dspark-draft-{parent.pid}-*"))


def test_worker_answers_errors_in_process(folders):
    """In-process: a request before Init and an Init that does not fit the target come back as one-line Errors."""
    drafter_path, target_path, spec = folders
    worker = Worker(channel=None, parent_pid=os.getppid())
    ref = TensorRef("/nonexistent", 0, (0,), "int64")
    assert "Init must come first" in worker.answer(Propose(ref, (), ref, ref, (), "/nonexistent")).message
    bad = Init(drafter_path, target_path, TargetSpec(64, 50, 6), KNOBS, NUM_SLOTS, SEED, "float32", 1, (),
               arena_prefix("/dev/shm"))
    error = worker.answer(bad)
    assert isinstance(error, Error) and "hidden_size" in error.message and "\n" not in error.message
    assert worker.answer(Ping()) == Pong(os.getpid()) and worker.answer(Shutdown()) == Ack() and not worker.running


def test_a_client_without_run_dir_makes_its_own_and_removes_it(folders, run_dir):
    client = ProcessDraftClient(settings(folders, None))
    made = client.run_dir
    assert os.path.basename(made).startswith("dspark-") and sockets(made)
    assert client.arena_bytes == client.requests.arena.size + client.replies.arena.size > 0
    client.close()
    assert not os.path.exists(made) and client.arena_bytes == 0
    given = ProcessDraftClient(settings(folders, run_dir))
    given.close()
    assert os.path.isdir(run_dir)  # the caller's directory is the caller's


def spoil_replies(monkeypatch, client, spoil):
    """Pass every Proposed reply of the client's current worker through `spoil(reply) -> reply`."""
    handle = client._handle
    real = handle.request

    def request(message, timeout_s, cancel=None):
        reply = real(message, timeout_s, cancel)
        return spoil(reply) if isinstance(reply, Proposed) else reply

    monkeypatch.setattr(handle, "request", request)


def test_a_garbled_reply_restarts_the_worker_and_bad_numbers_only_fail_the_step(written, monkeypatch):
    client, updates = written
    b = batch(updates, (WARM, GREEDY, TOPK))
    first = client.pid

    def out_of_vocab(reply):
        client.replies.view(reply.tokens)[0] = 10**6  # the drafter's vocabulary has 50 tokens
        return reply

    spoil_replies(monkeypatch, client, out_of_vocab)
    with pytest.raises(DraftReplyInvalid, match=r"token ids outside \[0, 50\)") as caught:
        client.propose(b)
    assert caught.value.cause == "invalid_reply" and not caught.value.garbled and client.pid == first
    monkeypatch.undo()
    spoil_replies(monkeypatch, client, lambda r: msgspec.structs.replace(r, sizes=r.sizes[1:]))
    with pytest.raises(DraftReplyInvalid, match="2 trees .* for 3 requests") as caught:
        client.propose(b)
    assert caught.value.garbled and client.pid is None  # a worker answering garbage is replaced
    wait_until_served(client, b)
    assert client.generation == 1 and client.pid != first


def test_a_full_shm_and_unexpected_errors_come_out_as_unavailable(folders, run_dir, monkeypatch):
    from sgl_dspark.draft_worker import shm

    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    client = ProcessDraftClient(settings(folders, run_dir))
    try:
        worker = client.pid
        monkeypatch.setattr(shm.os, "posix_fallocate", enospc)
        big = context(lengths=(40,))[0]  # more than the 4-token request arena: it must grow
        with pytest.raises(ShmFull) as caught:
            client.write_context(big)
        message = str(caught.value)
        assert caught.value.cause == "shm_full" and "\n" not in message
        assert "/dev/shm (size " in message and "MiB free" in message and "--shm-size" in message
        monkeypatch.undo()
        client.write_context(big)  # the worker kept serving: the next step finds room
        monkeypatch.setattr(client._handle.channel, "send", lambda *a: (_ for _ in ()).throw(ValueError("boom")))
        with pytest.raises(DraftWorkerUnavailable, match="ValueError: boom") as caught:
            client.propose(batch([big], (GREEDY,)))
        assert caught.value.cause == "error" and client.pid == worker
        monkeypatch.undo()
        assert len(client.propose(batch([big], (GREEDY,)))) == 1
    finally:
        client.close()
    made = set(glob.glob(os.path.join(tempfile.gettempdir(), "dspark-*")))
    monkeypatch.setattr(shm.os, "posix_fallocate", enospc)
    with pytest.raises(ShmFull):
        ProcessDraftClient(settings(folders, None))
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "dspark-*"))) == made  # its run dir went too


def test_after_a_restart_requests_draft_from_the_context_written_since(folders, written, one_thread):
    client, updates = written
    greedy = (GREEDY, GREEDY, GREEDY)
    b = batch(updates, greedy)
    drafted = sum(t.size - 1 for t in client.propose(b))
    assert client.worker_drafted == drafted > 0
    os.kill(client.pid, signal.SIGKILL)
    with pytest.raises(DraftWorkerUnavailable) as caught:
        client.propose(b)
    assert caught.value.cause == "dead"
    wait_until_served(client, b)
    assert client.generation == 1 and client.worker_drafted == 0
    # Request 0 decodes 3 tokens past its cached (pre-restart) prefix; request 2 is rewritten; 1 is untouched.
    suffix = ContextUpdate(torch.tensor([60, 61, 62]), torch.arange(5, 8), torch.randn(3, 64))
    client.write_context(suffix)
    client.write_context(updates[2])
    grown = DraftBatch((torch.cat([updates[0].slots, suffix.slots]), updates[1].slots, updates[2].slots),
                       torch.tensor([7, 11, 23]), torch.tensor([8, 3, 7]), greedy)
    trees = client.propose(grown)
    local = local_client(folders)
    local.write_context(suffix)
    local.write_context(updates[2])
    want = local.propose(DraftBatch((suffix.slots, updates[2].slots), torch.tensor([7, 23]), torch.tensor([8, 7]),
                                    greedy[:2]))
    assert_close_trees([trees[0], trees[2]], want)
    assert trees[1].size == 1 and client.stale_requests(grown) == [0, 1]
    assert client.worker_drafted == local.worker_drafted == sum(t.size - 1 for t in want)


def test_the_worker_maps_only_the_clients_arenas(folders, tmp_path):
    drafter_path, target_path, spec = folders
    requests = GrowingArena(str(tmp_path), 4096, "req")
    worker = Worker(channel=None, parent_pid=os.getppid())

    def init(arenas):
        return Init(drafter_path, target_path, spec, KNOBS, NUM_SLOTS, SEED, "float32", 1, arenas,
                    arena_prefix(str(tmp_path)))

    refused = worker.answer(init((requests.path, "/etc/passwd")))
    assert isinstance(refused, Error) and "outside" in refused.message and worker.engine is None
    assert isinstance(worker.answer(init((requests.path,))), Ready)
    u = context()[0]
    good = WriteContext(*requests.put_all([u.slots, u.positions, u.features]))
    assert worker.answer(good) == Ack()
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(4096))
    link = f"{arena_prefix(str(tmp_path))}evil"
    os.symlink(victim, link)
    for path in ("/etc/passwd", link, f"{tmp_path}/../{tmp_path.name}/{os.path.basename(requests.path)}"):
        bad = WriteContext(*(msgspec.structs.replace(r, arena=path) for r in (good.slots, good.positions,
                                                                                good.features)))
        assert isinstance(worker.answer(bad), Error)
        assert path not in worker.maps.maps and path not in worker.arenas
    propose = Propose(good.slots, (len(u.slots),), good.slots, good.slots, (GREEDY,), "/etc/passwd")
    assert "not an arena of this client" in worker.answer(propose).message
    worker.close()
    requests.close()


def test_the_local_client_counts_its_drafts_and_is_never_restarted(folders):
    local = local_client(folders)
    updates = context()
    for u in updates:
        local.write_context(u)
    trees = local.propose(batch(updates, (GREEDY, GREEDY, GREEDY)))
    assert local.worker_drafted == sum(t.size - 1 for t in trees) and local.generation == local.arena_bytes == 0


def test_the_guarded_in_process_client_drafts_as_the_engine_and_turns_its_faults_into_unavailable(folders):
    """In SGLang's process the engine runs behind GuardedDraftClient: the same drafts while it works; a context row
    it cannot store or a batch it cannot draft raises DraftWorkerUnavailable ("error", naming the fault), which the
    SGLang worker turns into a step without drafts, and the client keeps drafting afterwards."""
    plain, guarded = local_client(folders), GuardedDraftClient(local_client(folders))
    updates = context()
    for client in (plain, guarded):
        for u in updates:
            client.write_context(u)
    b = batch(updates, (GREEDY, GREEDY, GREEDY))
    assert_same_trees(guarded.propose(b), plain.propose(b))
    assert guarded.worker_drafted == plain.worker_drafted > 0 and guarded.generation == 0
    bad_width = ContextUpdate(updates[0].slots, torch.arange(5), torch.randn(5, 63))
    with pytest.raises(DraftWorkerUnavailable, match="in-process drafter: RuntimeError") as info:
        guarded.write_context(bad_width)
    assert info.value.cause == "error"
    out_of_range = DraftBatch((torch.tensor([NUM_SLOTS + 5]),), torch.tensor([7]), torch.tensor([1]), (GREEDY,))
    with pytest.raises(DraftWorkerUnavailable, match="in-process drafter: IndexError"):
        guarded.propose(out_of_range)
    assert_same_trees(guarded.propose(b), plain.propose(b))
