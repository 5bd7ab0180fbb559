"""Integration fixtures: real SGLang servers on this machine, started once per session and always stopped."""

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sgl_dspark.tools.launch import ServerSpec, free_port, serving

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.json"
# Modules whose servers keep both of CI's cores busy (two ranks, two replicas, two servers): run last, once
# `make test`'s unit tests, which run beside the integration tests, have finished.
BOTH_CORES = ("test_data_parallel.py", "test_multi_node.py", "test_router.py", "test_tensor_parallel.py")


def pytest_collection_modifyitems(config, items):
    """The BOTH_CORES modules moved to the end, whole and in their order (a stable sort)."""
    items.sort(key=lambda item: item.path.name in BOTH_CORES)


@pytest.fixture(scope="session")
def plain_server(default_model_path, tmp_path_factory):
    """The default model, float32, no speculation."""
    spec = ServerSpec(default_model_path, port=free_port())
    with serving(spec, tmp_path_factory.mktemp("plain")) as server:
        yield server


@pytest.fixture(scope="module")
def plain_sync_server(default_model_path, tmp_path_factory):
    """Plain SGLang without overlap scheduling, custom logit processors enabled: the reference for penalised requests
    (with overlap, SGLang's penalizers count each output token one decode step late, and the prompt's last token
    on the first step; DSPARK counts the output so far, as this server does). One per module that uses it."""
    spec = ServerSpec(default_model_path, port=free_port(),
                      extra_args=("--disable-overlap-schedule", "--enable-custom-logit-processor"))
    with serving(spec, tmp_path_factory.mktemp("plain-sync")) as server:
        yield server


@pytest.fixture(scope="session")
def random_drafter_path(default_model_path, tmp_path_factory) -> str:
    """A seeded random DSpark drafter shaped for the default model (enough to test losslessness); one layer and a
    4096-token draft vocabulary keep CPU drafting cheap (and exercise the reduced-vocabulary path)."""
    from sgl_dspark.drafter.fresh import save_random_drafter_for

    return save_random_drafter_for(default_model_path, str(tmp_path_factory.mktemp("drafter")), seed=0,
                                   num_layers=1, draft_vocab_size=4096)


def dspark_spec(model_path: str, drafter_path: str, *flags: str, max_running_requests: int = 4,
                gate: bool = False, draft_process: bool | None = None) -> ServerSpec:
    """A DSPARK server. The gate (which requests draft each step, from measured step costs) is off unless asked for
    (explicitly, whatever the default): tests of the verify path need every request to draft every step, whatever
    the machine's timings; the gate's own tests (test_dspark_gate.py) turn it on. `draft_process`: the drafter in
    a worker process (true) or in SGLang's (false); None leaves the default, which most tests exercise."""
    where = () if draft_process is None else ("--speculative-dspark-draft-process", str(draft_process).lower())
    return ServerSpec(model_path, port=free_port(), max_running_requests=max_running_requests,
                      speculative_args=("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                                        drafter_path, "--speculative-dspark-gate", "true" if gate else "false",
                                        *where, *flags))


@pytest.fixture(scope="module")
def dspark_server(default_model_path, random_drafter_path, tmp_path_factory):
    """DSPARK with the random drafter, chain drafting, default preset. Module-scoped: a server holds ~4 GB, and the
    session-wide ones (plain, chain) plus a module's own must fit CI's 24 GB."""
    with serving(dspark_spec(default_model_path, random_drafter_path), tmp_path_factory.mktemp("dspark")) as server:
        yield server


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def prompts(default_model_path) -> list[str]:
    """20 prompts: 10 chat prompts sharing one long system prompt (radix-cache hits) and 10 raw/code prompts."""
    from transformers import AutoTokenizer

    doc = json.loads(PROMPTS_FILE.read_text())
    tok = AutoTokenizer.from_pretrained(default_model_path)
    chats = [tok.apply_chat_template([{"role": "system", "content": doc["system"]}, {"role": "user", "content": q}],
                                     tokenize=False, add_generation_prompt=True) for q in doc["chat_questions"]]
    return chats + doc["raw_prompts"]


def generate(base_url: str, text: str, **sampling) -> dict:
    reply = requests.post(f"{base_url}/generate", json={"text": text, "sampling_params": sampling}, timeout=600)
    reply.raise_for_status()
    return reply.json()


# --- shared by the DSPARK losslessness and API tests (tests/integration/test_dspark_{lossless,apis}.py) ---------

GREEDY_128 = {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}
# Its greedy continuation seeds the bigram drafter (its first transitions override the counted ones).
SAMPLING_PROMPT = "Pick a random number between 1 and 100:"


def generate_all(base_url: str, texts: list[str], concurrency: int, **sampling) -> list[dict]:
    """One /generate request per text, `concurrency` in flight at a time; replies in the order of `texts`."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda text: generate(base_url, text, **sampling), texts))


def warm_prefix_cache(base_url: str, prompts: list[str]) -> None:
    """Prefill the first (chat) prompt once, so the chat prompts' shared system prompt is in the radix cache."""
    generate(base_url, prompts[0], temperature=0, max_new_tokens=1)


@pytest.fixture(scope="session")
def plain_reference(plain_server, prompts) -> list[list[int]]:
    """The plain server's greedy output_ids on the 20 prompts x 128 tokens, computed once per session at
    concurrency 4 (greedy float32 output does not depend on the batch; test_dspark_lossless checks that)."""
    warm_prefix_cache(plain_server.base_url, prompts)
    return [r["output_ids"] for r in generate_all(plain_server.base_url, prompts, 4, **GREEDY_128)]


@pytest.fixture(scope="session")
def bigram_drafter_path(default_model_path, plain_server, plain_reference, tmp_path_factory) -> str:
    """A drafter whose drafts are often right, so DSPARK accepts multi-token blocks on CPU: the random drafter
    with its Markov head set to a bigram table (successor of each token) of the plain server's own greedy outputs.
    About a third of its drafts are accepted (accepted length ~2): both the acceptance and the rejection paths run,
    and decoding is faster than plain. The random drafter leaves acceptance ~0 (rejection path only, 2.5x slower)."""
    sampled = generate(plain_server.base_url, SAMPLING_PROMPT, temperature=0, max_new_tokens=8)["output_ids"]
    out = tmp_path_factory.mktemp("bigram-drafter")
    return save_bigram_drafter(default_model_path, str(out), plain_reference, priority=sampled)


@pytest.fixture(scope="session")
def chain_server(default_model_path, bigram_drafter_path, tmp_path_factory):
    """DSPARK's default preset (chain drafting) with the bigram drafter (multi-token blocks are accepted). Every
    request verifies at least one draft a step (min-verify 1): left to itself, the prefix budget verifies none
    where the machine's step costs say a draft does not pay (CI saw a whole max_tokens-2 batch verify nothing), and
    the tests on this server are about what verified blocks do (cut at stops, caps and EOS, logprobs, seeds)."""
    spec = dspark_spec(default_model_path, bigram_drafter_path, "--speculative-dspark-min-verify", "1")
    with serving(spec, tmp_path_factory.mktemp("dspark-chain")) as server:
        yield server


# Markov bias of a token's table successor over the other 4095 draft ids (the backbone's logits are zeroed): a
# first-choice draft probability ~0.98 (greedy alternatives' temperature 1), not float32-certain, since a gap over
# ~16 nats makes sgl_dspark.drafter.sampler.alternatives divide by 1 - p = 0 (confidences > 1 kill the scheduler).
BIGRAM_LOGIT = 12.0
SECOND_SHARE = 0.95  # the runner-up successor's bias relative to the first (a tree's first alternative)
MAX_SUCCESSORS = 512  # Markov rank budget: the most frequent successors get a slot


def bigram_successors(sequences: list[list[int]]) -> dict[int, list[int]]:
    """token -> its most frequent successor in `sequences` (ties: first seen), followed by the runner-up when that
    is at least half as frequent (the token is ambiguous)."""
    counts: dict[int, Counter] = {}
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:]):
            counts.setdefault(prev, Counter())[nxt] += 1
    table = {}
    for prev, c in counts.items():
        top = c.most_common(2)
        table[prev] = [t for t, n in top if 2 * n >= top[0][1]]
    return table


def save_bigram_drafter(target_dir: str, out_dir: str, sequences: list[list[int]], priority: list[int],
                        seed: int = 0) -> str:
    """The seeded random drafter (one layer, 4096-token draft vocabulary) with its backbone silenced and a bigram
    Markov head: rank slot 0 marks an ambiguous token (two successors; low confidence, so the tree branches there),
    slot j > 0 carries successor j. The transitions of `priority` (the first from each token) override the counted
    ones. Confidence is high after a token with one known successor, low after an ambiguous or unknown one.
    Returns out_dir."""
    import torch

    from sgl_dspark.drafter.checkpoint import save_drafter
    from sgl_dspark.drafter.fresh import hf_config_for_target, random_drafter

    table = bigram_successors(sequences)
    for prev, nxt in reversed(list(zip(priority, priority[1:]))):  # the first transition from a token wins
        table[prev] = [nxt]
    ranked = Counter(s for succ in table.values() for s in succ).most_common(MAX_SUCCESSORS)
    slot = {token: j + 1 for j, (token, _) in enumerate(ranked)}
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = hf_config_for_target(target, num_layers=1, markov_rank=1 + len(slot), draft_vocab_size=4096)
    drafter, _ = random_drafter(config, seed)
    vocab = list(slot) + [t for t in drafter.draft_to_target.tolist() if t not in slot]
    drafter.set_draft_vocab(torch.tensor(sorted(vocab[:4096])))
    draft_id = {t: d for d, t in enumerate(drafter.draft_to_target.tolist())}
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight  # [V, r], [D, r]
    conf = drafter.confidence_head.proj  # logit = w . [h ; W1[prev]] + b
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        drafter.norm.weight.zero_()  # backbone hidden -> 0: the drafter's logits are the bigram bias alone
        w1.zero_()
        w2.zero_()
        conf.weight.zero_()
        conf.bias.fill_(-1.0)  # unknown token: c = 0.27
        conf.weight[0, hidden] = -10.0  # ambiguous token: c ~ 0.04
        conf.weight[0, hidden + 1:] = 4.0  # one known successor: c = 0.95
        for token, j in slot.items():
            w2[draft_id[token], j] = BIGRAM_LOGIT
        for prev, succ in table.items():
            for share, token in zip((1.0, SECOND_SHARE), succ):
                if token in slot:
                    w1[prev, slot[token]] = share
            if len(succ) > 1:
                w1[prev, 0] = 1.0
    save_drafter(drafter, out_dir)
    return out_dir


# --- shared by the sampling tests (tests/integration/test_dspark_sampling.py) ---------------------------------

def draw(server, prompt: str, samples: int, sampling: dict, concurrency: int = 8) -> list[dict]:
    """`samples` sampled replies to the same prompt (radix-cached after the first), `concurrency` in flight."""
    replies = generate_all(server.base_url, [prompt] * samples, concurrency, **sampling)
    assert all(r["meta_info"]["completion_tokens"] == sampling["max_new_tokens"] for r in replies)
    return replies


def after_first(replies: list[dict]) -> list[tuple[int, ...]]:
    """The tokens after the first of each reply (the first comes from prefill, the rest from verification)."""
    return [tuple(r["output_ids"][1:]) for r in replies]


MIN_CELL = 10  # a category seen fewer times (both samples together) is merged into its prefix's


def categories(samples: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each distinct sample -> its category: itself if seen at least MIN_CELL times, else its longest prefix seen
    that often once the frequent longer ones are set aside; () pools what is left.

    Example (MIN_CELL 10): samples (1, 2) x 12, (1, 3) x 6, (1, 4) x 5, (2, 5) x 3 -> categories
    (1, 2) -> (1, 2); (1, 3), (1, 4) -> (1,); (2, 5) -> ()."""
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    pending = {k: (n, [k]) for k, n in Counter(samples).items()}  # category candidate -> (count, samples in it)
    while pending:
        shorter: dict[tuple[int, ...], tuple[int, list]] = {}
        for k, (n, members) in pending.items():
            if n >= MIN_CELL or not k:
                out.update((m, k) for m in members)
            else:
                total, merged = shorter.get(k[:-1], (0, []))
                shorter[k[:-1]] = (total + n, merged + members)
        pending = shorter
    return out


def contingency(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> list[list[int]]:
    """2 x K counts of a's and b's samples over their joint `categories`."""
    category = categories(a + b)
    ca, cb = Counter(category[s] for s in a), Counter(category[s] for s in b)
    keys = sorted(set(ca) | set(cb))
    return [[c[k] for k in keys] for c in (ca, cb)]
