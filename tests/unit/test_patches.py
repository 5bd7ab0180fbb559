"""The SGLang seam: named patches (idempotent, undoable, refusing drift), the DSPARK name, flags, launch plan."""

import argparse
import json
import pickle
import sys
import types
from pathlib import Path

import pytest
import sglang
from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolving_view
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from scheduler_patch import algorithm, audit, errors, plugin, target_gemm
from scheduler_patch import server_args as dspark_args
from scheduler_patch.backends import TORCH_BACKEND
from scheduler_patch.errors import StartupError
from scheduler_patch.launch import LAUNCH_ATTR, launch_of
from scheduler_patch.patches import Patch, PatchDriftError, apply_all, undo_all
from sgl_dspark.config import load_config
from sgl_dspark.drafter import save_drafter
from fixture_drafters import tiny_hf_config
from sgl_dspark.drafter.fresh import random_drafter

FAKE = "fake_sglang_upstream"


def _around_plus_one(original, *args, **kwargs):
    return original(*args, **kwargs) + 1


@pytest.fixture
def fake_upstream():
    module = types.ModuleType(FAKE)

    def add(a, b):
        return a + b

    class Thing:
        def method(self, x):
            return x

        @classmethod
        def make(cls, name):
            return len(name)

        @staticmethod
        def static(x):
            return x * 2

        Part = int  # a class attribute holding a class, called through instances

    module.add, module.Thing = add, Thing
    sys.modules[FAKE] = module
    yield module
    del sys.modules[FAKE]


@pytest.mark.parametrize("target, kind, params, call, expected", [
    ("add", "function", ("a", "b"), lambda m: m.add(1, 2), 4),
    ("Thing.method", "method", ("self", "x"), lambda m: m.Thing().method(5), 6),
    ("Thing.make", "classmethod", ("cls", "name"), lambda m: m.Thing.make("abc"), 4),
    ("Thing.static", "staticmethod", ("x",), lambda m: m.Thing.static(3), 7),
    ("Thing.Part", "class", None, lambda m: m.Thing().Part(5), 6),
])
def test_apply_is_idempotent_and_undo_restores_the_original(fake_upstream, target, kind, params, call, expected):
    owner, attr = (f"{FAKE}.{target}").rsplit(".", 1)
    holder = fake_upstream if owner == FAKE else fake_upstream.Thing
    original = vars(holder)[attr]
    patch = Patch("test.plus_one", f"{FAKE}.{target}", kind, params, _around_plus_one)
    patch.apply()
    installed = vars(holder)[attr]
    patch.apply()
    assert vars(holder)[attr] is installed and patch.applied
    assert call(fake_upstream) == expected
    patch.undo()
    patch.undo()
    assert vars(holder)[attr] is original and not patch.applied
    assert call(fake_upstream) == expected - 1


@pytest.mark.parametrize("target, kind, params, complaint", [
    ("add", "function", ("a", "c"), "has parameters ('a', 'b'), expected ('a', 'c')"),
    ("Thing.make", "staticmethod", ("cls", "name"), "is a classmethod, expected a staticmethod"),
    ("gone", "function", ("a",), "is missing"),
    ("Nowhere.add", "function", ("a",), "cannot be resolved"),
])
def test_drift_is_refused_with_a_message_naming_the_symbol(fake_upstream, target, kind, params, complaint):
    patch = Patch("test.drift", f"{FAKE}.{target}", kind, params, _around_plus_one)
    with pytest.raises(PatchDriftError) as info:
        patch.apply()
    assert f"{FAKE}.{target}" in str(info.value) and complaint in str(info.value)
    assert "test.drift" in str(info.value)


def test_apply_all_checks_every_patch_before_applying_any(fake_upstream):
    good = Patch("test.good", f"{FAKE}.add", "function", ("a", "b"), _around_plus_one)
    bad = Patch("test.bad", f"{FAKE}.add", "function", ("x",), _around_plus_one)
    with pytest.raises(PatchDriftError, match="test.bad"):
        apply_all([good, bad])
    assert not good.applied and fake_upstream.add(1, 2) == 3


def test_a_requirement_that_fails_is_drift(fake_upstream):
    patch = Patch("test.req", f"{FAKE}.add", "function", ("a", "b"), _around_plus_one,
                  requires=lambda: "upstream.thing moved")
    with pytest.raises(PatchDriftError, match="test.req: upstream.thing moved"):
        patch.apply()


@pytest.fixture
def plugin_patches():
    apply_all(plugin.PATCHES)
    yield
    undo_all(plugin.PATCHES)


def test_every_plugin_patch_fits_the_pinned_sglang():
    for patch in (*plugin.PATCHES, *target_gemm.PATCHES):  # target_gemm's: applied by the worker, where used
        patch.check()
    assert algorithm.undecided_methods() is None
    assert dspark_args.missing_fields() is None and dspark_args.bookkeeping_pickles() is None
    assert dspark_args.flag_clash() is None


def test_from_string_returns_our_spec_after_apply_and_the_builtin_after_undo():
    algorithm.FROM_STRING.apply()
    try:
        ours = SpeculativeAlgorithm.from_string("DSPARK")
        assert ours is algorithm.spec() and SpeculativeAlgorithm.from_string("dspark") is ours
        assert SpeculativeAlgorithm.from_string("EAGLE") is SpeculativeAlgorithm.EAGLE
        assert SpeculativeAlgorithm.from_string(None) is SpeculativeAlgorithm.NONE
    finally:
        algorithm.FROM_STRING.undo()
    assert SpeculativeAlgorithm.from_string("DSPARK") is SpeculativeAlgorithm.DSPARK


def test_our_spec_takes_no_builtin_dspark_rule():
    ours = algorithm.spec()
    assert ours.name == "DSPARK" and ours.is_speculative() and not ours.is_none()
    assert not (ours.is_dspark() or ours.is_dflash_family() or ours.supports_ragged_verify())
    assert not (ours.has_draft_kv() or ours.need_topk() or ours.carries_draft_hidden_states())
    assert ours.get_platform_worker_cls() is None and not ours.supports_overlap


def test_the_builtin_implementation_can_have_the_name_back():
    """SGL_DSPARK_IMPL=builtin: no DSPARK patch applies (the name, flags, launch and metrics stay SGLang's); a CPU
    launch is refused with one line; a typo is one line too."""
    builtin = plugin.patches_for("builtin")
    assert plugin.patches_for("plugin") == plugin.PATCHES
    assert not {p.name for p in builtin} & {p.name for p in (*algorithm.PATCHES, *dspark_args.PATCHES)}
    for patch in builtin:
        patch.check()
    apply_all(builtin)
    try:
        assert SpeculativeAlgorithm.from_string("DSPARK") is SpeculativeAlgorithm.DSPARK
        record = ServerArgs(model_path="m", speculative_algorithm="DSPARK", device="cpu")
        with pytest.raises(StartupError, match="SGL_DSPARK_IMPL=builtin .* runs on CUDA/NPU/XPU only"):
            record.resolve_once()
    finally:
        undo_all(builtin)
    with pytest.raises(SystemExit, match="SGL_DSPARK_IMPL='buitin'"):
        plugin.patches_for("buitin")


def test_startup_error_prints_one_line_and_other_errors_go_to_the_previous_hook(capsys):
    seen = []
    errors._excepthook(lambda *a: seen.append(a), StartupError, StartupError("knob x:\n bad"), None)
    assert capsys.readouterr().err == "sgl-dspark: error: knob x: bad\n" and not seen
    other = RuntimeError("boom")
    errors._excepthook(lambda *a: seen.append(a), RuntimeError, other, None)
    assert seen == [(RuntimeError, other, None)]


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_flags_parse_into_overrides_that_survive_pickling(plugin_patches):
    record = parse(["--model-path", "m", "--speculative-dspark-preset", "tree", "--speculative-dspark-max-window",
                    "3", "--speculative-dspark-survival-threshold", "0.25", "--speculative-dspark-lookup", "false"])
    flags = {"speculative_dspark_preset": "tree", "speculative_dspark_max_window": 3,
             "speculative_dspark_survival_threshold": 0.25, "speculative_dspark_lookup": False}
    assert record._dspark_flags == flags
    assert pickle.loads(pickle.dumps(record))._dspark_flags == flags
    config = dspark_args._config(flags)
    assert config == load_config("tree", {"max_window": 3, "survival_threshold": 0.25, "lookup": False})


def test_engine_keyword_knobs_ride_on_the_record_like_flags(plugin_patches):
    """sglang.Engine(**kwargs) builds its ServerArgs through Engine.server_args_class; our knobs are taken out of
    the keywords (ServerArgs would refuse them) and kept as the CLI's flags are."""
    from sglang.srt.entrypoints.engine import Engine

    record = Engine.server_args_class(model_path="m", speculative_dspark_lookup=True,
                                      speculative_dspark_preset="tree", speculative_dspark_max_window=None)
    assert isinstance(record, ServerArgs) and record.model_path == "m"
    assert record._dspark_flags == {"speculative_dspark_lookup": True, "speculative_dspark_preset": "tree"}
    assert not hasattr(Engine.server_args_class(model_path="m"), dspark_args.FLAGS_ATTR)
    with pytest.raises(TypeError, match="speculative_dspark_lookupp"):
        Engine.server_args_class(model_path="m", speculative_dspark_lookupp=True)


def test_no_flags_leave_no_bookkeeping(plugin_patches):
    assert not hasattr(parse(["--model-path", "m"]), dspark_args.FLAGS_ATTR)


def test_a_bad_boolean_is_refused_by_the_parser(plugin_patches, capsys):
    with pytest.raises(SystemExit):
        parse(["--model-path", "m", "--speculative-dspark-lookup", "maybe"])
    assert "expected true or false" in capsys.readouterr().err


@pytest.mark.parametrize("flags, knob", [
    ({"speculative_dspark_max_window": 0}, "max_window=0"),
    ({"speculative_dspark_budget": "greedy"}, "budget='greedy'"),
    ({"speculative_dspark_preset": "nope"}, "preset 'nope' not found"),
    ({"speculative_dspark_cost_table": "/no/such.json"}, "cost_table='/no/such.json': no such file"),
    ({"speculative_dspark_cost_table_out": "/no/such/c.json"}, "cost_table_out='/no/such/c.json': no such directory"),
])
def test_a_bad_knob_raises_one_line_naming_it(flags, knob):
    with pytest.raises(StartupError) as info:
        dspark_args._config(flags)
    assert knob in str(info.value) and "\n" not in str(info.value)


# --- the launch plan, on a tiny local target (config.json only) and a tiny random drafter -----------------

@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("target")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "vocab_size": 50,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}))
    return folder


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    return {name: save_drafter(random_drafter(tiny_hf_config(**overrides))[0], root / name)
            for name, overrides in {"fits": {}, "wide": {"hidden_size": 64, "head_dim": 16},
                                    "vocab": {"vocab_size": 60, "mask_token_id": 59}}.items()}


def record(target: Path, drafter: Path | str | None, flags: dict | None = None, **fields) -> ServerArgs:
    fields.setdefault("device", "cpu")
    args = ServerArgs(model_path=str(target), speculative_algorithm="DSPARK",
                      speculative_draft_model_path=None if drafter is None else str(drafter), **fields)
    if flags:
        args._dspark_flags = flags
    return args


def test_prepare_declares_what_sglang_needs(target, drafters):
    args = record(target, drafters["fits"], {"speculative_dspark_preset": "tree"})
    launch = dspark_args.prepare(args)
    view = resolving_view(args)
    # tiny drafter: gamma 4; tree preset: max_tree_nodes 16 -> anchor + 16
    assert launch.draft_nodes == 16 and view.speculative_num_draft_tokens == 17
    assert (view.speculative_num_steps, view.speculative_eagle_topk) == (1, 1)
    assert view.disable_overlap_schedule is True and view.enable_mixed_chunk is False
    assert view.attention_backend == TORCH_BACKEND
    assert launch_of(pickle.loads(pickle.dumps(args))) == launch


@pytest.mark.parametrize("device, decode_backend", [("cuda", "disabled"), ("cpu", "full")])
def test_sglangs_decode_graph_capture_is_off_for_dspark_on_cuda_only(target, drafters, device, decode_backend):
    """SGLang's own resolution of the CUDA-graph config (parse_cuda_graph_config) after DSPARK's prepare: on CUDA the
    decode phase's backend is DISABLED, the condition under which SGLang's capture_decode_graph returns before
    capturing its TARGET_VERIFY graph (checked in its source, so a change upstream fails here); on CPU the field is
    SGLang's default (CPU graphs follow --enable-torch-compile there)."""
    import inspect
    import re

    from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup

    args = record(target, drafters["fits"], device=device)
    dspark_args.prepare(args)
    parse_cuda_graph_config(args)
    assert resolving_view(args).cuda_graph_config.decode.backend == decode_backend
    source = re.sub(r"\s+", "", inspect.getsource(cuda_graph_setup.capture_decode_graph))
    assert ('ifmodel_runner.device!="cpu"andcheck_cuda_graph_backend(Phase.DECODE,Backend.DISABLED):returnno_capture'
            in source)


def test_max_verify_caps_the_verify_tokens(target, drafters):
    launch = dspark_args.prepare(record(target, drafters["fits"], {"speculative_dspark_max_verify": 2}))
    assert launch.verify_tokens == 3


def test_prepare_reads_the_drafter_the_calibration_and_the_cost_table_into_the_launch(target, drafters, tmp_path):
    calibration, table = tmp_path / "cal.json", tmp_path / "cost.json"
    calibration.write_text(json.dumps({"temperatures": [1.5, 2.0]}))
    table.write_text(json.dumps({"tokens": [1, 8], "seconds": [0.05, 0.08]}))
    launch = dspark_args.prepare(record(target, drafters["fits"], {"speculative_dspark_calibration": str(calibration),
                                                                   "speculative_dspark_cost_table": str(table)}))
    assert launch.drafter.gamma == 4 and launch.drafter_path == str(drafters["fits"])
    assert launch.draft_knobs.confidence_temperatures == (1.5, 2.0)
    assert launch.cost_table.tokens == (1, 8)


def test_a_bad_cost_table_is_refused_at_start_up(target, drafters, tmp_path):
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({"tokens": [1]}))
    with pytest.raises(StartupError, match="step-cost table .*'tokens' and 'seconds'"):
        dspark_args.prepare(record(target, drafters["fits"], {"speculative_dspark_cost_table": str(table)}))


def test_our_handle_server_args_redeclares_through_sglangs_recorder(target, drafters):
    args = record(target, drafters["fits"])
    launch = dspark_args.prepare(args)
    record_foreign_defaults(args, "test.custom_algo", algorithm.spec().handle_server_args)
    assert args._resolved_overrides[-1] == ("test.custom_algo", launch.server_fields())


@pytest.mark.parametrize("drafter, flags, fields, cause", [
    (None, None, {}, "--speculative-draft-model-path is required"),
    ("/no/such/drafter", None, {}, "--speculative-draft-model-path /no/such/drafter: no such directory"),
    ("wide", None, {}, "does not fit the target model: hidden_size: drafter has 64, target has 32"),
    ("vocab", None, {}, "does not fit the target model: vocab_size: drafter vocabulary has 60 tokens"),
    ("fits", {"speculative_dspark_max_window": 9}, {}, "max_window 9 / min_window 1 exceed the drafter's gamma 4"),
    ("fits", None, {"pp_size": 2}, "--pp-size > 1 is not supported"),
    ("fits", None, {"enable_lora": True}, "--enable-lora / --lora-paths is not supported"),
    ("fits", None, {"enable_dp_attention": True}, "--enable-dp-attention is not supported"),
    ("fits", None, {"enable_return_hidden_states": True}, "--enable-return-hidden-states / --return-hidden-states"),
    ("fits", None, {"attention_backend": "torch_native"}, "--attention-backend torch_native: DSPARK on CPU"),
    ("fits", None, {"speculative_num_draft_tokens": 3}, "--speculative-num-draft-tokens 3 conflicts"),
    ("fits", None, {"device": "cuda", "cuda_graph_backend_decode": "full"}, "--cuda-graph-backend-decode full"),
    ("fits", None, {"speculative_dspark_sps_table_path": "t.json"}, "--speculative-dspark-sps-table-path belongs to"),
])
def test_prepare_refuses_with_one_line_naming_the_cause(target, drafters, drafter, flags, fields, cause):
    path = drafters.get(drafter, drafter)
    args = record(target, path, flags, **fields)
    with pytest.raises(StartupError) as info:
        dspark_args.prepare(args)
    assert cause in str(info.value) and "\n" not in str(info.value)
    assert not hasattr(args, LAUNCH_ATTR)


def test_a_record_without_a_plan_is_refused():
    with pytest.raises(RuntimeError, match="no DSpark launch plan"):
        launch_of(ServerArgs(model_path="m"))


def test_the_dspark_audit_matches_the_installed_sglang():
    found = audit.dspark_references(Path(sglang.__file__).parent)
    changed = {site: (found.get(site), audit.SITES.get(site)) for site in set(found) | set(audit.SITES)
               if found.get(site) != audit.SITES.get(site)}
    assert not changed, f"SGLang's DSPARK references changed (found, audited): {changed}; audit them in audit.py"
