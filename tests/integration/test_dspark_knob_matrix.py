"""The knob matrix (issue 27): every DSpark flag combination either refuses at start-up with one line naming the
knob, or serves: a greedy and a sampled request, run side by side, both answered, the server still healthy with no
draft-side fault or traceback in its log, and greedy output token-identical to the plain server's.

Each knob is set to its edge values, crossed pairwise with the four switches a user turns most: lookup on/off, the
tree preset (or the default chain), the gate on/off and the draft process on/off. A knob set rides on a pair of
servers whose switches are complementary (one server has each switch on, the other off), so every edge value
meets both settings of every switch; the three pairs' switch patterns (0000, 0011, 0101 and their complements)
also cover every pair of switch settings (`test_the_matrix_crosses_every_knob_set_with_both_settings_of_each_
switch`). Several knobs share a server: a server start costs ~30 s of CI time, a request ~1 s; each server
starts while the one before it is tested.

- small: the narrowest drafting (max-window 1, min-window 0, survival-threshold 1, max-verify 1, lookup 1 node of
  1 token on 1 chain, budget off, gate-margin 0, cost-refit-alpha 1, cpu-gemm native, draft-dtype float32,
  cost-table-out), with the bigram drafter (conftest: its drafts are often accepted).
- large: the widest (max-window = min-window = the drafter's gamma 7, branch-threshold 1, min-verify 64 over any
  width, lookup 64 nodes / 8 chains / 32 tokens, budget lagged, gate-margin 1, cost-refit-alpha 0, draft-dtype
  bfloat16, draft-ahead, an explicit calibration file, trace), with the bigram drafter.
- mid: tree-width 8 capped by max-tree-nodes 7 (= gamma), min-verify = max-verify = 3, latency-target-ms 0.001,
  budget prefix, a one-point (flat) cost table, with the shipped drafter.
max-verify 0 with lookup on (it crashed the server once: lookup learnt from drafts never verified) is the no-draft
server of test_dspark_lossless.py (the shipped drafter, whose recommended knobs turn lookup on, the gate and the
draft process on).

Refusals: the cross-knob rules that need the drafter (max-tree-nodes under max-window, a window over the drafter's
gamma) stop start-up with one `sgl-dspark: error:` line naming the knob; the others (min-window over max-window,
min-verify over max-verify) are the config's, unit-tested in tests/unit/test_config.py."""

import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from conftest import dspark_spec, generate
from sgl_dspark.tools.launch import relay
from sgl_dspark.tools.models import SHIPPED_DRAFTER
from test_dspark_lossless import mismatches
from test_dspark_startup import refusal

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "max_new_tokens": 16}
GREEDY_PROMPTS = (0, 14)  # a chat prompt (shared system prompt) and a raw/code one of the `prompts` fixture
SAMPLED_PROMPT = 3
# What a server that stayed up may still log when something went wrong: a drafter exception turned into a step
# without drafts, a dead draft worker, a block wider than the KV reserve (tracebacks: `tracebacks`).
LOG_FAULTS = ("draft worker unavailable", "draft worker failed", "exceeds the reserved verify width")
# SGLang's own, plain servers' too: with --skip-server-warmup its post-warmup thread may POST /freeze_gc before
# uvicorn accepts connections, and logs the refused connection with a traceback (harmless: GC is left unfrozen).
BENIGN_TRACEBACK = "post-warmup freeze_gc failed"
TMP = "{tmp}"  # replaced by the test's own directory in knob values
FLAT_COST_TABLE = {"tokens": [1], "seconds": [0.02]}  # one point: every verify width costs the same
SWITCHES = ("lookup", "tree", "gate", "process")


@dataclass(frozen=True)
class Cell:
    """One server: the switches and the edge knobs ((flag suffix, value) pairs) it is started with."""

    knob_set: str
    drafter: str  # "bigram" (conftest's bigram_drafter_path) or "shipped" (the drafter in the package)
    lookup: bool
    tree: bool  # --speculative-dspark-preset tree, else the default chain
    gate: bool
    process: bool  # --speculative-dspark-draft-process
    knobs: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        return "-".join([self.knob_set, "lookup" if self.lookup else "nolookup", "tree" if self.tree else "chain",
                         "gate" if self.gate else "nogate", "process" if self.process else "inproc"])

    def flags(self, tmp: Path) -> tuple[str, ...]:
        preset = ("--speculative-dspark-preset", "tree") if self.tree else ()
        knobs = [(f"--speculative-dspark-{knob}", value.replace(TMP, str(tmp))) for knob, value in self.knobs]
        return (*preset, "--speculative-dspark-lookup", str(self.lookup).lower(), *itertools.chain(*knobs))

    def knob(self, name: str) -> str | None:
        return dict(self.knobs).get(name)


def pair(knob_set: str, drafter: str, switches: tuple[bool, bool, bool, bool],
         knobs: tuple[tuple[str, str], ...]) -> list[Cell]:
    """The knob set on two servers with complementary switches: each edge value meets both settings of each."""
    return [Cell(knob_set, drafter, *switches, knobs), Cell(knob_set, drafter, *(not s for s in switches), knobs)]


SMALL = (("max-window", "1"), ("min-window", "0"), ("survival-threshold", "1.0"), ("max-verify", "1"),
         ("lookup-max-nodes", "1"), ("lookup-width", "1"), ("lookup-max-len", "1"), ("budget", "off"),
         ("gate-margin", "0"), ("cost-refit-alpha", "1"), ("cpu-gemm", "native"), ("draft-dtype", "float32"),
         ("cost-table-out", f"{TMP}/cost-table.json"))
LARGE = (("max-window", "7"), ("min-window", "7"), ("branch-threshold", "1.0"), ("min-verify", "64"),
         ("lookup-max-nodes", "64"), ("lookup-width", "8"), ("lookup-max-len", "32"), ("budget", "lagged"),
         ("gate-margin", "1"), ("cost-refit-alpha", "0"), ("draft-dtype", "bfloat16"), ("draft-ahead", "true"),
         ("calibration", str(SHIPPED_DRAFTER / "calibration.json")), ("trace", f"{TMP}/trace.jsonl"))
MID = (("tree-width", "8"), ("max-tree-nodes", "7"), ("min-verify", "3"), ("max-verify", "3"),
       ("latency-target-ms", "0.001"), ("budget", "prefix"), ("cost-table", f"{TMP}/flat-cost.json"))
PAIRED = [*pair("small", "bigram", (False, False, False, False), SMALL),
          *pair("large", "bigram", (False, False, True, True), LARGE),
          *pair("mid", "shipped", (False, True, False, True), MID)]
CELLS = PAIRED


def test_the_matrix_crosses_every_knob_set_with_both_settings_of_each_switch():
    """No server: the design above holds (every knob set meets both settings of every switch; every two switches
    are seen in all four combinations)."""
    for knob_set in {c.knob_set for c in PAIRED}:
        cells = [c for c in PAIRED if c.knob_set == knob_set]
        for switch in SWITCHES:
            assert {getattr(c, switch) for c in cells} == {False, True}, (knob_set, switch)
    for a, b in itertools.combinations(SWITCHES, 2):
        assert {(getattr(c, a), getattr(c, b)) for c in PAIRED} == set(itertools.product((False, True), repeat=2))


def tracebacks(log: str) -> list[str]:
    """The timestamped log records (a record runs until the next timestamped line) holding a traceback, SGLang's
    benign freeze_gc one left out."""
    records = re.split(r"^(?=\[\d{4}-\d\d-\d\d )", log, flags=re.M)
    return [r[:2000] for r in records if "Traceback" in r and BENIGN_TRACEBACK not in r.splitlines()[0]]


def ask(base_url: str, prompts: list[str]) -> tuple[list[dict], dict]:
    """The greedy requests and the sampled one, all in flight together (greedy rows in a sampled batch)."""
    with ThreadPoolExecutor(max_workers=len(GREEDY_PROMPTS) + 1) as pool:
        greedy = [pool.submit(generate, base_url, prompts[i], **GREEDY) for i in GREEDY_PROMPTS]
        sampled = pool.submit(generate, base_url, prompts[SAMPLED_PROMPT], **SAMPLED)
        return [g.result() for g in greedy], sampled.result()


@pytest.fixture(scope="module")
def cell_servers(default_model_path, bigram_drafter_path, tmp_path_factory):
    """The cells' servers in turn, each started while the one before it is tested; each cell's directory (its
    server log, the files its knobs name) holds the flat cost table."""
    jobs = {}
    for cell in CELLS:
        tmp = tmp_path_factory.mktemp(cell.name)
        (tmp / "flat-cost.json").write_text(json.dumps(FLAT_COST_TABLE))
        drafter = str(SHIPPED_DRAFTER) if cell.drafter == "shipped" else bigram_drafter_path
        jobs[cell.name] = (dspark_spec(default_model_path, drafter, *cell.flags(tmp), gate=cell.gate,
                                       draft_process=cell.process), tmp)
    with relay(jobs) as servers:
        yield servers


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_every_knob_combination_serves_greedy_as_plain(cell_servers, prompts, plain_reference, cell):
    with cell_servers.serving(cell.name) as server:
        tmp_path = server.log_path.parent
        greedy, sampled = ask(server.base_url, prompts)
        assert server.process.poll() is None
        assert requests.get(f"{server.base_url}/health", timeout=30).status_code == 200
        log = server.log_text()
    assert not [fault for fault in LOG_FAULTS if fault in log] and not tracebacks(log), f"log: {server.log_path}"
    want = [plain_reference[i][:GREEDY["max_new_tokens"]] for i in GREEDY_PROMPTS]
    assert not mismatches(greedy, want, list(GREEDY_PROMPTS))
    finish, tokens = sampled["meta_info"]["finish_reason"]["type"], sampled["meta_info"]["completion_tokens"]
    assert (finish, tokens) == ("length", SAMPLED["max_new_tokens"]) or (finish == "stop" and 0 < tokens
                                                                         <= SAMPLED["max_new_tokens"]), sampled
    cap = cell.knob("max-verify")
    for reply in greedy:  # no step verified more drafts than max-verify allows (the anchor's token comes on top)
        meta = reply["meta_info"]
        assert cap is None or meta["completion_tokens"] - 1 <= (int(cap) + 1) * meta["spec_verify_ct"], meta
    for name, path in (("cost-table-out", "cost-table.json"), ("trace", "trace.jsonl")):
        if cell.knob(name):
            assert (tmp_path / path).stat().st_size > 0, name


@pytest.mark.parametrize("flags, named", [
    (("--speculative-dspark-preset", "tree", "--speculative-dspark-max-window", "5",
      "--speculative-dspark-max-tree-nodes", "4"), "max_tree_nodes=4 is invalid"),
    (("--speculative-dspark-max-window", "8"), "max_window 8"),  # the drafter's gamma is 7
], ids=["tree-nodes-under-window", "window-over-gamma"])
def test_invalid_combinations_are_refused_with_one_line_naming_the_knob(default_model_path, tmp_path, flags, named):
    message = refusal(default_model_path, ("--speculative-draft-model-path", str(SHIPPED_DRAFTER), *flags), tmp_path)
    assert named in message
