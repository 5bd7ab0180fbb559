"""Load with faults: 200 mixed requests (greedy, sampled, logprob, stop-string, streaming) at concurrency 16 on a
DSPARK server while 20% are aborted mid-flight (client disconnects, POST /abort_request) and the draft worker is
SIGKILLed twice. The server stays up, every request not aborted finishes, greedy output equals the plain server's,
logprobs cover every output token, and afterwards the draft side holds nothing for the finished requests. The suffix
cache is on and small, so the finished and aborted requests' histories fill it past its cap while the same prompts
come back (its chains are then often right, and the greedy check covers them).
"""

import concurrent.futures as cf
import dataclasses
import json
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import requests

from conftest import dspark_spec, generate
from sgl_dspark.tools.launch import serving
from test_dspark_recovery import gauge, wait_for_generation, wait_for_worker

pytestmark = pytest.mark.integration

N_REQUESTS, CONCURRENCY = 200, 16
ANSWERED = ("greedy", "sampled", "logprob", "stop", "stream")  # 32 of each
ABORTED = ("close", "abort")  # 20 of each: the client drops the stream; POST /abort_request {"rid"}
GREEDY_KINDS = ("greedy", "logprob", "stop", "stream")
KILL_AFTER = (50, 120)  # SIGKILL the draft worker once this many requests have answered
ABORT_AFTER_S = (0.5, 3.0)  # /abort_request this long after sending (uniform): queued or decoding
CHUNKS_BEFORE_CLOSE = 2
IDLE_S = 5.0
LOOKUP_ENTRIES = "sglang:dspark_lookup_entries"
SUFFIX_TOKENS, SUFFIX_CAP = "sglang:dspark_suffix_cache_tokens", 2048
ARENA_BYTES = "sglang:dspark_draft_arena_bytes"


@dataclass(frozen=True)
class Job:
    index: int
    kind: str
    prompt: str
    params: dict  # sampling_params

    @property
    def rid(self) -> str:
        return f"load-faults-{self.index}"

    @property
    def body(self) -> dict:
        extra = {"return_logprob": True, "top_logprobs_num": 2} if self.kind == "logprob" else {}
        stream = {"stream": True} if self.kind in ("stream", "close") else {}
        return {"text": self.prompt, "sampling_params": self.params, "rid": self.rid, **extra, **stream}


@dataclass
class Outcome:
    job: Job
    status: int | None = None  # None: no HTTP answer
    reply: dict | None = None  # the JSON reply, or a stream's last chunk
    error: str = ""


def sampling(kind: str, prompt_index: int) -> dict:
    """Short outputs (16..48 new tokens); greedy kinds share params per prompt so one plain reference serves them."""
    length = {"max_new_tokens": 16 + 8 * (prompt_index % 5)}
    if kind in ("sampled", "abort"):
        return {**length, "temperature": 0.8, "top_p": 0.9}
    if kind == "stop":
        return {**length, "temperature": 0, "stop": ["\n", "."]}
    return {**length, "temperature": 0}


def plan(prompts: list[str], seed: int = 0) -> list[Job]:
    aborted = int(0.2 * N_REQUESTS) // len(ABORTED)
    kinds = [k for k in ABORTED for _ in range(aborted)]
    kinds += [ANSWERED[i % len(ANSWERED)] for i in range(N_REQUESTS - len(kinds))]
    random.Random(seed).shuffle(kinds)
    return [Job(i, kind, prompts[i % len(prompts)], sampling(kind, i % len(prompts))) for i, kind in enumerate(kinds)]


def reference_key(job: Job) -> tuple[str, str]:
    return job.prompt, json.dumps(job.params, sort_keys=True)


def plain_references(base_url: str, jobs: list[Job]) -> dict[tuple[str, str], list[int]]:
    wanted = {reference_key(j): j for j in jobs if j.kind in GREEDY_KINDS}
    with cf.ThreadPoolExecutor(4) as pool:
        replies = pool.map(lambda j: generate(base_url, j.prompt, **j.params), wanted.values())
        return {key: reply["output_ids"] for key, reply in zip(wanted, replies)}


# -- sending ------------------------------------------------------------------------------------------------------

def send(base_url: str, job: Job) -> Outcome:
    outcome = Outcome(job)
    try:
        if job.kind in ("stream", "close"):
            stream(base_url, outcome)
        else:
            post(base_url, outcome)
    except (requests.RequestException, ValueError) as e:
        outcome.error = f"{type(e).__name__}: {e}"
    return outcome


def post(base_url: str, outcome: Outcome) -> None:
    timer = None
    if outcome.job.kind == "abort":
        delay = random.Random(outcome.job.index).uniform(*ABORT_AFTER_S)
        timer = threading.Timer(delay, requests.post, (f"{base_url}/abort_request",),
                                {"json": {"rid": outcome.job.rid}, "timeout": 60})
        timer.start()
    try:
        reply = requests.post(f"{base_url}/generate", json=outcome.job.body, timeout=600)
    finally:
        if timer is not None:
            timer.cancel()
    outcome.status, outcome.reply = reply.status_code, reply.json()


def stream(base_url: str, outcome: Outcome) -> None:
    """Read the event stream to its end, or (kind "close") drop the connection after CHUNKS_BEFORE_CLOSE chunks."""
    with requests.post(f"{base_url}/generate", json=outcome.job.body, timeout=600, stream=True) as reply:
        outcome.status = reply.status_code
        for n, line in enumerate(line for line in reply.iter_lines() if line.startswith(b"data: {")):
            outcome.reply = json.loads(line[len(b"data: "):])
            if outcome.job.kind == "close" and n + 1 >= CHUNKS_BEFORE_CLOSE:
                return


def kill_draft_worker_twice(server, progress) -> list[int]:
    """SIGKILL the live draft worker when progress() (requests answered) reaches each KILL_AFTER mark; the pids
    killed (fewer when no worker came up again: the server stays-up test says so)."""
    killed: list[int] = []
    for mark in KILL_AFTER:
        while progress() < mark:
            time.sleep(0.2)
        try:
            worker = wait_for_worker(server, set(killed))
        except AssertionError:
            break
        worker.send_signal(signal.SIGKILL)
        killed.append(worker.pid)
    return killed


# -- the run ------------------------------------------------------------------------------------------------------

@dataclass
class LoadRun:
    outcomes: list[Outcome]
    references: dict[tuple[str, str], list[int]]
    killed: list[int]
    arena_bytes_idle: float | None  # before the load
    seconds: float


@pytest.fixture(scope="module")
def server(default_model_path, random_drafter_path, tmp_path_factory):
    """DSPARK with the random drafter in a worker process (killed below), 16 request slots, /metrics, lookup
    (draft-side state per request) and the suffix cache."""
    spec = dspark_spec(default_model_path, random_drafter_path, "--speculative-dspark-lookup", "true",
                       "--speculative-dspark-suffix-cache-tokens", str(SUFFIX_CAP),
                       max_running_requests=CONCURRENCY, draft_process=True)
    spec = dataclasses.replace(spec, extra_args=("--enable-metrics",))
    with serving(spec, tmp_path_factory.mktemp("load-faults")) as running:
        yield running


@pytest.fixture(scope="module")
def run(server, plain_server, prompts) -> LoadRun:
    jobs = plan(prompts[::2])
    references = plain_references(plain_server.base_url, jobs)
    generate(server.base_url, "Hello", temperature=0, max_new_tokens=4)  # the draft gauges are set by a step
    idle_arena = gauge(server.base_url, ARENA_BYTES)
    start = time.monotonic()
    with cf.ThreadPoolExecutor(1) as killer, cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(send, server.base_url, job) for job in jobs]
        kills = killer.submit(kill_draft_worker_twice, server, lambda: sum(f.done() for f in futures))
        outcomes = [f.result() for f in futures]
        killed = kills.result(timeout=300)
    return LoadRun(outcomes, references, killed, idle_arena, time.monotonic() - start)


def summary(run: LoadRun) -> str:
    kinds = Counter((o.job.kind, o.status, finish(o)) for o in run.outcomes)
    return f"{run.seconds:.0f} s, killed {run.killed}; (kind, status, finish): {dict(sorted(kinds.items(), key=str))}"


def finish(outcome: Outcome) -> str | None:
    reason = ((outcome.reply or {}).get("meta_info") or {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def answered(run: LoadRun, kinds=ANSWERED) -> list[Outcome]:
    return [o for o in run.outcomes if o.job.kind in kinds]


# -- the checks ---------------------------------------------------------------------------------------------------

def test_the_faults_were_injected(run):
    print(summary(run))
    assert len(run.killed) == 2, f"the draft worker was killed {len(run.killed)} times: {summary(run)}"
    assert any(finish(o) == "abort" for o in answered(run, ("abort",))), f"no abort landed: {summary(run)}"


def test_the_server_stays_up_through_aborts_and_draft_worker_kills(server, run):
    assert server.process.poll() is None, f"the server exited: {summary(run)}"
    assert requests.get(f"{server.base_url}/health_generate", timeout=120).status_code == 200


def test_every_request_not_aborted_finishes(run):
    bad = [f"{o.job.rid} ({o.job.kind}): status {o.status}, finish {finish(o)} {o.error}"
           for o in answered(run) if o.status != 200 or finish(o) not in ("length", "stop")]
    assert not bad, f"{len(bad)} unfinished, e.g. {bad[:5]}; {summary(run)}"


def test_greedy_output_equals_the_plain_server(run):
    wrong = [o.job.rid for o in answered(run, GREEDY_KINDS)
             if (o.reply or {}).get("output_ids") != run.references[reference_key(o.job)]]
    assert not wrong, f"{len(wrong)} of {len(answered(run, GREEDY_KINDS))} greedy replies differ: {wrong[:10]}"


def test_logprob_replies_have_one_logprob_per_output_token(run):
    short = []
    for o in answered(run, ("logprob",)):
        meta = (o.reply or {}).get("meta_info", {})
        tokens, top = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
        n = len((o.reply or {}).get("output_ids", ()))
        if not (n == len(tokens) == len(top) > 0 and all(len(t) == 2 for t in top)):
            short.append(f"{o.job.rid}: {n} tokens, {len(tokens)} logprobs, {len(top)} top-logprob lists")
    assert not short, f"{len(short)} logprob replies short, e.g. {short[:5]}"


PROBE = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}  # ~47 steps alone: > shm.SHRINK_AFTER


@pytest.fixture(scope="module")
def idle(server, run) -> dict[str, float | None]:
    """The draft-side gauges after the load, once the last worker is back: one probe request runs alone (the gauges
    are written by decode steps; lookup state of requests that left the batch is dropped at the next step, and grown
    arenas go back to their initial size after a run of small steps), then the server idles IDLE_S."""
    wait_for_worker(server, set(run.killed))
    wait_for_generation(server.base_url, len(run.killed))
    generate(server.base_url, "Count from one to twenty:", **PROBE)
    time.sleep(IDLE_S)
    return {name: gauge(server.base_url, name) for name in (LOOKUP_ENTRIES, ARENA_BYTES, SUFFIX_TOKENS)}


def test_no_lookup_entry_is_left_for_finished_requests(idle):
    assert idle[LOOKUP_ENTRIES] is not None, f"no {LOOKUP_ENTRIES} on /metrics"
    assert idle[LOOKUP_ENTRIES] <= 1, f"{LOOKUP_ENTRIES} = {idle[LOOKUP_ENTRIES]}: more than the probe's own entry"


def test_draft_arenas_are_back_to_their_idle_size(idle, run):
    assert idle[ARENA_BYTES] is not None and run.arena_bytes_idle is not None, f"no {ARENA_BYTES} on /metrics"
    assert idle[ARENA_BYTES] == run.arena_bytes_idle, \
        f"{ARENA_BYTES} = {idle[ARENA_BYTES]:.0f}, {run.arena_bytes_idle:.0f} before the load"


def test_the_suffix_cache_holds_earlier_histories_within_its_cap(idle):
    assert idle[SUFFIX_TOKENS] is not None, f"no {SUFFIX_TOKENS} on /metrics"
    assert SUFFIX_CAP / 2 < idle[SUFFIX_TOKENS] <= SUFFIX_CAP, f"{SUFFIX_TOKENS} = {idle[SUFFIX_TOKENS]}"
