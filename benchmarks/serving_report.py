"""Pure parts of the serving benchmark: the measured record, aggregation over repeats (median, min, max), speedups
against no speculation taken within the same repeat, the markdown headline table and the README splice, and the
parsers for what the server reports (Prometheus text, `DSpark decode:` log lines).

Owns no process, no file and no plotting; everything here is a function of plain values (tested in
tests/unit/test_serving_report.py).
"""

import re
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields

BASELINE = "none"  # the configuration every ratio is taken against
TABLE_START = "<!-- serving-table:start -->"
TABLE_END = "<!-- serving-table:end -->"
# the `DSpark decode:` line's per-step phases (draft includes IPC + plan; between: SGLang's own work from one decode
# step's end to the next one's start, measured by the worker's clock; lines before it was logged lack it)
PHASES = ("draft", "verify", "commit", "between")
REST = "rest"  # accept_len x TPOT minus the phases: what the worker's clock does not see (client-side), estimated


@dataclass(frozen=True)
class Measurement:
    """One (configuration, dataset, concurrency, repeat) cell as measured."""

    output_throughput: float  # aggregate output tokens/s over the run
    per_user_tps: float  # one user's decode speed: 1000 / median TPOT
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    accept_length: float | None  # output tokens per verify step (bonus included); None without speculation
    verify_length: float | None  # draft tokens verified per request per step
    server_rss_mb: float  # peak RSS summed over the server's process tree
    step_ms: dict[str, float] = field(default_factory=dict)  # DSPARK: phase -> ms per decode step
    speculated: float | None = None  # DSPARK: share of request-steps the gate let draft (None: not reported)
    same_as_baseline: float | None = None  # share of requests whose (greedy) output is the baseline's in that repeat
    first_difference: float | None = None  # the earliest token position where an output differs from the baseline's


@dataclass(frozen=True)
class Cell:
    config: str
    dataset: str
    concurrency: int
    repeat: int
    measurement: Measurement


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float
    n: int


@dataclass(frozen=True)
class Summary:
    """One (configuration, dataset, concurrency) over the repeats."""

    config: str
    dataset: str
    concurrency: int
    stats: dict[str, Stat]  # Measurement field (or "step_ms.<phase>") -> over repeats
    ratios: dict[str, Stat]  # "output_throughput" / "per_user_tps" -> this / baseline, within each repeat


RATIO_FIELDS = ("output_throughput", "per_user_tps")


def stat(values: list[float]) -> Stat | None:
    """Median, min and max of the values that exist; None when none do."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return Stat(statistics.median(present), min(present), max(present), len(present))


def scalar_fields(m: Measurement) -> dict[str, float | None]:
    """A measurement's numbers flattened: scalar fields plus `step_ms.<phase>`."""
    values = {f.name: getattr(m, f.name) for f in fields(m) if f.name != "step_ms"}
    values.update({f"step_ms.{phase}": ms for phase, ms in m.step_ms.items()})
    return values


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def within_repeat_ratios(cells: list[Cell], name: str) -> dict[tuple[str, str, int, int], float]:
    """(config, dataset, concurrency, repeat) -> cell's `name` / the baseline's `name` in that same repeat."""
    base = {(c.dataset, c.concurrency, c.repeat): getattr(c.measurement, name) for c in cells if c.config == BASELINE}
    out = {}
    for c in cells:
        r = ratio(getattr(c.measurement, name), base.get((c.dataset, c.concurrency, c.repeat)))
        if r is not None:
            out[(c.config, c.dataset, c.concurrency, c.repeat)] = r
    return out


def summarize(cells: list[Cell]) -> list[Summary]:
    """Group cells by (config, dataset, concurrency), in first-seen order; stats and ratios over repeats."""
    groups: dict[tuple[str, str, int], list[Cell]] = defaultdict(list)
    for c in cells:
        groups[(c.config, c.dataset, c.concurrency)].append(c)
    ratio_maps = {name: within_repeat_ratios(cells, name) for name in RATIO_FIELDS}
    summaries = []
    for (config, dataset, conc), group in groups.items():
        columns: dict[str, list] = defaultdict(list)
        for c in group:
            for key, value in scalar_fields(c.measurement).items():
                columns[key].append(value)
        stats = {k: s for k, vs in columns.items() if (s := stat(vs)) is not None}
        ratios = {}
        for name, per_cell in ratio_maps.items():
            if (s := stat([per_cell.get((config, dataset, conc, c.repeat)) for c in group])) is not None:
                ratios[name] = s
        summaries.append(Summary(config, dataset, conc, stats, ratios))
    return summaries


def summary_json(s: Summary) -> dict:
    return asdict(s)


# -- the headline table --------------------------------------------------------------------------------------

def fmt(s: Stat | None, digits: int = 1, spread: bool = False) -> str:
    if s is None:
        return "-"
    text = f"{s.median:.{digits}f}"
    if spread and s.n > 1:
        text += f" [{s.min:.{digits}f}-{s.max:.{digits}f}]"
    return text


def table_row(s: Summary) -> str:
    g = s.stats.get
    cells = [s.dataset, str(s.concurrency), s.config,
             fmt(g("per_user_tps")), fmt(s.ratios.get("per_user_tps"), 2, spread=True),
             fmt(g("output_throughput")), fmt(s.ratios.get("output_throughput"), 2, spread=True),
             f"{fmt(g('ttft_p50_ms'), 0)} / {fmt(g('ttft_p99_ms'), 0)}",
             f"{fmt(g('tpot_p50_ms'), 0)} / {fmt(g('tpot_p99_ms'), 0)}",
             fmt(g("accept_length"), 2), fmt(g("verify_length"), 2), fmt(g("speculated"), 2),
             fmt(g("server_rss_mb"), 0)]
    return "| " + " | ".join(cells) + " |"


TABLE_HEADER = ("| prompts | conc. | config | user tok/s | x none | total tok/s | x none | TTFT p50/p99 ms "
                "| TPOT p50/p99 ms | accept len | verify len | drafted | RSS MB |\n"
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def render_table(summaries: list[Summary]) -> str:
    """Markdown: one row per (dataset, concurrency, config), medians over repeats, ratios with [min-max]."""
    ordered = sorted(summaries, key=lambda s: (s.dataset, s.concurrency))  # stable: keeps config order
    return "\n".join([TABLE_HEADER, *(table_row(s) for s in ordered)])


def output_identity(texts: list[str], base: list[str], encode) -> tuple[float, int | None]:
    """Each request's output against the baseline's for the same prompt (same order) -> (share identical, the
    earliest token position where one differs, None when all are identical); `encode` text -> token ids.
    Example: ["ab", "ac"] against ["ab", "ab"], one token per letter -> (0.5, 1)."""
    if len(texts) != len(base) or not texts:
        raise ValueError(f"{len(texts)} outputs against {len(base)} of the baseline")
    firsts = [first_difference(encode(a), encode(b)) for a, b in zip(texts, base) if a != b]
    return 1.0 - len(firsts) / len(texts), min(firsts, default=None)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter's length when one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def render_identity(summaries: list[Summary]) -> str:
    """Markdown: per (dataset, concurrency, config) beside the baseline, the share of outputs identical to the
    baseline's (median over repeats) and the earliest token where one differed; '' when nothing was compared."""
    rows = [f"| {s.dataset} | {s.concurrency} | {s.config} | {fmt(s.stats['same_as_baseline'], 2, spread=True)} | "
            f"{'-' if (first := s.stats.get('first_difference')) is None else int(first.min)} |"
            for s in sorted(summaries, key=lambda s: (s.dataset, s.concurrency))
            if s.config != BASELINE and "same_as_baseline" in s.stats]
    if not rows:
        return ""
    return "\n".join([f"| prompts | conc. | config | outputs identical to {BASELINE} | earliest differing token |",
                      "|---|---:|---|---:|---:|", *rows])


def splice_readme(readme: str, table: str) -> str:
    """Replace the text between the serving-table markers; ValueError when the markers are missing."""
    start, end = readme.find(TABLE_START), readme.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {TABLE_START} ... {TABLE_END} block")
    return readme[:start + len(TABLE_START)] + "\n" + table + "\n" + readme[end:]


# -- what the server reports --------------------------------------------------------------------------------

PROM_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def prometheus_totals(text: str) -> dict[str, float]:
    """Prometheus text exposition -> metric name -> value summed over all label sets."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or not (m := PROM_LINE.match(line)):
            continue
        try:
            totals[m.group(1)] += float(m.group(3))
        except ValueError:
            continue
    return dict(totals)


def delta_ratio(before: dict[str, float], after: dict[str, float], num: str, den: str) -> float | None:
    """(after - before)[num] / (after - before)[den]; None when the denominator did not move."""
    d_den = after.get(den, 0.0) - before.get(den, 0.0)
    if d_den <= 0:
        return None
    return (after.get(num, 0.0) - before.get(num, 0.0)) / d_den


def accept_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Output tokens per verify step over the run (SGLang's spec_accept_length definition, every algorithm)."""
    return delta_ratio(before, after, "sglang:generation_tokens_total", "sglang:spec_verify_calls_total")


def dspark_verify_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    """DSPARK draft tokens verified per request per step over the run (its histogram's sum / count)."""
    return delta_ratio(before, after, "sglang:dspark_verify_length_sum", "sglang:dspark_verify_length_count")


DECODE_LINE = re.compile(r"DSpark decode: (.*)$")


def decode_lines(log: str) -> list[dict[str, float]]:
    """Every `DSpark decode: k=v ...` line of a server log as numbers."""
    out = []
    for line in log.splitlines():
        if m := DECODE_LINE.search(line):
            pairs = (kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)
            out.append({k: float(v) for k, v in pairs})
    return out


def step_breakdown(lines: list[dict[str, float]]) -> dict[str, float]:
    """Step-weighted mean ms per decode step of each phase the lines carry; {} when there are none."""
    steps = sum(line.get("steps", 0.0) for line in lines)
    if steps <= 0:
        return {}
    return {p: sum(line.get(f"{p}_ms", 0.0) * line.get("steps", 0.0) for line in lines) / steps for p in PHASES
            if any(f"{p}_ms" in line for line in lines)}


def speculated_share(lines: list[dict[str, float]]) -> float | None:
    """Step-weighted mean of the lines' `speculated=` (share of request-steps that drafted); None without it."""
    weighted = [(line["speculated"], line.get("steps", 0.0)) for line in lines if "speculated" in line]
    steps = sum(w for _, w in weighted)
    return sum(v * w for v, w in weighted) / steps if steps > 0 else None


def with_rest_of_step(step_ms: dict[str, float], accept_len: float | None, tpot_ms: float) -> dict[str, float]:
    """Adds REST: one decode step lasts about accept_len x TPOT for a request (each step yields accept_len
    tokens), so what the phases (SGLang's time between steps included, where the lines carry it) do not cover is
    time the worker's clock does not see: the client's side of streaming, the spread of TPOT over requests."""
    if not step_ms or not accept_len or not tpot_ms:
        return step_ms
    return {**step_ms, REST: max(0.0, accept_len * tpot_ms - sum(step_ms[p] for p in PHASES if p in step_ms))}
