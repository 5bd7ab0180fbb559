"""DSpark knobs: the one frozen, validated configuration and the one place that builds it (`load_config`).

Owns the knob names, their validation rules, the presets in the top-level `configs/` (`sgl_dspark/configs` links
there, so wheels carry them as package data; each merged over
`configs/default.json`, the only place defaults live) and how CLI-style overrides merge over a preset.
Must not read env vars or import SGLang; the SGLang seam passes its flags in through `cli_overrides`.
"""

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUDGET_MODES = ("prefix", "lagged", "off")
GEMM_MODES = ("onednn", "native")
DRAFT_DTYPES = ("auto", "float32", "bfloat16")
PRESET_DIR = Path(__file__).resolve().parent / "configs"  # package data: found by wheel installs too
DEFAULT_PRESET = "default"
PRESET_META_KEYS = ("description",)  # allowed in preset files, not knobs
CLI_PREFIX = "speculative_dspark_"  # --speculative-dspark-max-window -> max_window
PRESET_KNOB = "preset"  # --speculative-dspark-preset chooses the preset rather than setting a knob


@dataclass(frozen=True)
class DSparkKnobs:
    max_window: int | None  # gamma cap: most draft positions on the main chain (None: the drafter's gamma)
    min_window: int  # draft positions always drafted, whatever the survival
    survival_threshold: float  # a branch stops once its survival falls below this (0: never)
    branch_threshold: float  # tree drafting: branch where a node's confidence is below this
    tree_width: int  # most candidates per tree position (1 = chain)
    max_tree_nodes: int | None  # most draft nodes per request, anchor excluded (None: max_window * tree_width)
    sampled_trees: bool  # with tree_width > 1, sampled requests branch too: i.i.d. siblings, recursive rejection
    budget: str  # which drafted nodes the target verifies: "prefix" (priced by the step-cost table, early stop),
    # "lagged" (a budget from confidences two steps old) or "off" (all drafted)
    min_verify: int  # draft nodes every request verifies whatever the verify budget says (if drafted)
    max_verify: int | None  # most draft nodes one request verifies (None: no cap; 0: none, no drafting)
    latency_target_ms: float | None  # per-user step-latency target; the verify budget shrinks B to meet it
    cost_refit_alpha: float  # weight of one measured step in the online cost-table refit (0: frozen table)
    cost_table: str | None  # step-cost table JSON (sgl_dspark.cost); None: profile at start-up
    cost_table_out: str | None  # write the table (profiled/loaded, then refitted) here; None: do not save
    calibration: str | None  # calibration JSON (sgl_dspark.calibration); None: the drafter's calibration.json if any
    draft_vocab: str | None  # reduced draft vocabulary file; None: the target's full vocabulary
    lookup: bool  # candidates copied from the request's own context, grafted into the verify tree
    lookup_max_nodes: int  # most tree nodes the lookup branch adds per request and step (its share of the KV width)
    lookup_width: int  # most distinct copied chains per request and step
    lookup_max_len: int  # tokens per copied chain
    suffix_cache_tokens: int  # with lookup: tokens of earlier requests' histories (prompt and output) every request's
    # lookup also copies chains from (sgl_dspark.suffix; the oldest evicted first; 0: off)
    draft_process: bool  # draft in a separate worker process (true) or in the scheduler process (false)
    trace: str | None  # JSONL file the worker appends one record per request per decode step to (None: off)
    cpu_gemm: str  # linear layers on CPU (target and drafter): "onednn" (packed weights, flat in rows) or "native"
    draft_ahead: bool  # start the next step's drafting on the draft worker's core while the step finishes
    # (measured neutral on a 2-core CPU: the shorter wait is paid back by memory-bandwidth contention)
    draft_dtype: str  # the drafter's dtype: "float32", "bfloat16", or "auto" (bfloat16 on a GPU, or where the CPU
    # has bf16 GEMM)
    gate: bool  # per step, only requests whose speculation is predicted to pay for the whole step draft
    # (sgl_dspark.gate)
    gate_margin: float  # predicted tokens/s must beat plain decoding's by this share for anyone to speculate

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and not isinstance(value, bool) and field.name in _FLOAT_KNOBS:
                object.__setattr__(self, field.name, float(value))
            ok, allowed = RULES[field.name]
            if not ok(getattr(self, field.name)):
                raise invalid(field.name, value, allowed)
        if self.max_window is not None and self.min_window > self.max_window:
            raise invalid("min_window", self.min_window, f"an integer in [0, max_window={self.max_window}]")
        if None not in (self.max_window, self.max_tree_nodes) and self.max_tree_nodes < self.max_window:
            raise invalid("max_tree_nodes", self.max_tree_nodes, f"null or an integer >= max_window={self.max_window}")
        if self.max_verify is not None and self.min_verify > self.max_verify:
            raise invalid("min_verify", self.min_verify, f"an integer in [0, max_verify={self.max_verify}]")

    @property
    def is_chain(self) -> bool:
        return self.tree_width == 1

    @property
    def latency_target_s(self) -> float | None:
        return None if self.latency_target_ms is None else self.latency_target_ms / 1000.0

    @property
    def drafts(self) -> bool:
        """False when no draft can ever be verified (max_verify 0): the worker then never asks for drafts."""
        return self.max_verify != 0

    def lookup_knobs(self):
        """The lookup branch's knobs (a fixed record; sgl_dspark.lookup.LookupKnobs)."""
        from sgl_dspark.lookup import LookupKnobs

        return LookupKnobs(width=self.lookup_width, max_len=self.lookup_max_len, max_nodes=self.lookup_max_nodes)

    def verify_nodes(self, gamma: int) -> int:
        """The most draft nodes one request can verify in a step, anchor excluded: the drafter's node budget plus
        the lookup's, capped by max_verify. The one place the verify width comes from: SGLang reserves KV for
        1 + this per request and the worker never writes more rows. ValueError if the knobs do not fit gamma."""
        nodes = self.draft_knobs().resolve(gamma).max_nodes + (self.lookup_knobs().max_nodes if self.lookup else 0)
        return nodes if self.max_verify is None else min(nodes, self.max_verify)

    def draft_knobs(self, temperatures: tuple[float, ...] = (), biases: tuple[float, ...] = ()):
        """The drafter's share of the knobs (sgl_dspark.drafter.knobs.DraftKnobs), with the calibration
        (temperatures, biases) loaded from `calibration`; imported here so the config stays importable without the
        drafter."""
        from sgl_dspark.drafter.knobs import DraftKnobs

        return DraftKnobs(self.max_window, self.min_window, self.survival_threshold, self.tree_width,
                          self.branch_threshold, self.max_tree_nodes, tuple(temperatures), tuple(biases),
                          self.sampled_trees)


def invalid(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"DSpark config: {name}={value!r} is invalid; allowed: {allowed}")


def _int_at_least(lo: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _number_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


def _is_path(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


_FLOAT_KNOBS = ("survival_threshold", "branch_threshold", "latency_target_ms", "cost_refit_alpha", "gate_margin")

RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_window": (_optional(_int_at_least(1)), "null or an integer >= 1"),
    "min_window": (_int_at_least(0), "an integer >= 0"),
    "survival_threshold": (_number_in(0, 1), "a number in [0, 1]"),
    "branch_threshold": (_number_in(0, 1), "a number in [0, 1]"),
    "tree_width": (_int_at_least(1), "an integer >= 1 (1 = chain)"),
    "sampled_trees": (lambda v: isinstance(v, bool), "true | false"),
    "max_tree_nodes": (_optional(_int_at_least(1)), "null or an integer >= 1"),
    "budget": (lambda v: v in BUDGET_MODES, " | ".join(BUDGET_MODES)),
    "min_verify": (_int_at_least(0), "an integer >= 0"),
    "max_verify": (_optional(_int_at_least(0)), "null or an integer >= 0 (0: verify no drafts)"),
    "latency_target_ms": (_optional(_number_in(0, math.inf, lo_open=True)), "null or a number > 0"),
    "cost_refit_alpha": (_number_in(0, 1), "a number in [0, 1]"),
    "cost_table": (_optional(_is_path), "null or a non-empty path"),
    "cost_table_out": (_optional(_is_path), "null or a non-empty path"),
    "calibration": (_optional(_is_path), "null or a non-empty path"),
    "draft_vocab": (_optional(_is_path), "null or a non-empty path"),
    "lookup": (lambda v: isinstance(v, bool), "true | false"),
    "lookup_max_nodes": (_int_at_least(1), "an integer >= 1"),
    "lookup_width": (_int_at_least(1), "an integer >= 1"),
    "lookup_max_len": (_int_at_least(1), "an integer >= 1"),
    "suffix_cache_tokens": (_int_at_least(0), "an integer >= 0 (0: off)"),
    "draft_process": (lambda v: isinstance(v, bool), "true | false"),
    "trace": (_optional(_is_path), "null or a non-empty path"),
    "cpu_gemm": (lambda v: v in GEMM_MODES, " | ".join(GEMM_MODES)),
    "draft_ahead": (lambda v: isinstance(v, bool), "true | false"),
    "draft_dtype": (lambda v: v in DRAFT_DTYPES, " | ".join(DRAFT_DTYPES)),
    "gate": (lambda v: isinstance(v, bool), "true | false"),
    "gate_margin": (_number_in(0, 1), "a number in [0, 1]"),
}
KNOBS = tuple(f.name for f in dataclasses.fields(DSparkKnobs))
assert set(RULES) == set(KNOBS), "every knob needs exactly one rule"


def load_config(preset: str | Path = DEFAULT_PRESET, overrides: Mapping[str, Any] | None = None,
                recommended: Path | None = None) -> DSparkKnobs:
    """The one builder: configs/default.json <- the drafter's recommended knobs <- the preset <- overrides (later
    wins).

    preset: a name in configs/ ("chain", "tree", ...) or a path to a JSON file.
    overrides: knob -> value (e.g. from `cli_overrides`); None values are ignored (flag not given).
    recommended: a drafter folder's RECOMMENDED_FILE (the knobs measured best for that drafter); skipped when absent.
    """
    merged = _check_known(read_preset(preset_path(DEFAULT_PRESET)), "configs/default.json")
    missing = sorted(set(KNOBS) - merged.keys())
    if missing:
        raise ValueError(f"DSpark config: configs/default.json must set every knob; missing {missing}")
    if recommended is not None and recommended.is_file():
        merged |= _check_known(read_preset(recommended), str(recommended))
    if str(preset) != DEFAULT_PRESET:
        merged |= _check_known(read_preset(preset_path(preset)), f"preset {preset}")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    merged |= _check_known(given, "overrides")
    return DSparkKnobs(**merged)


RECOMMENDED_FILE = "recommended.json"  # in a drafter folder: its measured-best knobs, in the preset format


def preset_path(preset: str | Path) -> Path:
    """A preset name -> configs/<name>.json; a path (with a suffix or a slash) is taken as is."""
    text = str(preset)
    path = Path(text) if text.endswith(".json") or "/" in text else PRESET_DIR / f"{text}.json"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        raise ValueError(f"DSpark config: preset {text!r} not found at {path}; known presets: {known}")
    return path


def read_preset(path: Path) -> dict[str, Any]:
    """A preset file -> its knobs (meta keys such as "description" dropped)."""
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DSpark config: preset {path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"DSpark config: preset {path} must hold a JSON object of knobs")
    return {k: v for k, v in doc.items() if k not in PRESET_META_KEYS}


def _check_known(knobs: dict[str, Any], source: str) -> dict[str, Any]:
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise ValueError(f"DSpark config: unknown knob {unknown[0]!r} in {source}; known knobs: {list(KNOBS)}")
    return knobs


def config_from_flags(flags: Mapping[str, Any], drafter_dir: str | Path | None = None) -> DSparkKnobs:
    """Server-args style flags -> config: the drafter folder's recommended knobs (if it has them), then
    `--speculative-dspark-preset`'s, then the other `--speculative-dspark-*` flags."""
    knobs = cli_overrides(flags)
    recommended = None if drafter_dir is None else Path(drafter_dir) / RECOMMENDED_FILE
    return load_config(knobs.pop(PRESET_KNOB, None) or DEFAULT_PRESET, knobs, recommended)


def cli_overrides(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Flags -> {knob: value}. Keys may be `speculative_dspark_max_window` or `--speculative-dspark-max-window`;
    keys without the prefix are ignored, unset (None) flags dropped."""
    out = {}
    for key, value in flags.items():
        name = key.lstrip("-").replace("-", "_")
        if name.startswith(CLI_PREFIX) and value is not None:
            out[name[len(CLI_PREFIX):]] = value
    return out


def cli_flag(knob: str) -> str:
    """max_window -> --speculative-dspark-max-window (the seam declares one flag per knob, default None)."""
    return "--" + (CLI_PREFIX + knob).replace("_", "-")
