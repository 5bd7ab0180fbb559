"""Entry point of the `sglang.srt.plugins` group: runs in SGLang's main, scheduler and detokenizer processes.

It announces itself on stderr (one line, so every process shows it ran; SGLang configures logging only
after plugins load in some processes), applies the named patches (all checked before any is applied; SGLang
drift ends the process with one line, since a half-patched SGLang would hand DSPARK to the builtin) and
registers the attention backends. $SGL_DSPARK_IMPL=builtin hands the name DSPARK back to SGLang's builtin
implementation (where it can run) and applies only the patches that are not about DSPARK. With no DSPARK
requested, the patches that change SGLang's behaviour refuse prompts the model cannot run (request_checks.py: a 400
instead of a dead server) and let tensor parallelism start on a CPU (cpu_parallel.py).
"""

import os
import sys

import sgl_dspark
from scheduler_patch import algorithm, cpu_parallel, errors, metrics, request_checks, server_args
from scheduler_patch.backends import register_attention_backends
from scheduler_patch.patches import PatchDriftError, apply_all

ANNOUNCE = "sgl-dspark plugin loaded"
PATCHES = (*algorithm.PATCHES, *server_args.PATCHES, *errors.PATCHES, *metrics.PATCHES, *request_checks.PATCHES,
           *cpu_parallel.PATCHES)
IMPL_ENV = "SGL_DSPARK_IMPL"  # "plugin" (default): DSPARK is sgl-dspark's; "builtin": SGLang's own (CUDA/NPU/XPU)
# With the name handed back, only what is not about DSPARK stays: the prompt checks, the one-line start-up errors,
# and the refusal of the builtin where it cannot run.
BUILTIN_PATCHES = (*errors.PATCHES, *request_checks.PATCHES, *cpu_parallel.PATCHES,
                   server_args.BUILTIN_WHERE_IT_RUNS)


def patches_for(impl: str) -> tuple:
    """The patches one process applies for the implementation the user chose ($SGL_DSPARK_IMPL)."""
    if impl == "plugin":
        return PATCHES
    if impl == "builtin":
        return BUILTIN_PATCHES
    raise SystemExit(f"{errors.PREFIX}{IMPL_ENV}={impl!r}: expected 'plugin' (sgl-dspark's DSPARK, the default) or "
                     f"'builtin' (SGLang's own DSPARK, CUDA/NPU/XPU only)")


def process_role() -> str:
    """The SGLang process we run in, read off the caller (`run_scheduler_process` -> "scheduler")."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_name
        if name.startswith("run_") and name.endswith("_process"):
            return name[len("run_"):-len("_process")]
        frame = frame.f_back
    return "main"


def load() -> None:
    impl = os.environ.get(IMPL_ENV, "plugin")
    print(f"{ANNOUNCE}: version={sgl_dspark.__version__} process={process_role()} pid={os.getpid()} "
          f"dspark={impl} from={os.path.dirname(sgl_dspark.__file__)}", file=sys.stderr, flush=True)
    try:
        apply_all(patches_for(impl))
    except PatchDriftError as e:
        raise SystemExit(f"{errors.PREFIX}{e}") from e
    register_attention_backends()
