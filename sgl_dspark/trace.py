"""Step trace: one JSONL record per request per decode step, for acceptance studies (benchmarks/acceptance.py).

Owns the record (what one verified step says about acceptance, confidence and the lookup's share), how it is
derived from a verified step (pure), and the append-only writer the worker uses when the `trace` knob is set.
Must not change what the worker does: it only reads the scheduled trees and their verify results.
"""

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_dspark.graft import Grafted, lookup_accepted
from sgl_dspark.verify import VerifyResult


@dataclass(frozen=True)
class StepTrace:
    rid: str  # SGLang request id (the `rid` a client may send with /generate)
    drafted: int  # draft nodes before scheduling (lookup nodes included)
    verified: int  # draft nodes the target verified (root excluded)
    tau: int  # tokens committed by the step, bonus included
    reached: int  # deepest position tried on the accepted path: tau - 1, plus 1 when a child of its end was verified
    chain_conf: list[float]  # [L] confidences of the verified main-chain positions 1..L, as the verify budget saw them
    chain_accepted: int  # leading main-chain positions accepted (<= L)
    lookup_accepted: int  # accepted tokens only the lookup proposed


def main_chain(g: Grafted) -> list[int]:
    """Node indices of the drafter's main chain below the root: from the root, each node's first drafter child.
    Example: parents [-1, 0, 1, 0, 2], neural [T, T, T, T, F] -> [1, 2] (node 3 is a side branch, 4 a lookup node)."""
    parents, neural = g.tree.parents.tolist(), g.neural.tolist()
    first: dict[int, int] = {}
    for v in range(g.tree.size - 1, 0, -1):
        if neural[v]:
            first[parents[v]] = v
    chain, node = [], 0
    while node in first:
        node = first[node]
        chain.append(node)
    return chain


def leading_matches(chain: Sequence[int], path: Sequence[int]) -> int:
    """How many leading nodes the accepted path shares with the chain. Example: [1, 2, 3], [1, 2, 5] -> 2."""
    n = 0
    for a, b in zip(chain, path):
        if a != b:
            break
        n += 1
    return n


def reached_depth(g: Grafted, result: VerifyResult) -> int:
    """tau - 1, plus one when the last accepted node has a verified child (a rejection happened below it)."""
    has_child = bool((g.tree.parents == result.last_node).any())
    return result.tau - 1 + int(has_child)


def step_trace(rid: str, g: Grafted, drafted: int, result: VerifyResult) -> StepTrace:
    """The record of one request's verified step; g is the scheduled (verified) block."""
    chain = main_chain(g)
    conf = g.tree.confidence[torch.tensor(chain, dtype=torch.long)].tolist() if chain else []
    return StepTrace(rid, drafted, g.tree.size - 1, result.tau, reached_depth(g, result), conf,
                     leading_matches(chain, result.accepted_nodes.tolist()), lookup_accepted(g, result))


class TraceWriter:
    """Appends records to a JSONL file, flushed every step so a finished request's records are readable at once."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)

    def write(self, records: Sequence[StepTrace]) -> None:
        self.file.write("".join(json.dumps(asdict(r)) + "\n" for r in records))
        self.file.flush()


def read_trace(path: str | Path) -> list[StepTrace]:
    """Every record of a trace file (a missing file reads as none)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [StepTrace(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
