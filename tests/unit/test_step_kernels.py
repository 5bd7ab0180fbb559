"""The step's Triton kernels (sgl_dspark.step_kernels) on the CPU: run by Triton's interpreter (in a process of their
own: the interpreter must be on before Triton is imported), each equals its torch twin on the literal example and on
random packed steps, the step's accept stage gives torch's verdict with them, and the whole step (the harness's fake
forward, the real drafter) decodes what plain decoding does with them (tests/kernel_cases.py); compiled by
Triton's CUDA backend for Hopper (sm_90) with no GPU present, each builds to a cubin; `step_ops` keeps torch's ops
on the CPU, checks the kernels against torch before timing them, and picks per op by the timings. tests/gpu runs the
same cases compiled on CUDA."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_dspark import acceptance
from sgl_dspark.step_ops import OPS, TORCH_OPS, OpTiming, StepOps, choose_ops, pick, time_ops

CASES = Path(__file__).resolve().parents[1] / "kernel_cases.py"
CPU = torch.device("cpu")


def test_the_kernels_equal_their_torch_twins_in_tritons_interpreter():
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, str(CASES)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.split()[1::2] == ["literal", "random", "accept-stage", "decode", "warm"], done.stdout


def test_each_kernel_compiles_for_hopper_without_a_gpu():
    """Triton's CUDA backend (its own ptxas) builds each kernel to a cubin for sm_90: the compiled frontend's type
    and shape rules, which the interpreter does not enforce, hold."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = importlib.import_module("sgl_dspark.step_kernels")
    blocks = {"W_BLOCK": 16, "S_BLOCK": 32, "P_BLOCK": 128}
    pointers = {"on_path": "*i1", "mask": "*i1", "accept_lens": "*i32"}
    built = []
    for fn in (kernels._match_walk, kernels._path_rows, kernels._verify_layout):
        for prefix in (True, False) if "PREFIX" in fn.arg_names else (None,):
            constants = {name: blocks.get(name, prefix) for name in fn.arg_names if name in blocks or name == "PREFIX"}
            signature = {name: "constexpr" if name in constants else "i32" if name in ("w", "stride")
                         else pointers.get(name, "*i64") for name in fn.arg_names}
            source = ASTSource(fn=fn, signature=signature,
                               constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
            assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"], fn.__name__
            built.append(fn.__name__)
    assert len(built) == 4


def test_the_cpu_keeps_the_torch_ops():
    ops, timings = choose_ops(CPU)
    assert ops is TORCH_OPS and timings == []


def test_each_op_is_picked_from_its_own_timing():
    fast = StepOps(lambda *a: "fast walk", lambda *a: "fast rows", lambda *a: "fast input", ("triton",) * 3)
    ops = pick([OpTiming("matched_path", 2.0, 1.0), OpTiming("path_rows", 1.0, 2.0), OpTiming("verify_input", 3, 1)],
               fast)
    assert ops.names == ("triton", "torch", "triton")
    assert (ops.matched_path, ops.path_rows, ops.verify_input) == (fast.matched_path, TORCH_OPS.path_rows,
                                                                   fast.verify_input)


def test_the_timing_checks_the_fast_ops_against_torch_first():
    timings = time_ops(TORCH_OPS, TORCH_OPS, CPU)
    assert [t.op for t in timings] == list(OPS) and all(t.torch_ms > 0 and t.triton_ms > 0 for t in timings)
    wrong = StepOps(TORCH_OPS.matched_path, lambda t, on, c, s: acceptance.path_rows(t, on, c + 1, s),
                    TORCH_OPS.verify_input)
    with pytest.raises(RuntimeError, match="path_rows disagrees"):
        time_ops(TORCH_OPS, wrong, CPU)
