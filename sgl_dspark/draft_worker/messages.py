"""Wire messages between the draft client and the draft-worker process: frozen msgspec Structs in one tagged union.

Requests: Init, WriteContext, Propose, Ping, Shutdown. Replies: Ready, Ack, Proposed, Pong, Error.
Tensors never travel inside a message: a `TensorRef` names a region of a shared-memory arena (`shm.py`).
Must not pickle anything or know how messages are transported.
"""

import msgspec

from sgl_dspark.drafter.config import TargetSpec
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.sampling import SamplingParams


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """A tensor stored in a shared-memory arena file."""

    arena: str  # path of the arena file
    offset: int  # bytes from the start of the file
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"


class _Message(msgspec.Struct, frozen=True, tag=True):
    pass


class Init(_Message):
    """First request: what to load and which client-owned arenas to map."""

    drafter_path: str  # drafter checkpoint folder (config.json + *.safetensors)
    target_path: str  # target HF folder holding model.embed_tokens.weight (and lm_head.weight unless tied)
    target: TargetSpec
    knobs: DraftKnobs
    num_slots: int  # target KV slots; the context store keeps one row per slot
    seed: int  # the drafter's stream seed (sgl_dspark.streams), as LocalDraftClient(seed=...)
    dtype: str  # drafter dtype, e.g. "float32"
    torch_threads: int
    arenas: tuple[str, ...]  # request and reply arena paths (unlinked by the worker only if orphaned)
    arena_prefix: str  # every arena path the client names starts with this (shm.arena_prefix); others are refused
    gemm: str = "native"  # "onednn": the drafter's linear layers on packed weights (sgl_dspark.packed_gemm)


class Ready(_Message):
    pid: int
    max_tree_size: int  # nodes per request tree, anchor included (bounds a Proposed reply)
    probs_width: int  # columns of a draft_probs row (the target vocabulary)


class WriteContext(_Message):
    slots: TensorRef  # [T] int64
    positions: TensorRef  # [T] int64
    features: TensorRef  # [T, n_target_layers * hidden]
    restart: tuple[str, ...] = ()  # request ids whose context starts over (ContextUpdate.restart)


class Propose(_Message):
    context_slots: TensorRef  # [sum L_i] int64: every request's context slots, concatenated in batch order
    context_lengths: tuple[int, ...]  # [B]: L_i
    anchors: TensorRef  # [B] int64
    anchor_positions: TensorRef  # [B] int64
    sampling: tuple[SamplingParams, ...]  # [B]
    reply_arena: str  # arena the worker writes the Proposed tensors into (a new path once it grew)
    ahead: bool = False  # answer Ack at once, then draft; the next Propose reuses those trees where keys match
    rids: tuple[str, ...] = ()  # [B] request ids (or empty): the worker keeps each request's context rows in a
    # buffer of its own and copies only new rows (DraftBatch.rids)


class Proposed(_Message):
    """One tree per request, concatenated: request i owns the next sizes[i] nodes."""

    sizes: tuple[int, ...]  # [B] nodes per tree, anchor included
    has_probs: tuple[bool, ...]  # [B] whether the tree carries draft_probs (sampled requests)
    tokens: TensorRef  # [N] int64
    parents: TensorRef  # [N] int64
    confidence: TensorRef  # [N] float32
    draft_probs: TensorRef | None  # [sum of sizes[i] where has_probs[i], V] float32
    ahead: int = 0  # trees that were drafted ahead (while the caller worked)
    drafted_total: int = 0  # draft nodes (anchors excluded) this worker produced since it started
    rows_copied_total: int = 0  # context rows this worker copied out of its slot store since it started


class Ping(_Message):
    pass


class Pong(_Message):
    pid: int


class Ack(_Message):
    """Reply to WriteContext, Shutdown and Propose(ahead=True)."""


class Shutdown(_Message):
    pass


class Error(_Message):
    message: str  # the worker-side exception, one line


Message = Init | Ready | WriteContext | Propose | Proposed | Ping | Pong | Ack | Shutdown | Error

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on bytes that are not one valid message."""
    return _DECODER.decode(data)
