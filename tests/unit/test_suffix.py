"""The suffix cache (sgl_dspark.suffix): other requests' histories proposing chains, bounded, evicting the oldest, and
its chains in the lookup registry after the request's own."""

import random

import torch

from sgl_dspark.lookup import LookupKnobs
from sgl_dspark.suffix import REBUILD, SuffixCache, lookup_registry

KNOBS = LookupKnobs(max_ngram=3, width=2, max_len=4, probe=4)


def chains(cands):
    return [(c.tokens, c.match, c.rank) for c in cands]


def test_a_suffix_continues_where_it_last_occurred_in_another_history_longest_match_first():
    cache = SuffixCache(KNOBS, 100)
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([9, 2, 3, 7, 8])  # later: its (2, 3) is the latest one
    # (1, 2, 3) matches only the first history; (2, 3) then adds the second's continuation
    assert chains(cache.propose([0, 1, 2, 3], [], 0)) == [((4, 5, 6), 3, 0), ((7, 8), 2, 1)]
    assert all(c.shared for c in cache.propose([0, 1, 2, 3], [], 0))
    assert chains(cache.propose([5, 2, 3], [], 1)) == [((7, 8), 2, 1), ((4, 5, 6), 2, 2)]  # ranks count on


def test_one_token_matches_and_chains_already_taken_are_not_proposed():
    cache = SuffixCache(KNOBS, 100)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.propose([7, 3], [], 0) == []  # only the token 3 matches
    taken = cache.propose([1, 2, 3], [], 0)
    assert cache.propose([1, 2, 3], taken, 1) == []


def test_the_oldest_histories_leave_first_and_the_cache_stays_within_its_tokens():
    cache = SuffixCache(KNOBS, 12)
    cache.add([1, 2, 3, 4, 5])
    cache.add([6, 7, 8, 9, 10])
    assert chains(cache.propose([1, 2], [], 0)) == [((3, 4, 5), 2, 0)]
    cache.add([11, 12, 13, 14, 15])  # 15 tokens > 12: the first history goes
    assert cache.tokens == 10 and len(cache) == 2
    assert cache.propose([1, 2], [], 0) == []
    cache.add(list(range(100, 130)))  # longer than the cap: its last 12 tokens stay, alone
    assert cache.tokens == 12 and len(cache) == 1
    assert chains(cache.propose([118, 119], [], 0)) == [((120, 121, 122, 123), 2, 0)]
    assert cache.propose([100, 101], [], 0) == []


def test_after_many_evictions_it_proposes_what_a_cache_of_the_kept_histories_would():
    rng = random.Random(5)
    cache = SuffixCache(KNOBS, 60)
    for _ in range(200):
        cache.add([rng.randrange(6) for _ in range(rng.randrange(1, 25))])
        assert cache.tokens <= 60
    fresh = SuffixCache(KNOBS, 60)
    for doc in cache.docs.values():
        fresh.add(doc)
    assert cache.entries <= REBUILD * len(cache.sizes) * cache.tokens  # the index was rebuilt: bounded by what is kept
    for _ in range(100):
        history = [rng.randrange(6) for _ in range(4)]
        assert chains(cache.propose(history, [], 0)) == chains(fresh.propose(history, [], 0))


def test_a_request_leaving_the_batch_lends_its_history_to_the_others_after_their_own_chains():
    registry = lookup_registry(KNOBS, 100)
    registry.sync("a", [1, 2, 3, 4, 5], [6, 7])
    registry.retain(["b"])  # "a" finished: its history joins the cache
    assert "a" not in registry.entries and registry.suffix.tokens == 7
    registry.sync("b", [9, 9, 8, 9], [4, 5])  # ends in (4, 5), which "a" continued with (6, 7)
    own, shared = [c for c in registry.propose("b") if not c.shared], [c for c in registry.propose("b") if c.shared]
    assert [c.tokens for c in shared] == [(6, 7)] and shared[0].match == 2 and shared[0].rank == len(own)
    group = KNOBS.group(shared[0].rank, shared[0].match, shared[0].shared)
    assert 2 * len(KNOBS.sizes) <= group < KNOBS.groups  # its own statistics group
    assert registry.propose("b")[:len(own)] == own
    off = lookup_registry(KNOBS, 0)
    off.sync("a", [1, 2, 3, 4, 5], [6, 7])
    off.retain([])
    off.sync("b", [9, 9, 8, 9], [4, 5])
    assert off.suffix is None and not any(c.shared for c in off.propose("b"))


def test_lookup_statistics_keep_the_suffix_caches_chains_apart():
    registry = lookup_registry(KNOBS, 100)
    stats = registry.sync("b", [1], [2]).stats
    assert stats.accepts.shape == (3 * len(KNOBS.sizes), KNOBS.max_len)
    assert torch.equal(stats.mean(), torch.full_like(stats.mean(), KNOBS.prior_accept))
