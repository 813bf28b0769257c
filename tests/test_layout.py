"""The project's shape: every shipped config loads, and the layering stays clean
(no import cycles; the model code imports neither Lightning nor the data code)."""

import ast
import dataclasses
import sys

import pytest
from conftest import ROOT, run_command

from mt.config import load_config
from mt.model import Transformer

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MODEL_CODE = ("mt.masks", "mt.attention", "mt.layers", "mt.model")
NOT_IN_MODEL_CODE = ("lightning", "pytorch_lightning", "datasets", "sentencepiece", "mt.data", "mt.prepare",
                     "mt.corpus", "mt.tokenizer", "mt.lit", "mt.train", "mt.fastpath")  # fmt: skip


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


def _imports(path, module: str, top_level_only: bool) -> set[str]:
    """The mt modules and third-party packages ``path`` imports. ``top_level_only``: the
    imports that run when the module is imported (not those inside functions or
    ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    found = set()

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not top_level_only:
                    visit(child, False)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module == "mt":
                    found.update(f"mt.{a.name}" for a in child.names)
                else:
                    found.add(child.module)
            visit(child, top)

    visit(tree, True)
    return {name for name in found if name != "mt" and name != module}


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = {f"mt.{p.stem}": p for p in (ROOT / "mt").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, name, top_level_only)
        graph[name] = {d if d in modules else d.split(".")[0] for d in deps if d in modules or not d.startswith("mt.")}
    return graph


def test_no_import_cycles():
    graph = _graph(top_level_only=True)
    state: dict[str, str] = {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in graph.get(node, ()):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep in graph and dep not in state:
                walk(dep, path + [dep])
        state[node] = "done"

    for module in graph:
        if module not in state:
            walk(module, [module])


def test_model_code_imports_neither_lightning_nor_the_data_code():
    graph = _graph(top_level_only=False)  # lazy imports count too
    seen, todo = set(), list(MODEL_CODE)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(d for d in graph.get(module, ()) if d.startswith("mt."))
    reached = seen | {d for m in seen for d in graph.get(m, ())}
    assert not reached & set(NOT_IN_MODEL_CODE), sorted(reached & set(NOT_IN_MODEL_CODE))
    # and at run time: importing the model loads none of them
    probe = "import sys, mt.model; print(' '.join(sorted(sys.modules)))"
    loaded = set(run_command([sys.executable, "-c", probe], check=True).stdout.split())
    assert not loaded & set(NOT_IN_MODEL_CODE), sorted(loaded & set(NOT_IN_MODEL_CODE))


def test_the_layering_check_sees_imports(tmp_path):
    """The checks above would pass vacuously if the parser missed imports."""
    graph = _graph(top_level_only=True)
    assert "mt.masks" in graph["mt.model"] and "lightning" in graph["mt.lit"] and "mt.model" in graph["mt.fastpath"]
    cyclic = tmp_path / "m.py"
    cyclic.write_text("from mt import a\nif TYPE_CHECKING:\n    import mt.b\ndef f():\n    import lightning\n")
    assert _imports(cyclic, "mt.m", top_level_only=True) == {"mt.a"}
    assert _imports(cyclic, "mt.m", top_level_only=False) == {"mt.a", "lightning"}
