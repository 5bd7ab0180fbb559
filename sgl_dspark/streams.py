"""The random streams of a DSPARK server, all derived from SGLang's --random-seed here and nowhere else.

Lossless rejection sampling needs each drafted token to be independent of the coins that judge it, so no two
parties may read the same stream. SGLang seeds torch's default generator (its own sampler: prefill tokens,
plain decoding) with --random-seed itself; DSPARK's verifier (acceptance coins, residual and bonus draws) and its
drafter (draft tokens) each get a generator of their own, seeded with a hash of (role, --random-seed, start):
`start` counts the draft worker's starts, so a restarted worker process draws fresh words instead of replaying
its predecessor's. The seeds differ from each other and from --random-seed in the 32 bits torch's CPU
generator (mt19937) keeps. Seeded requests (`sampling_seed`) read none of these: their tokens are SGLang's
seeded Gumbel-max choices (sgl_dspark.seeded). Must not touch SGLang.
"""

import hashlib

import torch

VERIFY = "verify"
DRAFT = "draft"
ROLES = (VERIFY, DRAFT)
_SEED_BITS = 32  # torch's CPU generator seeds mt19937 with the low 32 bits of its seed


def stream_seed(random_seed: int, role: str, start: int = 0) -> int:
    """The seed of `role`'s generator in the `start`-th start of its process, from --random-seed.

    Distinct (in the low 32 bits) from --random-seed and from every other role's seed of the same start: a hash
    collision moves to the next salt. Example: stream_seed(0, "verify") != stream_seed(0, "draft") != 0."""
    if role not in ROLES:
        raise ValueError(f"stream_seed: unknown role {role!r} (one of {ROLES})")
    taken = {_low(int(random_seed))}
    for other in ROLES[:ROLES.index(role)]:
        taken.add(_low(stream_seed(random_seed, other, start)))
    salt = 0
    while _low(seed := _hash(random_seed, role, start, salt)) in taken:
        salt += 1
    return seed


def stream(random_seed: int, role: str, start: int = 0) -> torch.Generator:
    """A CPU generator seeded with stream_seed(random_seed, role, start)."""
    return torch.Generator().manual_seed(stream_seed(random_seed, role, start))


def _hash(random_seed: int, role: str, start: int, salt: int) -> int:
    text = f"sgl-dspark/{role}/{int(random_seed)}/{start}/{salt}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1  # < 2^63


def _low(seed: int) -> int:
    return seed & ((1 << _SEED_BITS) - 1)
