"""The import structure of deepinfer_core and the NVIDIA plugin: no import cycle, and every import
goes down the layers DESIGN.md draws (serving > api > engine > models > ops), with the other
packages placed between them. A lazy import inside a function counts (it is a cycle all the
same, only hidden); an import under ``if TYPE_CHECKING`` (annotations only) does not. Imports
are read from the source with grimp."""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")

# Top to bottom; a module belongs to the longest name that is it or a package above it. Modules
# of one layer may import each other (cycles aside).
LAYERS = [
    ("cli",),
    ("conformance",),
    ("serving",),
    ("deepinfer_core", "api", "chat", "recipe"),  # the package itself: its public names are api's
    ("parallel.data_parallel", "parallel.launch"),  # rank processes, each driving an engine
    ("engine",),
    ("parallel",),  # expert / context parallelism, EPLB, communicators: what the engine and models use
    ("sampling",),
    ("models",),
    ("loader",),
    ("backends", "plugins", "hook_checks"),
    ("ops", "hookspecs", "platform"),
    ("config", "dtypes", "default_model"),
]


def layer_of(module: str) -> int | None:
    rel = "deepinfer_core" if module == "deepinfer_core" else module.removeprefix("deepinfer_core.")
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    return None if best is None else best[0]


def cycles(graph) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm, iterative over each module's imports
        work = [(v, iter(sorted(graph.find_modules_directly_imported_by(v))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


@pytest.fixture(scope="module")
def graphs():
    return {pkg: grimp.build_graph(pkg, exclude_type_checking_imports=True)
            for pkg in ("deepinfer_core", "deepinfer_nvidia_sm100")}


@pytest.mark.parametrize("package", ["deepinfer_core", "deepinfer_nvidia_sm100"])
def test_no_import_cycle(graphs, package):
    assert cycles(graphs[package]) == [], f"import cycles in {package} (a lazy import counts too)"


def test_every_module_has_a_layer(graphs):
    assert [m for m in sorted(graphs["deepinfer_core"].modules) if layer_of(m) is None] == []


def test_imports_go_down_the_layers(graphs):
    graph = graphs["deepinfer_core"]
    upward = [f"{m} -> {d}" for m in sorted(graph.modules) for d in sorted(graph.find_modules_directly_imported_by(m))
              if layer_of(d) < layer_of(m)]
    assert upward == [], "imports from a lower layer to a higher one (tests/test_layers.py LAYERS)"


def test_the_checks_can_fail():
    """A planted cycle (also through a lazy import) and an upward import are found."""
    graph = grimp.ImportGraph()
    for m in ("deepinfer_core.engine.engine", "deepinfer_core.models.v3.model", "deepinfer_core.ops.moe"):
        graph.add_module(m)
    graph.add_import(importer="deepinfer_core.engine.engine", imported="deepinfer_core.models.v3.model")
    graph.add_import(importer="deepinfer_core.models.v3.model", imported="deepinfer_core.ops.moe")
    assert cycles(graph) == []
    graph.add_import(importer="deepinfer_core.ops.moe", imported="deepinfer_core.engine.engine")
    assert cycles(graph) == [["deepinfer_core.engine.engine", "deepinfer_core.models.v3.model", "deepinfer_core.ops.moe"]]
    assert layer_of("deepinfer_core.engine.engine") < layer_of("deepinfer_core.ops.moe")  # so ops.moe -> engine is upward
    assert layer_of("deepinfer_core.parallel.data_parallel") < layer_of("deepinfer_core.engine.runner") < layer_of(
        "deepinfer_core.parallel.expert_parallel")
