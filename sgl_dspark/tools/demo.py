"""`make demo`: the default model served by the real SGLang server, one chat prompt through each API.

Prepares the model, starts the server (CPU flags on a CPU host), asks `/generate` and
`/v1/chat/completions`, prints the answers and tokens/s, stops the server. Owns nothing else.
"""

import argparse
import sys
import time

import requests

from attention_backends import TORCH_BACKEND
from sgl_dspark.tools.launch import ServerError, ServerSpec, has_cuda, serving
from sgl_dspark.tools.models import PrepareError, default_drafter, prepare

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a one-line docstring."


def chat_text(model_path: str, prompt: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def ask_generate(base_url: str, text: str, max_new_tokens: int) -> tuple[str, dict, float]:
    start = time.perf_counter()
    reply = requests.post(f"{base_url}/generate", timeout=600, json={
        "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
    reply.raise_for_status()
    body = reply.json()
    return body["text"], body["meta_info"], time.perf_counter() - start


def ask_chat(base_url: str, prompt: str, max_new_tokens: int) -> tuple[str, int, float]:
    start = time.perf_counter()
    reply = requests.post(f"{base_url}/v1/chat/completions", timeout=600, json={
        "model": "default", "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": max_new_tokens})
    reply.raise_for_status()
    body = reply.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"], time.perf_counter() - start


SPEC_KEYS = ("spec_accept_length", "spec_verify_ct", "spec_mean_draft_length", "spec_mean_verify_length",
             "spec_accept_rate")


def spec_summary(meta: dict) -> str:
    keys = [k for k in SPEC_KEYS if k in meta]
    return ", ".join(f"{k}={meta[k]:.3g}" if isinstance(meta[k], float) else f"{k}={meta[k]}" for k in keys)


def speculative_flags(args: argparse.Namespace, model_path: str) -> tuple[str, ...]:
    if args.speculative_algorithm == "NONE":
        return ()
    flags = ["--speculative-algorithm", args.speculative_algorithm, *args.speculative_args]
    if args.speculative_algorithm == "DSPARK" and "--speculative-draft-model-path" not in flags:
        flags += ["--speculative-draft-model-path", default_drafter(model_path)]  # its recommended.json: lookup on
    if args.speculative_algorithm == "NGRAM" and not has_cuda() and "--attention-backend" not in flags:
        flags += ["--attention-backend", TORCH_BACKEND]  # SGLang's torch_native cannot verify; ours can
    return tuple(flags)


def run(args: argparse.Namespace) -> None:
    model = prepare(args.dtype)
    spec_args = speculative_flags(args, str(model.path))
    spec = ServerSpec(str(model.path), port=args.port, dtype=args.dtype, speculative_args=tuple(spec_args))
    print(f"model: {model.path}\nserver: {' '.join(spec.command()[1:])}", flush=True)
    with serving(spec) as server:
        text, meta, seconds = ask_generate(server.base_url, chat_text(str(model.path), PROMPT), args.max_new_tokens)
        tokens = meta["completion_tokens"]
        print(f"\n[/generate] {PROMPT}\n{text}\n-> {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tokens/s")
        if summary := spec_summary(meta):
            print(f"   speculative: {summary}")
        text, tokens, seconds = ask_chat(server.base_url, args.chat_prompt, args.max_new_tokens)
        print(f"\n[/v1/chat/completions] {args.chat_prompt}\n{text}\n"
              f"-> {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tokens/s")
    print("\nserver stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dspark.tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--speculative-algorithm", default="DSPARK", help="DSPARK (default), NGRAM or NONE")
    parser.add_argument("--speculative-args", nargs=argparse.REMAINDER, default=[],
                        help="further --speculative-* flags passed to the server, e.g. a draft model path")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--chat-prompt", default="What is the capital of France? Answer in one sentence.")
    args = parser.parse_args(argv)
    try:
        run(args)
    except (PrepareError, ServerError) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
