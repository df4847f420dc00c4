"""Compiling the NVIDIA kernels for sm_90 without a GPU (CI has none): Triton's own ptxas and
cuobjdump, in a subprocess, since TRITON_INTERPRET (set for the test process, conftest.py) is read
when a kernel is decorated. What this catches that the interpreter cannot: bf16 / fp8 code paths,
layouts, register pressure (spills to the stack)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Run before a test's script body: resources(kernel, pointers, consts, num_warps, num_stages=None)
# compiles one kernel (arguments not in ``pointers`` or ``consts`` are i32) and returns its (stack
# bytes, registers a thread); build(...) its stack bytes (0: no spills); spills(...) appends a
# line to ``failed`` for a kernel that spills.
PRELUDE = r'''
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
failed = []

def resources(kernel, pointers, consts, num_warps, num_stages=None):
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in kernel.arg_names}
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    k = triton.compile(ASTSource(kernel, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1)), int(re.search(r"REG:(\d+)", usage).group(1))

def build(kernel, pointers, consts, num_warps, num_stages=None):
    return resources(kernel, pointers, consts, num_warps, num_stages)[0]

def spills(kernel, pointers, consts, num_warps, num_stages=None):
    stack = build(kernel, pointers, consts, num_warps, num_stages)
    if stack:
        failed.append(f"{kernel.__name__} {consts}: spills ({stack} stack bytes)")
'''
EPILOGUE = '''
print("\\n".join(failed))
sys.exit(1 if failed else 0)
'''


def compile_sm90(body: str) -> None:
    """Run PRELUDE + ``body`` + EPILOGUE in a subprocess that compiles (does not interpret); the
    test fails with its output when ``body`` leaves anything in ``failed``. Skips where this
    Triton has no NVIDIA backend binaries."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this triton has no NVIDIA backend binaries (ptxas, cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", PRELUDE + body + EPILOGUE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
