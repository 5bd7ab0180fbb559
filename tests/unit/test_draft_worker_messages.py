"""The draft-worker wire: every message round-trips through msgpack, tensors round-trip through shared-memory
arenas (which grow under a new name and leave no file behind), and the ZMQ channel answers within its timeout."""

import os

import msgspec
import pytest
import torch

from sgl_dspark.draft_worker import messages as m
from sgl_dspark.draft_worker.shm import ALIGN, Arena, ArenaFull, ArenaMaps, GrowingArena, arena_prefix, footprint
from sgl_dspark.draft_worker.transport import Channel, ipc_address
from sgl_dspark.drafter import DraftKnobs, TargetSpec
from sgl_dspark.sampling import SamplingParams

REF = m.TensorRef("/dev/shm/sgl_dspark_1_req_ab", 128, (3, 4), "float32")

ALL_MESSAGES = [
    m.Init("/d", "/t", TargetSpec(32, 50, 6), DraftKnobs(tree_width=2, confidence_temperatures=(1.5, 2.0)),
           64, 7, "bfloat16", 1, ("/dev/shm/sgl_dspark_1_a", "/dev/shm/sgl_dspark_1_b"), "/dev/shm/sgl_dspark_1_"),
    m.Ready(123, 9, 50),
    m.WriteContext(REF, REF, REF),
    m.WriteContext(REF, REF, REF, restart=("r1", "r2")),
    m.Propose(REF, (5, 0, 3), REF, REF, (SamplingParams(0.0), SamplingParams(0.8, top_k=10)), "/dev/shm/b"),
    m.Proposed((3, 1), (True, False), REF, REF, REF, REF, ahead=1, drafted_total=12),
    m.Proposed((2,), (False,), REF, REF, REF, None),
    m.Ping(), m.Pong(42), m.Ack(), m.Shutdown(), m.Error("ValueError: bad"),
]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=lambda x: type(x).__name__)
def test_every_message_round_trips(message):
    data = m.encode(message)
    assert isinstance(data, bytes)
    assert m.decode(data) == message


def test_decode_refuses_garbage_and_invalid_knobs():
    with pytest.raises(msgspec.DecodeError):
        m.decode(b"\xc1not msgpack")
    bad = msgspec.msgpack.encode({"type": "Init", "drafter_path": "/d", "target_path": "/t",
                                  "target": {"hidden_size": 1, "vocab_size": 2, "num_hidden_layers": 3},
                                  "knobs": {"tree_width": 0}, "num_slots": 1, "seed": 0, "dtype": "float32",
                                  "torch_threads": 1, "arenas": [], "arena_prefix": "/dev/shm/sgl_dspark_1_"})
    with pytest.raises(msgspec.ValidationError, match="tree_width"):
        m.decode(bad)


@pytest.mark.parametrize("tensor", [torch.arange(6).view(2, 3), torch.randn(3, 5), torch.randn(4, 2).bfloat16(),
                                    torch.tensor([True, False]), torch.zeros(0, 7), torch.randn(5, 4).T])
def test_arena_round_trip(tmp_path, tensor):
    arena = Arena.create(str(tmp_path), 4096, "t")
    first, ref = arena.put(torch.ones(3)), arena.put(tensor)
    assert ref.offset % ALIGN == 0 and ref.offset >= first.offset + 12
    reader = ArenaMaps(arena_prefix(str(tmp_path)))
    assert torch.equal(reader.view(ref), tensor) and reader.view(ref).dtype == tensor.dtype
    reader.close()
    arena.close()
    assert list(tmp_path.iterdir()) == []


def test_arena_refuses_what_does_not_fit(tmp_path):
    arena = Arena.create(str(tmp_path), 128, "t")
    arena.put(torch.zeros(16))  # 64 bytes
    with pytest.raises(ArenaFull):
        arena.put(torch.zeros(32))  # 128 bytes
    arena.close()


def test_growing_arena_announces_a_new_file_and_cleans_up(tmp_path):
    grow = GrowingArena(str(tmp_path), 256, "req")
    small = grow.put_all([torch.ones(8)])
    reader = ArenaMaps(arena_prefix(str(tmp_path)))
    assert torch.equal(reader.view(small[0]), torch.ones(8))
    big = [torch.arange(100), torch.randn(10, 10)]
    refs = grow.put_all(big)
    assert footprint(big) > 256 and refs[0].arena != small[0].arena and refs[0].arena == grow.path
    assert not os.path.exists(small[0].arena)  # the old file is gone as soon as it is replaced
    assert all(torch.equal(reader.view(r), t) for r, t in zip(refs, big))
    assert list(reader.maps) == [grow.path]  # the reader dropped the unlinked mapping
    reader.close()
    grow.close()
    assert list(tmp_path.iterdir()) == []


def test_growing_arena_shrinks_back_after_a_run_of_small_steps(tmp_path):
    from sgl_dspark.draft_worker.shm import SHRINK_AFTER

    grow = GrowingArena(str(tmp_path), 256, "req")
    grow.put_all([torch.zeros(200)])  # 800 bytes: grows
    big = grow.arena.size
    assert big > 256
    for _ in range(SHRINK_AFTER - 1):
        grow.put_all([torch.zeros(8)])
    grow.put_all([torch.zeros(100)])  # a step that does not fit the initial size restarts the count
    for _ in range(SHRINK_AFTER - 1):
        grow.put_all([torch.zeros(8)])
    assert grow.arena.size == big
    refs = grow.put_all([torch.ones(8)])
    assert grow.arena.size == 256 and refs[0].arena == grow.path
    assert len(list(tmp_path.iterdir())) == 1  # the grown file is gone
    grow.close()


def test_channel_request_reply_and_timeout(tmp_path):
    address = ipc_address(tmp_path, "t")
    client, server = Channel.client(address), Channel.server(address)
    assert server.recv(0.05) is None
    client.send(m.Ping(), 1.0)
    assert server.recv(2.0) == m.Ping()
    server.send(m.Pong(7), 1.0)
    assert client.recv(2.0) == m.Pong(7)
    server.close()
    client.close()
    assert not (tmp_path / "t.sock").exists()


def test_ipc_address_refuses_a_path_too_long(tmp_path):
    with pytest.raises(ValueError, match="107"):
        ipc_address(tmp_path / ("x" * 120), "draft")


def test_sweep_stale_removes_only_arenas_of_dead_processes(tmp_path):
    from sgl_dspark.draft_worker.shm import sweep_stale

    stale = tmp_path / f"sgl_dspark_{dead_pid()}_req_deadbeef"
    stale.write_bytes(b"x")
    live = Arena.create(str(tmp_path), 64, "rep")
    other = tmp_path / "unrelated_file"
    other.write_bytes(b"y")
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and other.exists() and (tmp_path / live.path.split("/")[-1]).exists()
    live.close()


def dead_pid() -> int:
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_sweep_stale_leaves_other_users_links_odd_names_and_unremovable_files(tmp_path, monkeypatch):
    from sgl_dspark.draft_worker import shm

    pid = dead_pid()
    ours = tmp_path / f"sgl_dspark_{pid}_req_0a"
    ours.write_bytes(b"x")
    link = tmp_path / f"sgl_dspark_{pid}_rep_0b"
    link.symlink_to(ours)
    odd = tmp_path / f"sgl_dspark_{pid}"  # no tag: not an arena name
    odd.write_bytes(b"x")
    real_uid = os.getuid()
    monkeypatch.setattr(shm.os, "getuid", lambda: real_uid + 1)  # every file now belongs to someone else
    assert shm.sweep_stale(str(tmp_path)) == [] and ours.exists()
    monkeypatch.setattr(shm.os, "getuid", lambda: real_uid)

    def refuse(path):
        raise PermissionError(13, "Operation not permitted", str(path))

    monkeypatch.setattr(shm.os, "unlink", refuse)
    assert shm.sweep_stale(str(tmp_path)) == [] and ours.exists()  # skipped, not raised
    monkeypatch.undo()
    assert shm.sweep_stale(str(tmp_path)) == [str(ours)]
    assert link.is_symlink() and odd.exists()  # a link is never followed nor removed; odd names are left
    assert shm.sweep_stale(str(tmp_path / "missing")) == []


def test_arena_maps_open_only_the_clients_arena_files(tmp_path):
    arena = Arena.create(str(tmp_path), 256, "req")
    ref = arena.put(torch.arange(4))
    reader = ArenaMaps(arena_prefix(str(tmp_path)))
    assert torch.equal(reader.view(ref), torch.arange(4))
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 256)
    link = tmp_path / f"{os.path.basename(arena_prefix(str(tmp_path)))}evil"
    link.symlink_to(victim)
    sneaky = f"{tmp_path}/../{tmp_path.name}/{os.path.basename(arena.path)}"
    for path, says in (("/etc/passwd", "not an arena of this client"), (sneaky, "not an arena of this client"),
                       (str(tmp_path / "sgl_dspark_1_req_x"), "not an arena of this client")):
        with pytest.raises(ValueError, match=says):
            reader.get(path)
    with pytest.raises(OSError):  # named like ours, but a symlink: O_NOFOLLOW refuses it
        reader.get(str(link))
    assert list(reader.maps) == [arena.path]
    with pytest.raises(ValueError, match="sgl_dspark_"):
        ArenaMaps("/etc/")
    reader.close()
    arena.close()


def test_a_reference_outside_its_arena_is_refused(tmp_path):
    arena = Arena.create(str(tmp_path), 128, "t")
    ref = arena.put(torch.zeros(4))
    for bad in (m.TensorRef(ref.arena, 120, (4,), "float32"), m.TensorRef(ref.arena, -8, (2,), "float32"),
                m.TensorRef(ref.arena, 0, (-1, -1), "float32"), m.TensorRef(ref.arena, 0, (2,), "complex64")):
        with pytest.raises(ValueError, match="outside|not supported"):
            arena.view(bad)
    arena.close()
