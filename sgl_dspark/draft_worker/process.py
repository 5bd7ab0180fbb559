"""The draft-worker process: `python -m sgl_dspark.draft_worker.process --address ipc://... --parent-pid N`.

A fresh interpreter (it inherits nothing of SGLang) that takes Init, loads the drafter with the target's embedding and
LM head (`load_target_weights`), runs exactly the in-process engine (LocalDraftClient) and answers requests until
Shutdown, or until its parent dies (it then also removes the parent's arenas and socket file). It opens only the
client's arena files (named by Init's arena_prefix, regular files of this user): any other path is an Error reply.
Must not import SGLang.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import zmq
from safetensors import safe_open

from sgl_dspark.draft_worker.client import ContextUpdate, DraftBatch
from sgl_dspark.draft_worker.local import LocalDraftClient
from sgl_dspark.draft_worker.messages import (Ack, Error, Init, Message, Ping, Pong, Propose, Proposed, Ready,
                                              Shutdown, TensorRef, WriteContext)
from sgl_dspark.draft_worker.shm import DTYPES, Arena, ArenaMaps, unlink
from sgl_dspark.draft_worker.transport import Channel, ipc_path
from sgl_dspark.drafter import TargetWeights, load_drafter
from sgl_dspark.packed_gemm import pack_drafter
from sgl_dspark.tree import DraftTree

EMBED_WEIGHT = "model.embed_tokens.weight"
LM_HEAD_WEIGHT = "lm_head.weight"
PARENT_POLL_S = 0.5  # an idle worker notices a dead parent within this
REPLY_TIMEOUT_S = 5.0  # a reply the client no longer waits for is dropped after this


def load_target_weights(folder: str | Path, dtype: torch.dtype = torch.float32) -> TargetWeights:
    """The target's embedding and LM head from an HF safetensors folder; without lm_head.weight they are tied
    (the same tensor, as in SmolLM2)."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as st:
            names = set(st.keys())
            found |= {n: st.get_tensor(n).to(dtype) for n in (EMBED_WEIGHT, LM_HEAD_WEIGHT) if n in names}
    if EMBED_WEIGHT not in found:
        raise ValueError(f"target weights: no {EMBED_WEIGHT} in {folder}/*.safetensors")
    embed = found[EMBED_WEIGHT]
    return TargetWeights(embed, found.get(LM_HEAD_WEIGHT, embed))


def load_engine(init: Init) -> LocalDraftClient:
    dtype = DTYPES[init.dtype]
    weights = load_target_weights(init.target_path, dtype)
    drafter = load_drafter(init.drafter_path, init.target, weights, dtype)
    if init.gemm == "onednn":
        pack_drafter(drafter)
    return LocalDraftClient(drafter, init.knobs, init.num_slots, init.seed)


class Worker:
    """Answers one channel's requests with the engine built at Init."""

    def __init__(self, channel: Channel, parent_pid: int) -> None:
        self.channel, self.parent_pid = channel, parent_pid
        self.maps: ArenaMaps | None = None  # the client's arenas, by the prefix Init names
        self.arenas: set[str] = set()  # client arena paths mapped; unlinked here only if the client dies
        self.engine: LocalDraftClient | None = None
        self.ahead: DraftBatch | None = None  # drafted right after the reply (Propose with ahead=True)
        self.drafted: dict[tuple, DraftTree] = {}  # request key (DraftBatch.key) -> tree drafted ahead
        self.running = True
        self.handlers = {Init: self.init, WriteContext: self.write, Propose: self.propose, Ping: self.ping,
                         Shutdown: self.shutdown}

    def serve(self) -> int:
        """0 after Shutdown; 1 when the parent died."""
        while self.running:
            if os.getppid() != self.parent_pid:
                self.orphaned()
                return 1
            message = self.channel.recv(PARENT_POLL_S)
            if message is not None:
                try:
                    self.channel.send(self.answer(message), REPLY_TIMEOUT_S)
                except zmq.Again:  # the client gave up on us and will start a successor
                    return 1
                self.draft_ahead()
        return 0

    def answer(self, message: Message) -> Message:
        handler = self.handlers.get(type(message))
        if handler is None:
            return Error(f"unexpected message {type(message).__name__}")
        if self.engine is None and handler in (self.write, self.propose):
            return Error("not initialised: Init must come first")
        try:
            return handler(message)
        except Exception as exc:  # reported to the client, which decides; the worker keeps serving
            return Error(f"{type(exc).__name__}: {exc}".replace("\n", " "))

    def init(self, message: Init) -> Ready:
        maps = ArenaMaps(message.arena_prefix)
        refused = [p for p in message.arenas if not maps.allows(p)]
        if refused:
            raise ValueError(f"Init names arenas outside {message.arena_prefix}*: {', '.join(refused)}")
        self.maps, self.arenas = maps, set(message.arenas)
        torch.set_num_threads(message.torch_threads)
        self.engine = load_engine(message)
        max_nodes = self.engine.proposer.knobs.max_nodes
        return Ready(os.getpid(), max_nodes + 1, self.engine.proposer.drafter.config.vocab_size)

    def arena(self, path: str) -> Arena:
        """The client's arena at `path`, mapped (only paths under Init's arena_prefix: ValueError for any other)."""
        arena = self.maps.get(path)
        self.arenas.add(path)
        return arena

    def view(self, ref: TensorRef) -> torch.Tensor:
        return self.arena(ref.arena).view(ref)

    def write(self, message: WriteContext) -> Ack:
        update = ContextUpdate(self.view(message.slots), self.view(message.positions), self.view(message.features),
                               message.restart)
        self.drafted.clear()  # the new rows may be context a draft made ahead has read
        self.engine.write_context(update)
        return Ack()

    def propose(self, message: Propose) -> Proposed | Ack:
        self.arena(message.reply_arena)  # a path that is not the client's is refused before any drafting
        slots = self.view(message.context_slots).split(list(message.context_lengths))
        batch = DraftBatch(tuple(slots), self.view(message.anchors), self.view(message.anchor_positions),
                           message.sampling, message.rids)
        if message.ahead:  # copies: the arena holds the client's next request by the time we draft
            self.ahead = DraftBatch(tuple(s.clone() for s in batch.context_slots), batch.anchors.clone(),
                                    batch.anchor_positions.clone(), batch.sampling, batch.rids)
            return Ack()
        drafted, self.drafted = self.drafted, {}
        if not drafted:  # nothing drafted ahead (the default): no keys to compare, no sub-batch to build
            return self.reply(self.engine.propose(batch), message.reply_arena)
        trees = [drafted.get(batch.key(i)) for i in range(len(batch.context_slots))]
        missing = [i for i, tree in enumerate(trees) if tree is None]
        if missing:
            for i, tree in zip(missing, self.engine.propose(batch.select(missing))):
                trees[i] = tree
        return self.reply(trees, message.reply_arena, ahead=len(trees) - len(missing))

    def draft_ahead(self) -> None:
        """After the reply to Propose(ahead=True): draft that batch while the client goes on."""
        batch, self.ahead = self.ahead, None
        if batch is None:
            return
        try:
            trees = self.engine.propose(batch)
        except Exception as exc:  # the next Propose drafts afresh and reports any error itself
            print(f"draft worker {os.getpid()}: drafting ahead failed: {exc}", file=sys.stderr)
            return
        self.drafted = {batch.key(i): tree for i, tree in enumerate(trees)}

    def reply(self, trees: list[DraftTree], path: str, ahead: int = 0) -> Proposed:
        """Trees -> concatenated tensors in the client's reply arena."""
        arena = self.arena(path)
        arena.reset()
        tokens, parents, confidence = (arena.put(torch.cat([getattr(t, f) for t in trees]))
                                       for f in ("tokens", "parents", "confidence"))
        probs = [t.draft_probs for t in trees if t.draft_probs is not None]
        return Proposed(tuple(t.size for t in trees), tuple(t.draft_probs is not None for t in trees), tokens,
                        parents, confidence, arena.put(torch.cat(probs)) if probs else None, ahead,
                        self.engine.worker_drafted, self.engine.rows_copied)

    def ping(self, message: Ping) -> Pong:
        return Pong(os.getpid())

    def shutdown(self, message: Shutdown) -> Ack:
        self.running = False
        return Ack()

    def orphaned(self) -> None:
        print(f"draft worker {os.getpid()}: parent {self.parent_pid} is gone; exiting", file=sys.stderr)
        for path in self.arenas:
            unlink(path)
        ipc_path(self.channel.address).unlink(missing_ok=True)  # the dead parent bound it and cannot remove it

    def close(self) -> None:
        if self.maps is not None:
            self.maps.close()


def launch_command(address: str, parent_pid: int) -> list[str]:
    """The command line that starts a worker for `address` (a fresh interpreter, same Python)."""
    return [sys.executable, "-m", "sgl_dspark.draft_worker.process", "--address", address,
            "--parent-pid", str(parent_pid)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dspark.draft_worker.process",
                                     description="DSpark draft-worker process (started by ProcessDraftClient)")
    parser.add_argument("--address", required=True, help="ipc:// address the client bound")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit once this process is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal Ctrl-C is the parent's to handle
    torch.set_num_threads(1)
    channel = Channel.server(args.address)
    worker = Worker(channel, args.parent_pid)
    try:
        return worker.serve()
    finally:
        worker.close()
        channel.close()


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # everything owned is closed in main; skip the interpreter teardown (torch's is slow)
