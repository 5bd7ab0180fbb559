"""The seed article's offline API over SGLang's own engine: `DSparkEngine(DSparkConfig(model_path=M)).generate(p)`.

Owns the mapping of the article's names onto DSpark knobs and the output record measured from SGLang's meta_info.
Must not validate a knob itself (`sgl_dspark.config.load_config` and its RULES do) nor touch the decode step; SGLang
is imported only when an engine starts (`sgl_dspark` exports these names lazily).

    from sgl_dspark import DSparkEngine, DSparkConfig

    if __name__ == "__main__":  # SGLang spawns its processes, which re-import a script's main module
        config = DSparkConfig(model_path=M, draft_length=7, confidence_threshold=0.7, use_hierarchical_verify=True,
                              hardware_aware=True)  # the article's draft_length=16 needs a drafter with gamma >= 16
        with DSparkEngine(config) as engine:
            out = engine.generate("def fib(n):", max_new_tokens=64, temperature=0.7, top_p=0.9)
        print(out.text, out.tokens_per_second, out.avg_draft_length, out.acceptance_rate)

| article field           | DSpark knob (--speculative-dspark-<knob>)    | meaning                                    |
|-------------------------|----------------------------------------------|--------------------------------------------|
| draft_length            | max_window                                   | the most draft positions on the main chain |
|                         |                                              | (at most the drafter's gamma, block_size)  |
| confidence_threshold    | survival_threshold                           | a branch stops drafting once its survival  |
|                         |                                              | (product of confidences) falls below this  |
| use_hierarchical_verify | True: configs/tree.json's knobs (tree_width, | verify a token tree (True) or one chain    |
|                         | max_tree_nodes, branch_threshold);           | (False)                                    |
|                         | False: tree_width 1                          |                                            |
| hardware_aware          | True: budget "prefix", gate on;              | the measured step costs decide what is     |
|                         | False: budget "off", gate off                | verified and who drafts (True), or every   |
|                         |                                              | step drafts and verifies all (False)       |

A field left None passes nothing: `DSparkConfig(model_path=M)` serves the project's defaults (configs/default.json,
then the drafter's recommended.json), as `--speculative-algorithm DSPARK` alone does. `knobs` sets any other knob
(`{"lookup": False}`, `{"preset": "lagged"}`) and refines what an article field set (`use_hierarchical_verify=True,
knobs={"max_tree_nodes": 32}`), but may not set the knob an article field names (the table's first knob).
"""

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sgl_dspark.config import CLI_PREFIX, config_from_flags, preset_path, read_preset

ALGORITHM = "DSPARK"
TREE_PRESET = "tree"  # use_hierarchical_verify=True: this preset's shape
CHAIN = {"tree_width": 1}  # use_hierarchical_verify=False
HARDWARE_AWARE = {True: {"budget": "prefix", "gate": True}, False: {"budget": "off", "gate": False}}
ARTICLE_KNOB = {"draft_length": "max_window", "confidence_threshold": "survival_threshold",
                "use_hierarchical_verify": "tree_width", "hardware_aware": "budget"}  # the knob each field decides
BOOLEAN_FIELDS = ("use_hierarchical_verify", "hardware_aware")
SET_BY_FIELDS = ("model_path", "speculative_algorithm", "speculative_draft_model_path", "dtype", "device")


@dataclass(frozen=True)
class DSparkConfig:
    model_path: str  # the target model (an HF folder or hub id)
    draft_length: int | None = None  # -> max_window (None: the drafter's gamma, or its recommended knobs')
    confidence_threshold: float | None = None  # -> survival_threshold
    use_hierarchical_verify: bool | None = None  # -> the tree preset's knobs (True) or a chain (False)
    hardware_aware: bool | None = None  # -> budget "prefix" and the gate (True), or budget "off", no gate (False)
    draft_model_path: str | None = None  # None: sgl_dspark.tools.models.default_drafter(model_path)
    dtype: str | None = None  # None: launch.ServerSpec's (float32, as the project's servers); "auto": SGLang's choice
    device: str | None = None  # None: "cpu" on a host without CUDA (and its flags), else SGLang's choice
    knobs: Mapping[str, Any] = field(default_factory=dict)  # further DSpark knobs (config.KNOBS, or "preset")
    engine_args: Mapping[str, Any] = field(default_factory=dict)  # further sglang.Engine keyword arguments

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", MappingProxyType(dict(self.knobs)))
        object.__setattr__(self, "engine_args", MappingProxyType(dict(self.engine_args)))
        check_config(self)

    @property
    def dspark_knobs(self) -> dict[str, Any]:
        """Every knob this config sets: the article fields' (set ones only), then `knobs`."""
        return {**article_knobs(self), **self.knobs}


def field_knobs(name: str, value: Any) -> dict[str, Any]:
    """The knobs one article field sets (none when it is None).

    >>> field_knobs("draft_length", 8), field_knobs("hardware_aware", False), field_knobs("confidence_threshold", None)
    ({'max_window': 8}, {'budget': 'off', 'gate': False}, {})
    """
    if value is None:
        return {}
    if name == "use_hierarchical_verify":
        return read_preset(preset_path(TREE_PRESET)) if value else dict(CHAIN)
    if name == "hardware_aware":
        return dict(HARDWARE_AWARE[value])
    return {ARTICLE_KNOB[name]: value}


def article_knobs(config: DSparkConfig) -> dict[str, Any]:
    """The knobs the article fields set, in the table's order."""
    return {k: v for name in ARTICLE_KNOB for k, v in field_knobs(name, getattr(config, name)).items()}


def check_config(config: DSparkConfig) -> None:
    """ValueError (one line, naming the field) unless the server would accept these knobs: each article field is
    built alone through `load_config` (its RULES) so the message names the field, then everything together (the
    cross-knob rules, a `knobs` preset). The drafter's own rules (its recommended knobs, its gamma) are checked once
    the drafter is resolved: check_fits_drafter."""
    if not isinstance(config.model_path, str) or not config.model_path.strip():
        raise ValueError(f"DSparkConfig: model_path={config.model_path!r} is invalid; allowed: a model folder or id")
    for name, knob in ARTICLE_KNOB.items():
        value = getattr(config, name)
        if value is None:
            continue
        if name in BOOLEAN_FIELDS and not isinstance(value, bool):
            raise ValueError(f"DSparkConfig: {name}={value!r} is invalid; allowed: None | True | False")
        if knob in config.knobs:
            raise ValueError(f"DSparkConfig: {name} and knobs[{knob!r}] set the same knob; set one of them")
        _checked(f"{name} -> ", config_from_flags, flag_kwargs(field_knobs(name, value)))
    taken = [k for k in config.engine_args if k in SET_BY_FIELDS or k.startswith(CLI_PREFIX)]
    if taken:
        raise ValueError(f"DSparkConfig: engine_args[{taken[0]!r}] is set by DSparkConfig; use its field or knobs")
    _checked(f"{set_fields(config)} -> ", config_from_flags, flag_kwargs(config.dspark_knobs))


def set_fields(config: DSparkConfig) -> str:
    """The knob-setting fields the user set, for an error message: "draft_length=32, use_hierarchical_verify=True"."""
    given = [f"{name}={getattr(config, name)!r}" for name in ARTICLE_KNOB if getattr(config, name) is not None]
    return ", ".join(given + ([f"knobs={dict(config.knobs)}"] if config.knobs else [])) or "the defaults"


def check_fits_drafter(config: DSparkConfig, drafter: str) -> None:
    """ValueError (one line) unless the knobs fit the drafter: with its recommended knobs, and within its gamma (its
    block_size), e.g. the article's draft_length=16 with a drafter that drafts 7 positions. Checked before SGLang
    starts, as its start-up would (a drafter folder that cannot be read is left to SGLang to report)."""
    from sgl_dspark.drafter.checkpoint import read_drafter_config

    try:
        gamma = read_drafter_config(drafter).gamma
    except OSError:
        return
    prefix = f"{set_fields(config)} -> drafter {drafter} (block_size {gamma}): "
    _checked(prefix, lambda: config_from_flags(flag_kwargs(config.dspark_knobs), drafter).verify_nodes(gamma))


def _checked(prefix: str, build: Callable[..., object], *args: Any) -> None:
    """build(*args), its ValueError re-raised as DSparkConfig's one line (`prefix` says which fields caused it)."""
    try:
        build(*args)
    except ValueError as e:
        raise ValueError(f"DSparkConfig: {prefix}{str(e).removeprefix('DSpark config: ')}") from None


def flag_kwargs(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """knob -> value as sglang.Engine keyword arguments: {"max_window": 8} -> {"speculative_dspark_max_window": 8}
    ("preset" included: `speculative_dspark_preset`)."""
    return {f"{CLI_PREFIX}{knob}": value for knob, value in knobs.items()}


def host_kwargs(config: DSparkConfig) -> dict[str, Any]:
    """device and dtype: the config's, else the project's serving defaults for this host (sgl_dspark.tools.launch:
    on a host without CUDA the CPU flags its servers get)."""
    from sgl_dspark.tools.launch import ServerSpec, device_settings

    device = {"device": config.device} if config.device is not None else device_settings()
    return {**device, "dtype": config.dtype or ServerSpec.dtype}


def runs_on_cpu(config: DSparkConfig, cuda: bool) -> bool:
    return config.device == "cpu" or (config.device is None and not cuda)


def engine_kwargs(config: DSparkConfig, drafter: str) -> dict[str, Any]:
    """Every sglang.Engine keyword argument for `config` on this host, with the drafter resolved."""
    return {"model_path": config.model_path, "speculative_algorithm": ALGORITHM,
            "speculative_draft_model_path": drafter, **host_kwargs(config),
            **flag_kwargs(config.dspark_knobs), **config.engine_args}


@dataclass(frozen=True)
class DSparkOutput:
    """One prompt's answer with the article's figures, measured from the engine's own meta_info."""

    text: str
    output_ids: list[int]  # [completion_tokens]
    tokens_per_second: float  # completion tokens / wall seconds of the generate call that produced it
    avg_draft_length: float  # spec_mean_draft_length: draft nodes per verify step before the verify budget, tree
    # and lookup nodes included (0: never drafted)
    acceptance_rate: float  # spec_accept_rate: accepted / verified drafts (0: none verified)
    accept_length: float  # spec_accept_length: tokens per verify step, bonus included (1.0: no verify step)
    meta_info: dict[str, Any]  # SGLang's whole meta_info


def output_of(reply: Mapping[str, Any], wall_s: float) -> DSparkOutput:
    """One sglang.Engine reply ({"text", "output_ids", "meta_info"}) -> the output record. A request without a verify
    step (e.g. one token) has no spec_* keys: its figures are those of plain decoding."""
    meta = dict(reply["meta_info"])
    return DSparkOutput(
        text=reply["text"], output_ids=list(reply["output_ids"]),
        tokens_per_second=meta["completion_tokens"] / wall_s if wall_s > 0 else 0.0,
        avg_draft_length=float(meta.get("spec_mean_draft_length", 0.0)),
        acceptance_rate=float(meta.get("spec_accept_rate", 0.0)),
        accept_length=float(meta.get("spec_accept_length", 1.0)), meta_info=meta)


class DSparkEngine:
    """sglang.Engine serving DSPARK with `config`'s knobs. It spawns SGLang's processes: call `shutdown()` (or use it
    as a context manager). On a CPU host it sets launch.CPU_ENV in this process's environment before SGLang is
    imported (SGLang reads it at import and its processes inherit it)."""

    def __init__(self, config: DSparkConfig):
        from sgl_dspark.tools.launch import CPU_ENV, has_cuda
        from sgl_dspark.tools.models import default_drafter

        if runs_on_cpu(config, has_cuda()):
            os.environ.update(CPU_ENV)
        import sglang

        self.config = config
        drafter = config.draft_model_path or default_drafter(config.model_path)
        check_fits_drafter(config, drafter)
        self._engine = sglang.Engine(**engine_kwargs(config, drafter))

    def generate(self, prompt: str | list[str], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, **sampling: Any) -> DSparkOutput | list[DSparkOutput]:
        """One output per prompt (a list for a list). `sampling`: further SGLang sampling params (top_k, seed,
        stop, ignore_eos, ...). For a list, each output's tokens_per_second is its own tokens over the call's wall
        time (their sum is the batch's throughput)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, **sampling}
        start = time.perf_counter()
        replies = self._engine.generate(prompt=prompt, sampling_params=params)
        wall_s = time.perf_counter() - start
        if isinstance(prompt, str):
            return output_of(replies, wall_s)
        return [output_of(reply, wall_s) for reply in replies]

    def shutdown(self) -> None:
        self._engine.shutdown()

    def __enter__(self) -> "DSparkEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
