"""DSPARK server arguments: the `--speculative-dspark-*` flags and the launch plan, resolved once in the main process.

Patches: `dspark.cli_flags` adds `--speculative-dspark-preset` and one flag per DSparkKnobs knob to SGLang's
parser; `dspark.cli_values` keeps the given ones on the ServerArgs record (`_dspark_flags`: bookkeeping, which
ServerArgs pickles to the scheduler); `dspark.resolve` runs `prepare` before SGLang's resolution pipeline: build
the config, refuse what we do not support, read and check the drafter against the target, read the calibration
and the cost table (StartupError, one line naming the flag or field), declare the fields SGLang needs, and attach
the launch record (launch.py: `_dspark_launch`, read by `launch_of`). Must not load weights or create workers.
"""

import argparse
import dataclasses
import logging
import typing
from pathlib import Path
from typing import Any

from sgl_dspark.calibration import drafter_calibration
from sgl_dspark.config import KNOBS, PRESET_KNOB, RULES, DSparkKnobs, cli_flag, config_from_flags
from sgl_dspark.cost import StepCostTable, load_cost_table
from sgl_dspark.drafter.checkpoint import CONFIG_FILE, read_drafter_config, weight_files
from sgl_dspark.drafter.config import DrafterConfig, TargetSpec, check_fits_target

from scheduler_patch.audit import REFUSAL_FIELDS, UNSUPPORTED
from scheduler_patch.backends import FLASHINFER_BACKEND, TORCH_BACKEND
from scheduler_patch.errors import StartupError
from scheduler_patch.launch import LAUNCH_ATTR, NAME, DSparkLaunch
from scheduler_patch.patches import Patch

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
SOURCE = "sgl_dspark.prepare"  # the declaration source SGLang records for our field decisions
FLAGS_ATTR = "_dspark_flags"
DEFAULT_BACKENDS = {"cpu": TORCH_BACKEND, "cuda": FLASHINFER_BACKEND}  # tree verification on each device
BACKEND_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
PATH_KNOBS = ("cost_table", "calibration", "draft_vocab")
FLAG_DESTS = tuple(cli_flag(k)[2:].replace("-", "_") for k in (PRESET_KNOB, *KNOBS))
BUILTIN_PREFIX = "speculative_dspark_"  # SGLang's own fields for its builtin DSPARK share our flag prefix
logger = logging.getLogger(__name__)


def wants_dspark(server_args: Any) -> bool:
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    # --enable-return-aux-hidden-states uses the name only as SGLang's capture convention (speculation off).
    return str(cfg.speculative_algorithm).upper() == NAME and not cfg.enable_return_aux_hidden_states


def prepare(record: Any) -> DSparkLaunch:
    """Resolve DSPARK on the raw record, before SGLang's pipeline; StartupError names what is wrong."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(record)
    _refuse_unsupported(cfg)
    _refuse_builtin_flags(cfg)
    device = _device(cfg)
    root = _drafter_dir(cfg.speculative_draft_model_path)
    config = _config(getattr(record, FLAGS_ATTR, None) or {}, root)
    drafter = _drafter(root, _target(cfg))
    launch = _launch(config, cfg.speculative_draft_model_path, drafter, _attention_backend(cfg, device), device)
    _refuse_conflicts(cfg, launch)
    if cfg.enable_mixed_chunk:
        logger.warning("sgl-dspark: --enable-mixed-chunk is turned off for DSPARK")
    if device != "cpu":
        logger.info("sgl-dspark: decode runs without CUDA graphs under DSPARK (its verify batch changes shape every "
                    "step); prefill keeps SGLang's setting")
    declare_resolution(record, SOURCE, **launch.server_fields())
    setattr(record, LAUNCH_ATTR, launch)  # bookkeeping: allowed on the sealed record, kept by its pickling
    logger.info("sgl-dspark: DSPARK on %s, %d verify tokens per request, %s", device, launch.verify_tokens, config)
    return launch


def _config(flags: dict[str, Any], drafter_dir: Path | None = None) -> DSparkKnobs:
    """The knobs: configs/default.json <- the drafter folder's recommended.json <- the preset <- the flags."""
    try:
        config = config_from_flags(flags, drafter_dir)
    except ValueError as e:
        raise StartupError(str(e)) from e
    for knob in PATH_KNOBS:
        value = getattr(config, knob)
        if value is not None and not Path(value).is_file():
            raise StartupError(f"DSpark config: {knob}={value!r}: no such file (set by {cli_flag(knob)} or the preset)")
    out = config.cost_table_out
    if out is not None and not Path(out).resolve().parent.is_dir():
        raise StartupError(f"DSpark config: cost_table_out={out!r}: no such directory to write it in (set by "
                           f"{cli_flag('cost_table_out')} or the preset)")
    return config


def _refuse_unsupported(cfg: Any) -> None:
    for refusal in UNSUPPORTED:
        if refusal.applies(cfg):
            raise StartupError(f"{refusal.flag} is not supported with --speculative-algorithm DSPARK (sgl-dspark): "
                               f"{refusal.why}")


def _refuse_builtin_flags(cfg: Any) -> None:
    """The builtin DSPARK's own `--speculative-dspark-*` fields would be silently ignored; refuse them instead."""
    import msgspec
    from sglang.srt.server_args import ServerArgs

    for field in msgspec.structs.fields(ServerArgs):
        if field.name.startswith(BUILTIN_PREFIX) and getattr(cfg, field.name) != field.default:
            raise StartupError(f"{_flag(field.name)} belongs to SGLang's builtin DSPARK; sgl-dspark's knobs are "
                               f"the --speculative-dspark-* flags listed under 'DSpark (sgl-dspark plugin)' in --help")


def _device(cfg: Any) -> str:
    device = (cfg.device or _host_device()).split(":")[0]
    if device not in DEFAULT_BACKENDS:
        raise StartupError(f"--device {device}: sgl-dspark's DSPARK runs on {' or '.join(DEFAULT_BACKENDS)}")
    return device


def _drafter_dir(path: str | None) -> Path:
    flag = "--speculative-draft-model-path"
    if path is None:
        raise StartupError(f"{flag} is required with --speculative-algorithm DSPARK (a DSpark drafter folder)")
    root = Path(path)
    if not root.is_dir():
        raise StartupError(f"{flag} {path}: no such directory (expected a local DSpark drafter folder with "
                           f"{CONFIG_FILE} and *.safetensors)")
    if not (root / CONFIG_FILE).is_file():
        raise StartupError(f"{flag} {path}: no {CONFIG_FILE} in the folder")
    if not weight_files(root):
        raise StartupError(f"{flag} {path}: no *.safetensors (or *.safetensors.xz) weights in the folder")
    return root


def _target(cfg: Any) -> TargetSpec:
    from sglang.srt.utils.hf_transformers_utils import get_config

    try:
        hf = get_config(cfg.model_path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        return TargetSpec.from_hf_config(hf.to_dict())
    except Exception as e:  # any failure to read the target is reported as one line naming the flag
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StartupError(f"--model-path {cfg.model_path}: cannot read the target's config ({cause})") from e


def _drafter(root: Path, target: TargetSpec) -> DrafterConfig:
    try:
        drafter = read_drafter_config(root)
    except (ValueError, TypeError, KeyError) as e:
        raise StartupError(f"--speculative-draft-model-path {root}: {CONFIG_FILE}: {e}") from e
    try:
        check_fits_target(drafter, target)
    except ValueError as e:
        raise StartupError(f"--speculative-draft-model-path {root} does not fit the target model: {e}") from e
    return drafter


def _launch(config: DSparkKnobs, drafter_path: str, drafter: DrafterConfig, backend: str | None,
            device: str) -> DSparkLaunch:
    calibration, table = _calibration(config, drafter_path), _cost_table(config)
    try:
        return DSparkLaunch.of(config, drafter_path, drafter, backend, calibration, table, device)
    except ValueError as e:
        raise StartupError(f"DSpark config does not fit the drafter (block_size {drafter.gamma}): {e}") from e


def _calibration(config: DSparkKnobs, drafter_path: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    try:
        return drafter_calibration(config.calibration, drafter_path)
    except ValueError as e:
        raise StartupError(f"DSpark config: {e}") from e


def _cost_table(config: DSparkKnobs) -> StepCostTable | None:
    try:
        return load_cost_table(config.cost_table) if config.cost_table else None
    except ValueError as e:
        raise StartupError(f"DSpark config: {e}") from e


def _attention_backend(cfg: Any, device: str) -> str | None:
    """Our tree-verify backend unless the user chose one; on CPU nothing else verifies a tree."""
    ours = DEFAULT_BACKENDS[device]
    chosen = {name: getattr(cfg, name) for name in BACKEND_FIELDS if getattr(cfg, name) is not None}
    for name, value in chosen.items():
        if device == "cpu" and value != ours:
            raise StartupError(f"{_flag(name)} {value}: DSPARK on CPU verifies with {ours} (the CPU backend with "
                               f"tree verification); drop the flag or pass {ours}")
    return None if chosen else ours


def _refuse_conflicts(cfg: Any, launch: DSparkLaunch) -> None:
    """Explicit SGLang speculative sizes must agree with what the DSpark knobs imply."""
    ours = {"speculative_num_draft_tokens": launch.verify_tokens, "speculative_num_steps": 1,
            "speculative_eagle_topk": 1}
    graphs = cfg.cuda_graph_backend_decode
    if launch.device != "cpu" and graphs is not None and graphs != "disabled":
        raise StartupError(f"--cuda-graph-backend-decode {graphs} conflicts with DSPARK, whose decode step runs "
                           f"without CUDA graphs (its verify batch changes shape every step); drop the flag")
    for name, value in ours.items():
        given = getattr(cfg, name)
        if given is not None and int(given) != value:
            raise StartupError(f"{_flag(name)} {given} conflicts with DSPARK, which sets {value} (the anchor plus at "
                               f"most {launch.draft_nodes} draft nodes, from the --speculative-dspark-* knobs); "
                               f"drop the flag")


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


# --- the command line ---------------------------------------------------------------------------------------

def add_flags(parser: argparse.ArgumentParser) -> None:
    """`--speculative-dspark-preset` and one flag per knob, all default None (defaults live in configs/)."""
    group = parser.add_argument_group("DSpark (sgl-dspark plugin)",
                                      "Knobs of --speculative-algorithm DSPARK; unset flags take the preset's value.")
    group.add_argument(cli_flag(PRESET_KNOB), type=str, default=None, metavar="NAME_OR_PATH",
                       help="A preset in sgl-dspark's configs/ (default, chain, tree, ...) or a JSON file of knobs.")
    for field in dataclasses.fields(DSparkKnobs):
        group.add_argument(cli_flag(field.name), type=_arg_type(field.type), default=None,
                           help=f"DSpark knob {field.name}: {RULES[field.name][1]}.")


def given_flags(namespace: dict[str, Any]) -> dict[str, Any]:
    """Parsed argparse values -> the `--speculative-dspark-*` flags that were given (dest -> value)."""
    return {dest: namespace[dest] for dest in FLAG_DESTS if namespace.get(dest) is not None}


def _arg_type(annotation: Any):
    kinds = [t for t in typing.get_args(annotation) if t is not type(None)] or [annotation]
    return _boolean if kinds[0] is bool else kinds[0]


def _boolean(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


# --- the patches --------------------------------------------------------------------------------------------

def _add_cli_args(original, parser):
    original(parser)
    add_flags(parser)


def _from_cli_args(original, args):
    record = original(args)
    flags = given_flags(vars(args))
    if flags:
        setattr(record, FLAGS_ATTR, flags)
    return record


def _resolve_once(original, record):
    fresh = not getattr(record, "_resolution_finished", False) and getattr(record, LAUNCH_ATTR, None) is None
    if fresh and wants_dspark(record):
        prepare(record)
    elif fresh and getattr(record, FLAGS_ATTR, None):
        logger.warning("sgl-dspark: --speculative-dspark-* flags are ignored without --speculative-algorithm DSPARK")
    return original(record)


USED_FIELDS = ("speculative_algorithm", "disable_overlap_schedule", "speculative_num_draft_tokens",
               "speculative_num_steps", "speculative_eagle_topk", "enable_mixed_chunk", "device", "model_path",
               "cuda_graph_backend_decode",
               "revision", "trust_remote_code", "speculative_draft_model_path", "enable_return_aux_hidden_states",
               *BACKEND_FIELDS, *REFUSAL_FIELDS)


def missing_fields() -> str | None:
    from sglang.srt.arg_groups.arg_utils import field_names
    from sglang.srt.server_args import ServerArgs

    missing = sorted(set(USED_FIELDS) - set(field_names(ServerArgs)))
    return f"{SERVER_ARGS} lacks the fields {missing}" if missing else None


def flag_clash() -> str | None:
    """Our flags share the builtin's `--speculative-dspark-` prefix; a new upstream field must not take a name."""
    from sglang.srt.arg_groups.arg_utils import field_names
    from sglang.srt.server_args import ServerArgs

    clash = sorted(set(FLAG_DESTS) & set(field_names(ServerArgs)))
    return f"{SERVER_ARGS} now has fields named like our flags: {clash}" if clash else None


def bookkeeping_pickles() -> str | None:
    """Our attributes reach the scheduler only because ServerArgs pickles its __dict__ (its own __reduce__)."""
    from sglang.srt.server_args import ServerArgs

    return None if "__reduce__" in vars(ServerArgs) else f"{SERVER_ARGS}.__reduce__ is gone (bookkeeping pickling)"


def _engine_server_args(original, *args, **kwargs):
    """`sglang.Engine(..., speculative_dspark_<knob>=V)`: the knobs as keyword arguments, kept on the record as the
    CLI's flags are and validated by the same `prepare` (one line naming the knob)."""
    flags = given_flags({name: kwargs.pop(name) for name in list(kwargs) if name in FLAG_DESTS})
    record = original(*args, **kwargs)
    if flags:
        setattr(record, FLAGS_ATTR, flags)
    return record


CLI_FLAGS = Patch("dspark.cli_flags", f"{SERVER_ARGS}.add_cli_args", "staticmethod", ("parser",), _add_cli_args,
                  requires=flag_clash)
CLI_VALUES = Patch("dspark.cli_values", f"{SERVER_ARGS}.from_cli_args", "classmethod", ("cls", "args"),
                   _from_cli_args, requires=bookkeeping_pickles)
RESOLVE = Patch("dspark.resolve", f"{SERVER_ARGS}.resolve_once", "method", ("self",), _resolve_once,
                requires=missing_fields)
def _builtin_where_it_runs(original, record):
    """SGL_DSPARK_IMPL=builtin: SGLang's own DSPARK resolves the launch; refused on a CPU, where it cannot run."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(record)
    fresh = not getattr(record, "_resolution_finished", False)
    if fresh and wants_dspark(record) and (cfg.device or _host_device()).split(":")[0] == "cpu":
        raise StartupError("SGL_DSPARK_IMPL=builtin hands DSPARK to SGLang's builtin implementation, which runs on "
                           "CUDA/NPU/XPU only; unset SGL_DSPARK_IMPL to serve DSPARK with sgl-dspark on this CPU")
    return original(record)


def _host_device() -> str:
    from sglang.srt.utils.common import get_device

    return get_device()


BUILTIN_WHERE_IT_RUNS = Patch("dspark.builtin_where_it_runs", f"{SERVER_ARGS}.resolve_once", "method", ("self",),
                              _builtin_where_it_runs, requires=missing_fields)
ENGINE_ARGS = Patch("dspark.engine_args", "sglang.srt.entrypoints.engine.Engine.server_args_class", "class", None,
                    _engine_server_args, requires=bookkeeping_pickles)
PATCHES = (CLI_FLAGS, CLI_VALUES, RESOLVE, ENGINE_ARGS)
