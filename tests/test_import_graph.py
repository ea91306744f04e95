"""The shape of the code: no import cycles, nothing imports a command-line module, and data
flows one way (`pipelines` never imports `keras_transformer`). Every import counts, including
those inside functions, which are often how a cycle hides. And the library apart from its
command lines: only they parse argv; the special ids and `UsageError` are defined once; the
model holds the architecture, training the training."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.cli.test_train import REPO

# The `python -m keras_transformer.<command>` tools and the flag generator they share: the
# only modules that may parse a command line.
COMMAND_LINE = {f"keras_transformer.{name}" for name in (
    "train", "prepare", "translate", "evaluate", "export", "averaging", "flags", "force_decode",
    "back_translate")}

PACKAGES = ("keras_transformer", "pipelines")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(), str(path))
            for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def _resolve(name: str, known: set[str]) -> str | None:
    """The project module `name` refers to (a module, or a name in a package)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its body)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from package import module` imports the module; `from m import name` m.
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                resolved = _resolve(target, known)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def command_modules() -> set[str]:
    """Modules with a `python -m` entry point (`if __name__ == "__main__":`)."""
    return {name for name, tree in _modules().items()
            if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                   for node in tree.body)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_has_no_cycle():
    assert find_cycle(import_graph()) is None


def test_nothing_imports_a_command_line_module():
    commands = command_modules()
    assert {"keras_transformer.train", "keras_transformer.translate",
            "keras_transformer.evaluate", "keras_transformer.export",
            "keras_transformer.prepare", "keras_transformer.averaging"} <= commands
    importers = {f"{module} imports {command}" for module, imports in import_graph().items()
                 if module not in COMMAND_LINE for command in imports & COMMAND_LINE}
    assert not importers


def test_data_flows_one_way_pipelines_never_import_the_model():
    graph = import_graph()
    assert not {module: imports for module, imports in graph.items()
                if module.startswith("pipelines") and any(
                    target.startswith("keras_transformer") for target in imports)}


def test_every_public_name_resolves_and_the_readme_uses_only_public_names():
    import re

    import keras_transformer

    for name in keras_transformer.__all__:
        assert getattr(keras_transformer, name) is not None, name
    readme = (REPO / "README.md").read_text()
    python = "\n".join(re.findall(r"```python\n(.*?)```", readme, re.S))
    assert "import keras_transformer as kt" in python
    assert "from keras_transformer" not in python, "README examples import a private module"
    used = set(re.findall(r"\bkt\.(\w+)", python))
    assert used and used <= set(keras_transformer.__all__), used - set(keras_transformer.__all__)


def test_only_the_command_lines_parse_argv():
    """No library module imports argparse, and no function outside the command lines takes
    an `argparse.Namespace` (the library takes typed configs and plain arguments)."""
    assert command_modules() <= COMMAND_LINE
    offenders = []
    for name, tree in _modules().items():
        if name in COMMAND_LINE:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""])
                offenders += [f"{name} imports argparse" for module in modules
                              if module.split(".")[0] == "argparse"]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    if arg.annotation is not None and "Namespace" in ast.unparse(arg.annotation):
                        offenders.append(f"{name}.{node.name}({arg.arg}: Namespace)")
    assert not offenders


def _assigned_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            elements = target.elts if isinstance(target, ast.Tuple) else [target]
            names |= {element.id for element in elements if isinstance(element, ast.Name)}
    return names


def test_the_special_ids_and_usage_error_are_defined_once():
    definitions: dict[str, list[str]] = {}
    for name, tree in _modules().items():
        for symbol in _assigned_names(tree) & {"PAD_ID", "UNK_ID", "BOS_ID", "EOS_ID"}:
            definitions.setdefault(symbol, []).append(name)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "UsageError":
                definitions.setdefault("UsageError", []).append(name)
    assert definitions == {"PAD_ID": ["pipelines.constants"], "UNK_ID": ["pipelines.constants"],
                           "BOS_ID": ["pipelines.constants"], "EOS_ID": ["pipelines.constants"],
                           "UsageError": ["keras_transformer.errors"]}


def test_the_model_holds_the_architecture_and_training_holds_training():
    """`Transformer` overrides none of Keras' training methods (the trainer subclass in
    `keras_transformer.training` does), and the model package imports nothing of training."""
    tree = _modules()["keras_transformer.model.transformer"]
    transformer = next(node for node in tree.body
                       if isinstance(node, ast.ClassDef) and node.name == "Transformer")
    methods = {node.name for node in transformer.body if isinstance(node, ast.FunctionDef)}
    assert not methods & {"compile", "fit", "train_step", "make_train_function",
                          "load_weights", "compile_from_config", "get_compile_config"}
    graph = import_graph()
    assert not {module: imports for module, imports in graph.items()
                if module.startswith(("keras_transformer.model", "keras_transformer.layers"))
                and any(target.startswith("keras_transformer.training") for target in imports)}


def _package(module: str) -> str | None:
    """The folder of a module inside a subpackage (keras_transformer.<folder>); None for the
    top-level modules (the commands and the shared run-directory helpers)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else None


def find_package_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle between folders, as `find_cycle` finds one between modules."""
    packages: dict[str, set[str]] = {}
    for module, imports in graph.items():
        source = _package(module)
        if source is None:
            continue
        packages.setdefault(source, set()).update(
            target for target in map(_package, imports) if target not in (None, source))
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    return find_cycle(packages)


def test_the_folders_depend_on_each_other_one_way():
    """E.g. `serving` imports `decoding` (it exports searches), so `decoding` never imports
    `serving`; loading a translator (either kind of model) lives in `serving`."""
    assert find_package_cycle({"a.x.m": {"a.y.n"}, "a.y.n": {"a.x.k"}, "a.x.k": set()}) == [
        "a.x", "a.y", "a.x"]
    assert find_package_cycle(import_graph()) is None
