"""Suffix cache: the token histories (prompt and output) of requests that have left the batch, shared by every
request of the server, and the chains they propose for a request's current suffix.

Owns the bounded store of histories (the oldest evicted first once over its token cap), the n-gram index over them and
the candidates it proposes. Pure Python on CPU; must not hold per-request state (sgl_dspark.lookup does), build trees
(sgl_dspark.graft), verify or import SGLang. What it proposes is only ever a draft: verification decides.
"""

from collections import OrderedDict
from collections.abc import Sequence

from sgl_dspark.lookup import Candidate, LookupKnobs, LookupRegistry

MIN_MATCH = 2  # shortest suffix matched across requests (a one-token match in other requests' text is mostly noise)
REBUILD = 1.5  # the index is rebuilt once it holds this many times the occurrences of what is kept
SHIFT = 32  # an occurrence is one int: history id << SHIFT | start of the continuation (histories are < 2**32 long)


class SuffixCache:
    """Histories in arrival order, at most `max_tokens` tokens in all (a longer history keeps its tail), and per
    suffix length n each n-gram's latest `probe` occurrences (history, start of the continuation), keyed by the
    n-gram's hash (a collision proposes a wrong chain, which verification rejects: never a wrong token)."""

    def __init__(self, knobs: LookupKnobs, max_tokens: int):
        self.knobs, self.max_tokens = knobs, max_tokens
        self.sizes = tuple(n for n in knobs.sizes if n >= MIN_MATCH)
        self.docs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # history id -> tokens, oldest first
        self.index: list[dict[int, list[int]]] = [{} for _ in self.sizes]
        self.tokens = 0  # tokens held
        self.entries = 0  # occurrences in the index (those of evicted histories too, until a rebuild)
        self.added = 0  # histories ever added (the next one's id)

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Store one history; evict the oldest ones while over the cap."""
        doc = tuple(int(t) for t in tokens[-self.max_tokens:]) if self.max_tokens else ()
        if len(doc) <= MIN_MATCH:
            return
        seq, self.added = self.added, self.added + 1
        self.docs[seq] = doc
        self.tokens += len(doc)
        self._index(seq, doc)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self.docs.popitem(last=False)[1])
        if self.entries > REBUILD * len(self.sizes) * max(self.tokens, 1):  # many evicted histories: start afresh
            self._rebuild()

    def propose(self, history: Sequence[int], taken: Sequence[Candidate], rank: int) -> list[Candidate]:
        """Up to `width` chains continuing `history`'s suffix elsewhere (longest match first, latest history first),
        none equal to a chain in `taken`; ranks count on from `rank`. A chain stops at its history's end."""
        out: list[Candidate] = []
        seen = {c.tokens for c in taken}
        for i, n in enumerate(self.sizes):
            if len(history) < n:
                continue
            for occurrence in reversed(self.index[i].get(hash(tuple(history[len(history) - n:])), ())):
                if len(out) == self.knobs.width:
                    return out
                doc, start = self.docs.get(occurrence >> SHIFT), occurrence & ((1 << SHIFT) - 1)
                chain = () if doc is None else doc[start:start + self.knobs.max_len]
                if chain and chain not in seen:
                    seen.add(chain)
                    out.append(Candidate(chain, n, rank + len(out), shared=True))
        return out

    def _index(self, seq: int, doc: tuple[int, ...]) -> None:
        for i, n in enumerate(self.sizes):
            index = self.index[i]
            for start in range(n, len(doc)):  # the n-gram before `start` continues at `start`
                seen = index.setdefault(hash(doc[start - n:start]), [])
                seen.append(seq << SHIFT | start)
                self.entries += 1
                if len(seen) > self.knobs.probe:
                    del seen[0]
                    self.entries -= 1

    def _rebuild(self) -> None:
        self.index, self.entries = [{} for _ in self.sizes], 0
        for seq, doc in self.docs.items():
            self._index(seq, doc)


def lookup_registry(knobs: LookupKnobs, suffix_tokens: int) -> LookupRegistry:
    """The server's lookup state: per request, and the suffix cache of `suffix_tokens` tokens (0: none)."""
    return LookupRegistry(knobs, SuffixCache(knobs, suffix_tokens) if suffix_tokens else None)
