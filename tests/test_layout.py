"""The project's shape: every shipped config loads, and the layering stays clean.

Packages import one way, from the foundation up (``LAYERS``), counting the
imports inside functions too; no module imports itself back through others;
the model code imports neither Lightning nor the data code."""

import ast
import dataclasses
import sys

import pytest
from conftest import ROOT, run_command

from mt.config import load_config
from mt.model.transformer import Transformer

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

#: What each package (or top-level module) may import of mt, besides itself.
#: The foundation modules import only each other.
FOUNDATION = {"mt.config", "mt.errors", "mt.textio", "mt.hardware"}
LAYERS = {
    **{name: FOUNDATION for name in FOUNDATION},
    "mt.model": FOUNDATION,
    "mt.data": FOUNDATION,
    "mt.decode": FOUNDATION | {"mt.model", "mt.data"},
    "mt.evaluate": FOUNDATION | {"mt.model", "mt.data", "mt.decode"},
    "mt.train": FOUNDATION | {"mt.model", "mt.data", "mt.decode", "mt.evaluate"},
    "mt.inspect": FOUNDATION | {"mt.model", "mt.data", "mt.decode"},
    "mt.export": FOUNDATION | {"mt.model", "mt.data", "mt.decode", "mt.evaluate"},
    "mt.serve": FOUNDATION | {"mt.model", "mt.data", "mt.decode", "mt.inspect"},
    "mt.cli": FOUNDATION
    | {
        "mt.model",
        "mt.data",
        "mt.decode",
        "mt.evaluate",
        "mt.train",
        "mt.inspect",
        "mt.export",
        "mt.serve",
    },  # fmt: skip
    "mt.__main__": {"mt.cli"},
}
MODEL_CODE = ("mt.model.masks", "mt.model.attention", "mt.model.layers", "mt.model.transformer")
NOT_IN_MODEL_CODE = ("lightning", "pytorch_lightning", "datasets", "sentencepiece")


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"toy.yaml", "multi30k_cpu.yaml", "multi30k_gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_validates_and_builds_its_model(path):
    cfg = load_config(path)
    vocab = cfg.data.vocab_size
    model = Transformer(dataclasses.replace(cfg.model, src_vocab_size=vocab, tgt_vocab_size=vocab, pad_id=0))
    assert model.num_parameters() > 0
    for key in (line.split(":")[0].strip() for line in path.read_text().splitlines() if line.startswith("  ")):
        assert key.isidentifier(), f"{path.name}: {key!r}"  # every key a field name (unknown ones fail load_config)
    if path.name.startswith("multi30k"):  # the size the docs give for the Multi30k model
        assert model.num_parameters() == 2_349_568


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, module: str) -> set[str]:
    """The modules ``path`` imports, wherever the import statement stands (inside
    functions too), except under ``if TYPE_CHECKING:``, which never runs.
    ``from mt.x import y`` counts as ``mt.x.y`` when that is a module, else ``mt.x``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(node) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the module's own package up
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for a in child.names:
                    found.add(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
            visit(child)

    visit(tree)
    return found - {module}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    """Every mt module and the modules it imports (mt's and third-party packages' top names)."""
    graph = {}
    for path in sorted((ROOT / "mt").rglob("*.py")):
        name = _module_name(path)
        graph[name] = {d if d.startswith("mt.") else d.split(".")[0] for d in _imports(path, name) if d != "mt"}
    return graph


def _unit(module: str) -> str:
    """The package or foundation module that ``module`` belongs to, as ``LAYERS`` names them."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_every_module_belongs_to_a_layer():
    assert {_unit(m) for m in _graph() if m != "mt"} <= set(LAYERS), "a new package needs its place in LAYERS"


def test_packages_import_only_the_layers_below_them():
    upward = []
    for module, deps in _graph().items():
        if module == "mt":
            continue
        allowed = LAYERS[_unit(module)] | {_unit(module)}
        upward += [f"{module} -> {d}" for d in deps if d.startswith("mt.") and _unit(d) not in allowed]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()  # imports inside functions count: a lazy import is still a dependency
    state: dict[str, str] = {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep in graph and dep not in state:
                walk(dep, path + [dep])
        state[node] = "done"

    for module in graph:
        if module not in state:
            walk(module, [module])


def test_model_code_imports_neither_lightning_nor_the_data_code():
    graph = _graph()
    seen, todo = set(), list(MODEL_CODE)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(d for d in graph.get(module, ()) if d.startswith("mt."))
    reached = seen | {d for m in seen for d in graph.get(m, ())}
    assert all(_unit(m) in FOUNDATION | {"mt.model"} for m in seen), sorted(seen)
    assert not reached & set(NOT_IN_MODEL_CODE), sorted(reached & set(NOT_IN_MODEL_CODE))
    # and at run time: importing the model loads none of them, nor any other mt package
    probe = "import sys, mt.model.transformer; print(' '.join(sorted(sys.modules)))"
    loaded = set(run_command([sys.executable, "-c", probe], check=True).stdout.split())
    assert not loaded & set(NOT_IN_MODEL_CODE), sorted(loaded & set(NOT_IN_MODEL_CODE))
    assert {_unit(m) for m in loaded if m.startswith("mt.")} <= FOUNDATION | {"mt.model"}


def test_the_layering_check_sees_imports(tmp_path):
    """The checks above would pass vacuously if the parser missed imports."""
    graph = _graph()
    assert "mt.model.masks" in graph["mt.model.transformer"] and "lightning" in graph["mt.train.lit"]
    assert "mt.model.transformer" in graph["mt.decode.fastpath"]
    package = tmp_path / "mt" / "p"
    package.mkdir(parents=True)
    probe = package / "m.py"
    probe.write_text(
        "from mt.model import masks\nfrom mt.config import ModelConfig\nif TYPE_CHECKING:\n    import mt.b\n"
        "def f():\n    import lightning\n    from . import x\n"
    )
    assert _imports(probe, "mt.p.m") == {"mt.model.masks", "mt.config", "lightning", "mt.p"}
    assert _unit("mt.decode.search") == "mt.decode" and _unit("mt.config") == "mt.config"
