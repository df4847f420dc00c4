"""Two LLMs side by side that differ only in module constants of the NVIDIA kernels (the tunables
of ``deepinfer_nvidia_sm100.kernels.*``) or in ops left out of the backend's table, through
``LLM.generate``, in one run: the end-to-end effect of a kernel change that a constant (or leaving
out an op) can switch off, without the 5-10% spread between two processes (or two trees run one
after the other).

    python -m benchmarks.constants_ab --out DIR --set moe.ROUTE_GEMV_MAX_TOKENS=0 \\
        [--set mla_decode.COMBINE_BLOCK_S=1 ...] [--drop norm_rope_write_latent ...]
        [--models v2-lite,v3-slice] [--batches 1,8,64] [--contexts 1024] [--max-tokens 17] [--repeats 2]

``changed`` runs with every ``--set MODULE.NAME=VALUE`` (VALUE a Python literal; NAME may be an
attribute of an object of the module: ``moe.moe_route.appends_shared_experts=False``) and without the
ops named by ``--drop`` (its kernel module's ``OPS`` without them: the model then does what it
does on a backend that lacks them, e.g. three ops instead of the fused one, or the reference),
``current`` with the modules as they are. Each LLM is built with its constants in place (the decode graphs are
captured at start-up, so their kernels keep them) and every ``generate`` of it runs with them in
place again (eager steps read them at call time). Both use the backend's own kernels
(``decode_peers.build``'s ``own``: no FlashMLA, no cuBLAS FP8, no DeepGEMM), or with ``--provider
peers`` the peer libraries where they fit (then MODULE may name a provider module of the plugin:
``--provider peers --set deepgemm.MIN_PAIRS_PER_EXPERT=1000000000``), random weights, 64-token KV
blocks, 40% of the GPU's memory each (``--memory-share``); the timing, floor and interleaving are
``decode_peers.points``'. Writes DIR/constants_ab.json after every point, with the
current / changed ratios of the decode step, cadence and prefill time per point.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.decode_peers import BLOCK_SIZE, build, parse_args, variant_points
from benchmarks.generate import metadata, write_model

PLUGIN = "deepinfer_nvidia_sm100"
KERNELS = f"{PLUGIN}.kernels"


def parse_drops(ops: list[str]) -> list[tuple[object, str, object]]:
    """['norm_rope_write_latent', ...] -> (kernel module, 'OPS', its OPS without the named ops) for
    each module that provides one of them."""
    from deepinfer_nvidia_sm100.backend import KERNEL_MODULES

    modules = {name: importlib.import_module(f"{KERNELS}.{name}") for name in KERNEL_MODULES}
    for op in ops:
        if not any(op in module.OPS for module in modules.values()):
            raise SystemExit(f"--drop {op!r}: no NVIDIA kernel module provides it (see `deepinfer backends`)")
    return [(module, "OPS", {name: fn for name, fn in module.OPS.items() if name not in ops})
            for module in modules.values() if any(op in module.OPS for op in ops)]


def parse_set(text: str) -> tuple[object, str, object]:
    """'moe.ROUTE_GEMV_MAX_TOKENS=0' -> (the kernels.moe module, 'ROUTE_GEMV_MAX_TOKENS', 0); an
    attribute of an object of the module too: 'moe.moe_route.appends_shared_experts=False'."""
    target, sep, value = text.partition("=")
    module_name, *path = target.split(".")
    if not sep or not module_name or not path or not all(path):
        raise SystemExit(f"--set {text!r}: expected MODULE.NAME=VALUE, e.g. moe.ROUTE_GEMV_MAX_TOKENS=0")
    try:
        owner = importlib.import_module(f"{KERNELS}.{module_name}")
    except ModuleNotFoundError:  # a provider module of the plugin (deepgemm, flashmla, cublas_fp8)
        try:
            owner = importlib.import_module(f"{PLUGIN}.{module_name}")
        except ModuleNotFoundError:
            raise SystemExit(f"--set {text!r}: no module {module_name} in {KERNELS} or {PLUGIN}") from None
    for name in path:
        if not hasattr(owner, name):
            raise SystemExit(f"--set {text!r}: {target} does not exist ({name} is missing)")
        owner, last = getattr(owner, name), (owner, name)
    try:
        return *last, ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
        raise SystemExit(f"--set {text!r}: the value must be a Python literal ({e})") from e


@contextlib.contextmanager
def constants(values: list[tuple[object, str, object]]):
    """The module constants set to ``values`` inside, restored after."""
    old = [(module, name, getattr(module, name)) for module, name, _ in values]
    try:
        for module, name, value in values:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in old:
            setattr(module, name, value)


class WithConstants:
    """An LLM whose ``generate`` runs with the given module constants in place."""

    def __init__(self, llm, values):
        self.llm, self.engine, self.values = llm, llm.engine, values

    def generate(self, *args, **kwargs):
        with constants(self.values):
            return self.llm.generate(*args, **kwargs)


def _shown(value) -> str:
    """A constant as the report records it (an OPS table as its op names)."""
    return repr(sorted(value) if isinstance(value, dict) else value)


def run(args) -> dict:
    from benchmarks.ceilings import measure

    changed = [parse_set(text) for text in args.set] + parse_drops(args.drop)
    if not changed:
        raise SystemExit("nothing to compare: give at least one --set MODULE.NAME=VALUE or --drop OP")
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure()
    report = {"meta": metadata(argparse.Namespace(accelerator="nvidia")), "ceilings": ceilings,
              "args": {k: str(v) for k, v in vars(args).items()},
              "changed": {f"{m.__name__}.{n}": _shown(v) for m, n, v in changed},
              "current": {f"{m.__name__}.{n}": _shown(getattr(m, n)) for m, n, _ in changed}, "points": [], "ratios": []}
    path = args.out / "constants_ab.json"
    max_len = -(-(max(args.contexts) + args.max_tokens + 16) // BLOCK_SIZE) * BLOCK_SIZE
    for name in args.models:
        model_dir = write_model(name, None, Path(tempfile.mkdtemp(prefix="deepinfer-ab-")))
        llms = {}
        for i, (label, values) in enumerate((("changed", changed), ("current", []))):
            with constants(values):
                llms[label] = WithConstants(build(model_dir, args.provider, max(args.batches), max_len, args.memory_share * (i + 1)), values)
        variant_points("ab", name, llms, ("current", "changed"), args, ceilings["copy_bytes_per_s"], report, path)
        del llms
        gc.collect()
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> None:
    def extra(p):
        p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                       help="a constant of deepinfer_nvidia_sm100.kernels.MODULE for the 'changed' LLM (repeatable)")
        p.add_argument("--drop", action="append", default=[], metavar="OP",
                       help="an op the 'changed' LLM's backend table leaves out (repeatable)")
        p.add_argument("--provider", choices=("own", "peers"), default="own",
                       help="both LLMs with the backend's own kernels (default) or with the peer libraries where they fit")

    run(parse_args(__doc__, argv, batches="1,8,64", contexts="1024", max_tokens=17, extra=extra))


if __name__ == "__main__":
    main()
