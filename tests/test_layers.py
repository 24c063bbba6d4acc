"""The package's layers (docs/architecture.md, "Layers"), read from its own imports so they cannot slip:
every import of every module -- those inside functions too, relative ones resolved -- is an edge; the
edges form no cycle; ``parallel/`` imports no Lightning, Hydra or OmegaConf and no lightning_par module
above it; inside parallel/ only discovery.py imports parallel/hf/; and every module imports only from its own
layer or the layers before it (one layer per folder). Each module of the
package must be placed in ``LAYERS`` (a new module fails here until it is)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_par"

# One rule per folder, lowest first: a module's layer is its folder's (the package itself, ``lightning_par``,
# holds only ConfigError and the config resolver). A module imports only from its own layer or those below.
LAYERS: dict[str, int] = {
    "lightning_par": 0,
    "lightning_par.core": 0,  # base: dtypes, devices, optimizers, job bookkeeping, the token file's layout
    "lightning_par.conf": 0,  # the yaml, no code
    "lightning_par.parallel": 1,  # techniques: plain torch (sharding/ tensor/ pipeline/ memory/ init/ hf/)
    "lightning_par.strategies": 2,  # Lightning strategies, the catalogue, checkpoint/ (DCP, export)
    "lightning_par.models": 3,  # demo models and hf/ (HFCausalLM, from_pretrained, the registry)
    "lightning_par.data": 4,
    "lightning_par.callbacks": 5,  # measurement
    "lightning_par.costs": 6,  # cost models, the estimate, the advisor
    "lightning_par.run": 7,  # where config meets code: train, facts, config checks, child ranks
    # the app around it: modes beside training, the command line, tools (report, prepare, collectives)
    "lightning_par.modes": 8, "lightning_par.cli": 8, "lightning_par.__main__": 8, "lightning_par.tools": 8,
}
NAMES = {0: "base", 1: "parallel", 2: "strategies", 3: "models", 4: "data", 5: "callbacks", 6: "costs",
         7: "run", 8: "app"}
PLAIN_TORCH = ("lightning", "hydra", "omegaconf", "pytorch_lightning")
#: inside parallel/, only the plan's discovery reaches the Hugging Face specifics; the generic techniques get
#: them from the resolved plan (``ParallelPlan.stage_runner``, ``install_experts``)
HF = "lightning_par.parallel.hf"
HF_GATE = "lightning_par.parallel.discovery"


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix in ``LAYERS`` (the package itself, ``lightning_par``, only exactly)."""
    best = max((p for p in LAYERS if module == p or (p != "lightning_par" and module.startswith(p + "."))),
               key=len, default=None)
    return LAYERS[best] if best is not None else None


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module ``source`` imports (top-level or inside functions), resolved to a package module
    where it is one; other imports as their top-level name."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if t.startswith("lightning_par"):
                while t not in known and "." in t:
                    t = t.rpartition(".")[0]
                found.add(t)
            elif t:
                found.add(t.split(".")[0])
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports_of(n, p.read_text(), p.name == "__init__.py", set(mods)) for n, p in mods.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Each broken rule, one line each."""
    out = []
    for mod, targets in sorted(edges.items()):
        mine = layer_of(mod)
        if mine is None:
            out.append(f"{mod}: in no layer (place it in tests/test_layers.py LAYERS)")
            continue
        for t in sorted(targets):
            if t.split(".")[0] in PLAIN_TORCH and mine == LAYERS["lightning_par.parallel"]:
                out.append(f"{mod} imports {t}: parallel/ is plain torch")
            if not t.startswith("lightning_par"):
                continue
            theirs = layer_of(t)
            if theirs is not None and theirs > mine:
                out.append(f"{mod} ({NAMES[mine]}) imports {t} ({NAMES[theirs]}): a layer above it")
            if ((t == HF or t.startswith(HF + ".")) and mine == LAYERS["lightning_par.parallel"]
                    and mod != HF_GATE and not (mod == HF or mod.startswith(HF + "."))):
                out.append(f"{mod} imports {t}: inside parallel/ only discovery reaches parallel/hf")
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_each_layer_imports_only_the_layers_before_it() -> None:
    assert violations(graph()) == []


def test_the_checks_fail_on_a_violation() -> None:
    """A parallel/ module importing lightning_par.strategies (or Lightning) is reported, and so is a cycle."""
    edges = graph()
    src = "import torch\nfrom lightning_par.strategies.base import ParStrategyMixin\n\ndef f():\n    import lightning\n"
    edges["lightning_par.parallel.bad"] = imports_of("lightning_par.parallel.bad", src, False, set(edges))
    found = violations(edges)
    assert "lightning_par.parallel.bad (parallel) imports lightning_par.strategies.base (strategies): a layer above it" \
        in found and "lightning_par.parallel.bad imports lightning: parallel/ is plain torch" in found
    edges["lightning_par.core.dtypes"] = edges["lightning_par.core.dtypes"] | {"lightning_par.run.train"}
    assert any("lightning_par.core.dtypes" in c and "lightning_par.run.train" in c for c in cycles(edges))
    edges["lightning_par.parallel.pipeline.schedule"] |= {"lightning_par.parallel.hf.stages"}
    assert ("lightning_par.parallel.pipeline.schedule imports lightning_par.parallel.hf.stages: inside parallel/ only "
            "discovery reaches parallel/hf") in violations(edges)
    edges["lightning_par.newthing"] = set()
    assert "lightning_par.newthing: in no layer (place it in tests/test_layers.py LAYERS)" in violations(edges)


@pytest.mark.parametrize("relative,expected", [("from . import mesh", "lightning_par.parallel.mesh"),
                                               ("from ..strategies import base", "lightning_par.strategies.base")])
def test_relative_imports_resolve(relative: str, expected: str) -> None:
    assert expected in imports_of("lightning_par.parallel.x", relative, False, set(modules()))


# The cost models read a strategy through one typed seam, ``strategy.cost_options()`` (parallel/layout.py):
# no getattr/hasattr probe of a strategy, and no module outside strategies/ reads a strategy's private
# attribute (``costs/estimate.py`` read ``_n_microbatches``; there were 27 probes in the two files).
COST_READERS = ("lightning_par/costs/estimate.py", "lightning_par/costs/run_prediction.py", "lightning_par/modes/estimate.py")


def _strategy_probes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if "strategy" in target:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_cost_models_read_strategies_through_cost_options_only():
    probes = [p for rel in COST_READERS for p in _strategy_probes(ROOT / rel)]
    assert not probes, probes
    private = []
    for path in PACKAGE.rglob("*.py"):
        if "strategies" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr != "_target_"  # a config node's key, not an attribute
                    and isinstance(node.value, (ast.Name, ast.Attribute))
                    and ast.unparse(node.value).split(".")[-1] == "strategy"):
                private.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not private, private
