"""Programmatic dependent launch (kernels/device.py): every kernel of the NVIDIA plugin waits for
the kernel before it as its first statement, and every launch passes ``launch_options``.

A kernel launched with PDL that touched memory before its wait would race with the kernel before
it, and a race shows on a GPU only now and then, so the rule is checked on the source here (on any
machine), and on the GPU a long graph of dependent kernels is compared with plain launches.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_nvidia_sm100 import kernels
from deepinfer_nvidia_sm100.kernels import device as device_module
from deepinfer_nvidia_sm100.kernels import elementwise

# every module of the kernels package but device.py (which defines the helpers, no kernel)
MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels.__path__) if m.name != "device")


def _tree(module_name: str) -> ast.Module:
    module = importlib.import_module(f"deepinfer_nvidia_sm100.kernels.{module_name}")
    return ast.parse(inspect.getsource(module))


def _kernels(tree: ast.Module) -> list[ast.FunctionDef]:
    """The launched Triton kernels of a module: its jit functions named ``_*_kernel``."""
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
            and any("jit" in ast.unparse(d) for d in node.decorator_list)]


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Every ``something_kernel[grid](...)`` call of a module."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel")]


def _kernel_problems(tree: ast.Module) -> list[str]:
    """Kernels that do not take PDL last or do something before ``await_inputs(PDL)``."""
    problems = []
    for kernel in _kernels(tree):
        body = kernel.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if kernel.args.args[-1].arg != "PDL":
            problems.append(f"{kernel.name} must take PDL: tl.constexpr (last)")
        elif ast.unparse(body[0]) != "await_inputs(PDL)":
            problems.append(f"{kernel.name}: the first statement must be await_inputs(PDL), not {ast.unparse(body[0])!r}")
    return problems


def _launch_problems(tree: ast.Module) -> list[str]:
    """Launches that pass neither ``**launch_options(...)`` nor a dict built with it, and kernels
    launched nowhere in their module."""
    with_options = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name)
                    and "**launch_options(" in ast.unparse(node.value)}
    problems, launched = [], set()
    for call in _launches(tree):
        launched.add(call.func.value.id)
        spread = [k.value for k in call.keywords if k.arg is None]
        if not any(ast.unparse(v).startswith("launch_options(") or (isinstance(v, ast.Name) and v.id in with_options)
                   for v in spread):
            problems.append(f"the launch of {call.func.value.id} does not pass **launch_options(device)")
    problems += [f"{k.name} is not launched in its module" for k in _kernels(tree) if k.name not in launched]
    return problems


@pytest.mark.parametrize("module_name", MODULES)
def test_every_kernel_waits_for_its_inputs_first_and_every_launch_says_how(module_name):
    tree = _tree(module_name)
    assert _kernels(tree), f"kernels.{module_name} defines no kernel: the module list is stale"
    assert _kernel_problems(tree) == [] and _launch_problems(tree) == []


def test_the_source_checks_catch_a_kernel_that_reads_first_and_a_plain_launch():
    bad = ast.parse(
        "@triton.jit\ndef _a_kernel(x_ptr, PDL: tl.constexpr):\n    x = tl.load(x_ptr)\n    await_inputs(PDL)\n"
        "@triton.jit\ndef _b_kernel(x_ptr):\n    await_inputs(PDL)\n"
        "def f(x):\n    _a_kernel[(1,)](x, num_warps=1)\n    opts = dict(num_warps=1)\n    _b_kernel[(1,)](x, **opts)\n"
    )
    assert len(_kernel_problems(bad)) == 2 and len(_launch_problems(bad)) == 2
    good = ast.parse("def f(x):\n    opts = dict(BLOCK=4, **launch_options(x.device))\n    _a_kernel[(1,)](x, **opts)\n")
    assert _launch_problems(good) == []


def test_launch_options_are_off_without_a_cuda_device_and_when_switched_off(monkeypatch):
    assert device_module.launch_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    if torch.cuda.is_available():
        monkeypatch.setattr(device_module, "PDL", False)
        assert device_module.launch_options(torch.device("cuda")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_of_dependent_kernels_with_pdl_gives_the_plain_launches_bits(monkeypatch):
    """400 kernels, each reading what the one before wrote (add_rms_norm's residual chain), captured
    in a CUDA graph with PDL and replayed: the same bits as plain eager launches, every replay."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90 or later")
    torch.manual_seed(0)
    x0 = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        residual = x
        for _ in range(400):
            x, residual = elementwise.add_rms_norm(x, residual, weight, 1e-6)
        return x, residual

    monkeypatch.setattr(device_module, "PDL", False)
    want = chain(x0)
    monkeypatch.setattr(device_module, "PDL", True)
    assert device_module.launch_options(x0.device)["launch_pdl"]
    static = x0.clone()
    chain(static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(static)
    for _ in range(20):
        static.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
