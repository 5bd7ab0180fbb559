"""Greedy identity benchmark: where DSPARK's greedy output parts from plain SGLang's, and why. Float32 greedy
decoding is the argmax of logits that depend on the GEMM and attention kernels in their last bits: plain SGLang
runs MKL (one row a request at concurrency 1, a wider product in a batch), DSPARK's verify forward runs oneDNN on
packed weights over the verify rows. Where two tokens' logits are nearly tied, either kernel can flip them.

Four ways of decoding the same prompts (greedy, real servers on the default model, float32), each against plain
one request at a time: plain again (is plain repeatable), plain four at a time (plain's own batch dependence),
DSPARK verifying no drafts (max-verify 0, lookup off: DSPARK's kernels, no speculation), DSPARK with the two flags a
user types, one at a time and four at a time. For each output that differs: the first differing token and plain's
gap there between its top two log probabilities (a logit gap). Prompts: first turns of mt-bench and HumanEval from
../shared/data/eval, raw (sent as text, no chat template, as a /generate user may) and in the chat template, and
any given with --prompt.

    python -m benchmarks.greedy_identity --out benchmarks/results/greedy-identity
"""

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import config_flags, eval_turns  # noqa: E402
from benchmarks.serving_report import first_difference  # noqa: E402
from sgl_dspark.tools.launch import ServerSpec, free_port, serving  # noqa: E402
from sgl_dspark.tools.models import SHIPPED_DRAFTER, prepare  # noqa: E402

DSPARK = config_flags("dspark", str(SHIPPED_DRAFTER))  # the two flags a user types
SERVERS = {"plain": (), "dspark-no-drafts": (*DSPARK, "--speculative-dspark-max-verify", "0",
                                             "--speculative-dspark-lookup", "false"), "dspark": DSPARK}
# run name -> (server, requests in flight), in the order they run (the radix cache flushed before each);
# "plain" (one at a time) is the reference of every other run
RUNS = {
    "plain": ("plain", 1),
    "plain-again": ("plain", 1),
    "plain-4": ("plain", 4),
    "dspark-no-drafts": ("dspark-no-drafts", 1),
    "dspark": ("dspark", 1),
    "dspark-4": ("dspark", 4),
}


@dataclass(frozen=True)
class Prompt:
    set: str  # e.g. "mt-bench-raw"
    text: str


@dataclass(frozen=True)
class Difference:
    run: str
    set: str
    prompt: int  # index into the prompt list
    at: int  # first differing token
    plain_gap: float | None  # plain's top-1 minus top-2 log probability there (None: not reported)
    second_choice: bool  # the run's token there is plain's second choice


def prompts(per_set: int, model_path: str, given: list[str]) -> list[Prompt]:
    """`per_set` first turns of each set, raw and in the chat template, then the `given` texts (raw)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = [Prompt("given", t) for t in given]
    for name in ("mt-bench", "humaneval"):
        turns = eval_turns(name)[:per_set]
        out += [Prompt(f"{name}-raw", t) for t in turns]
        out += [Prompt(f"{name}-chat", tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                               add_generation_prompt=True)) for t in turns]
    return out


def generate(base_url: str, text: str, tokens: int) -> dict:
    reply = requests.post(f"{base_url}/generate", timeout=900, json={
        "text": text, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}})
    reply.raise_for_status()
    return reply.json()


def decode(base_url: str, texts: list[str], tokens: int, concurrency: int) -> list[dict]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda t: generate(base_url, t, tokens), texts))


def top_two(reply: dict, at: int) -> tuple[float, int, int] | None:
    """Plain's (top-1 minus top-2 log probability, top-1 id, top-2 id) at output position `at`."""
    tops = reply["meta_info"].get("output_top_logprobs") or []
    if at >= len(tops) or len(tops[at]) < 2:
        return None
    (lp1, id1, *_), (lp2, id2, *_) = tops[at][:2]
    return lp1 - lp2, id1, id2


def differences(run: str, ps: list[Prompt], replies: list[dict], plain: list[dict]) -> list[Difference]:
    out = []
    for i, (p, got, want) in enumerate(zip(ps, replies, plain)):
        if got["output_ids"] == want["output_ids"]:
            continue
        at = first_difference(got["output_ids"], want["output_ids"])
        top = top_two(want, at)
        token = got["output_ids"][at] if at < len(got["output_ids"]) else None
        out.append(Difference(run, p.set, i, at, None if top is None else top[0],
                              top is not None and token == top[2]))
    return out


def render(ps: list[Prompt], found: list[Difference], runs: list[str]) -> str:
    per_set = Counter(p.set for p in ps)
    sets = sorted(per_set)
    head = ["| run | " + " | ".join(sets) + " | all | first differing tokens | plain's top-2 gap there |",
            "|---|" + "---:|" * (len(sets) + 3)]
    rows = []
    for run in runs:
        mine = [d for d in found if d.run == run]
        differing = Counter(d.set for d in mine)
        per = [f"{per_set[s] - differing[s]}/{per_set[s]}" for s in sets]
        gaps = [d.plain_gap for d in mine if d.plain_gap is not None]
        rows.append(f"| {run} | " + " | ".join(per) + f" | {len(ps) - len(mine)}/{len(ps)} | "
                    f"{', '.join(str(d.at) for d in mine) or '-'} | "
                    f"{f'median {statistics.median(gaps):.4f}, max {max(gaps):.4f}' if gaps else '-'} |")
    return "\n".join(["Greedy outputs identical to plain's (one request at a time), per prompt set:", "",
                      *head, *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/greedy-identity"),
                    help="writes OUT.md and OUT.json")
    ap.add_argument("--per-set", type=int, default=6, help="prompts from each of mt-bench and HumanEval")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="the servers' --dtype (auto: SGLang serves a float32 checkpoint "
                    "in float16, bfloat16 for Gemma)")
    ap.add_argument("--prompt", action="append", default=[], help="a raw prompt of your own (repeatable)")
    args = ap.parse_args(argv)
    model = str(prepare().path)
    ps = prompts(args.per_set, model, args.prompt)
    texts, replies = [p.text for p in ps], {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="greedy-identity-"))  # the servers' logs, kept for a look afterwards
    print(f"server logs in {logs}", flush=True)
    for name, flags in SERVERS.items():
        spec = ServerSpec(model, port=free_port(), dtype=args.dtype, speculative_args=flags)
        with serving(spec, logs) as server:
            for run in (r for r, (on, _) in RUNS.items() if on == name):
                requests.post(f"{server.base_url}/flush_cache", timeout=60).raise_for_status()
                replies[run] = decode(server.base_url, texts, args.output_len, RUNS[run][1])
                print(f"{run}: done", flush=True)
    runs = [r for r in RUNS if r != "plain"]
    found = [d for r in runs for d in differences(r, ps, replies[r], replies["plain"])]
    table = render(ps, found, runs)
    (args.out.with_suffix(".md")).write_text(table + "\n")
    (args.out.with_suffix(".json")).write_text(json.dumps({
        "settings": vars(args) | {"out": str(args.out)}, "prompts": [asdict(p) for p in ps],
        "outputs": {r: [x["output_ids"] for x in replies[r]] for r in RUNS},
        "differences": [asdict(d) for d in found]}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
