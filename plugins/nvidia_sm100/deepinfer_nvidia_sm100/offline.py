"""Triton kernels compiled for an NVIDIA GPU on a machine without one, and their SASS read.

Triton's wheel carries ptxas, cuobjdump and nvdisasm, so a kernel compiles for sm_90 anywhere:
``compile_for`` binds example arguments (CPU tensors of the launch's dtypes and strides, the same
ints and constexprs) exactly as a launch does (Triton's own binder: the same divisibility and
equal-to-1 specialisations), then compiles for the target instead of launching. What it gives:
- compile errors that the interpreter never shows (CPU tests run kernels interpreted: a kernel
  can pass them all and fail to compile on the GPU);
- the machine code: registers, spills, shared memory, and the instruction mix of the hottest
  loop (``inner_loop``), a static measure of kernels bound by instruction issue.
Run it in a process without TRITON_INTERPRET: under the interpreter ``triton.jit`` gives no
compilable kernels (tests/nvidia/test_offline_compile.py starts one)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import triton

SM90 = 90


def _bin(tool: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_for(kernel, args: tuple, kwargs: dict, arch: int = SM90):
    """``kernel`` (a triton.jit function, not interpreted) compiled for CUDA compute capability
    ``arch`` as ``kernel[grid](*args, **kwargs)`` would compile it on such a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):
        raise TypeError(f"{kernel!r} is not a compilable triton.jit function (TRITON_INTERPRET is set in this process?)")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _cuobjdump(compiled, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([_bin("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass(compiled) -> str:
    """The kernel's SASS (cuobjdump -sass)."""
    return _cuobjdump(compiled, "-sass")


@dataclass(frozen=True)
class Resources:
    registers: int  # a thread
    stack: int  # bytes of local memory a thread: > 0 means spills
    shared: int  # bytes a program (Triton's dynamic shared memory)


def resources(compiled) -> Resources:
    out = _cuobjdump(compiled, "-res-usage")
    fields = dict(re.findall(r"(REG|STACK):(\d+)", out))
    return Resources(int(fields.get("REG", 0)), int(fields.get("STACK", 0)), int(compiled.metadata.shared))


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


@dataclass(frozen=True)
class Loop:
    instructions: int  # warp instructions in one trip (its body, straight-line)
    opcodes: Counter  # by opcode without modifiers (HMMA, LDGSTS, PRMT, ...)

    def of(self, *names: str) -> int:
        return sum(self.opcodes[n] for n in names)


def inner_loop(sass_text: str) -> Loop | None:
    """The widest backward branch's body (a kernel's main loop when it has one), or None."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_INSTRUCTION.search, sass_text.splitlines()) if m]
    loops = []
    for addr, op, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    if not loops:
        return None
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    body = [op for addr, op, _ in code if lo <= addr <= hi]
    return Loop(len(body), Counter(op.split(".")[0] for op in body))
