"""Dependency direction: specheads imports neither train nor inference; inference never imports train; training uses
inference through one function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: Path) -> set[tuple[str, str]]:
    found = set()
    for path in folder.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add((str(path.relative_to(ROOT)), node.module))
    return found


def test_core_imports_neither_train_nor_inference():
    bad = [(f, m) for f, m in imported_modules(ROOT / "specheads")
           if m.startswith(("specheads.train", "specheads.inference"))]
    assert not bad, bad


def test_inference_never_imports_train():
    bad = [(f, m) for f, m in imported_modules(ROOT / "inference") if m.startswith("specheads.train")]
    assert not bad, bad


def imported_names(folder: Path, package: str) -> set[tuple[str, str]]:
    """(module, name) of every `from MODULE import name` under `folder` where MODULE is in `package`."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                found |= {(node.module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {(a.name, "*") for a in node.names if a.name.startswith(package)}
    return found


def test_training_enters_inference_through_the_runners_drafter_calls_alone():
    # the measured-τ step and the on-policy rollouts are training's only uses of the engine; model definitions live in
    # the core
    runner = "specheads.inference.bench.runner"
    assert imported_names(ROOT / "train", "specheads.inference") == {
        (runner, "measure_drafter"), (runner, "drafts_trees"), (runner, "MethodSummary"), (runner, "rollout_drafter"),
        (runner, "Rollout")}


def test_method_modules_never_import_their_package():
    # the package's __init__ imports every method module (builtin.py): a method module importing the package would
    # import it half-built
    methods = ROOT / "inference" / "methods"
    bad = [(f, m) for f, m in imported_modules(methods) if m == "specheads.inference.methods"
           and not f.endswith(("__init__.py", "builtin.py"))]  # builtin.py imports the method modules themselves
    assert not bad, bad


def imports_formats(path: Path, source: str | None = None) -> list[str]:
    """Every import of `specheads.formats` (or a module in it) anywhere in `path` (or `source` as if it were that
    file), at module level or inside a function: `import specheads.formats.base`, `from specheads.formats import
    x`, `from specheads import formats`, and the relative forms (`from ..formats import x` in specheads/heads/)."""
    package = ["specheads", *path.relative_to(ROOT / "specheads").parent.parts]
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    modules: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            modules += [base] + [f"{base}.{a.name}" for a in node.names]
    return [m for m in modules if m == "specheads.formats" or m.startswith("specheads.formats.")]


def test_heads_never_import_formats():
    """The formats build on the heads' checkpoint (importers return our `Checkpoint`); the heads know only our own
    format, and reading another engine's layout or a Hub id is `specheads.formats.load`'s job. An import the
    other way, even inside a function, would make a cycle."""
    bad = [(str(path.relative_to(ROOT)), m) for path in sorted((ROOT / "specheads" / "heads").rglob("*.py"))
           for m in imports_formats(path)]
    assert not bad, bad


def test_the_formats_import_check_sees_imports():
    # Guard against a vacuous pass: each form is flagged, also inside a function, and a look-alike name is not.
    path = ROOT / "specheads" / "heads" / "checkpoint.py"
    assert imports_formats(path, "def f():\n    from specheads.formats import import_folder\n")
    assert imports_formats(path, "import specheads.formats.base\n")
    assert imports_formats(path, "def f():\n    from specheads import formats\n")
    assert imports_formats(path, "from ..formats.base import Importer\n")
    assert imports_formats(path, "from .. import formats\n")
    assert not imports_formats(path, "from specheads.formats_extra import x\nfrom specheads import hub\n")
    assert not imports_formats(path, "from . import medusa\nfrom .checkpoint import formats\n")
    assert imports_formats(ROOT / "specheads" / "formats" / "load.py")  # the files it reads do parse imports


# The layers of `specheads.inference`, lowest first: each imports only the layers before it (and itself); the
# serving and benchmarking layers are side by side and import neither each other nor the command line.
LAYERS = (("engine",), ("methods",), ("proposers",), ("serve", "bench"), ("cli",))


def layer_violations(found: set[tuple[str, str]]) -> list[tuple[str, str]]:
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    bad = []
    for file, module in found:
        parts = Path(file).parts
        if parts[0] != "inference" or len(parts) < 3 or not module.startswith("specheads.inference."):
            continue
        own, used = parts[1], module.split(".")[2]
        if used in rank and own in rank and used != own and rank[used] >= rank[own]:
            bad.append((file, module))
    return bad


def test_each_inference_layer_imports_only_the_layers_below_it():
    """The engine depends on no other layer; proposers on the engine and the method declarations; serving and
    benchmarking on those; the command line on everything."""
    bad = layer_violations(imported_modules(ROOT / "inference"))
    assert not bad, bad


def test_the_layer_check_sees_violations():
    # Guard against a vacuous pass: an engine file importing a proposer, and serving importing bench, are flagged.
    flagged = set(layer_violations({("inference/engine/engine.py", "specheads.inference.proposers.eagle"),
                                    ("inference/serve/server.py", "specheads.inference.bench.runner"),
                                    ("inference/proposers/eagle.py", "specheads.inference.engine.tree")}))
    assert flagged == {("inference/engine/engine.py", "specheads.inference.proposers.eagle"),
                       ("inference/serve/server.py", "specheads.inference.bench.runner")}


def test_the_check_sees_imports():
    # Guard against a vacuous pass: the inference package does import the core.
    assert any(m.startswith("specheads.") for _, m in imported_modules(ROOT / "inference"))


def _docstrings(tree: ast.AST) -> set[int]:
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, owners) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def kind_literals(*, own_files: bool = False) -> list[tuple[str, str, str]]:
    """(file, kind, string) for every string literal (docstrings aside) naming a registered drafter kind, as a
    word, in a library file that is not that kind's own (`<kind>.py` in any package); or only in its own files."""
    from specheads.kinds import KINDS

    found = []
    for folder in ("specheads", "train", "inference"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    for name in KINDS.names():
                        if (path.stem == name) == own_files and re.search(rf"(?<![\w-]){re.escape(name)}(?!\w)",
                                                                          node.value):
                            found.append((str(path.relative_to(ROOT)), name, node.value))
    return found


def test_kind_names_appear_only_in_their_own_files():
    """No shared code branches on (or spells out) a kind's name: lists of names come from the registries."""
    bad = kind_literals()
    assert not bad, bad


def test_the_kind_name_check_sees_literals():
    # Guard against a vacuous pass: each kind's own files do spell its name.
    from specheads.kinds import KINDS

    assert {name for _, name, _ in kind_literals(own_files=True)} == set(KINDS.names())


# The packages holding a file per drafter kind (`<kind>.py`), by the module names they are imported as.
KIND_PACKAGES = {"specheads.heads": "specheads/heads", "specheads.formats": "specheads/formats",
                 "specheads.train": "train", "specheads.inference.proposers": "inference/proposers",
                 "specheads.inference.methods": "inference/methods"}


def sibling_kind_imports(path: Path, source: str | None = None) -> list[tuple[str, str]]:
    """(file, module) for every import in `path` (a kind's file, or `source` as if it were) of another kind's file,
    in any of the kind packages: `from specheads.train.eagle import x`, `import specheads.heads.eagle3`,
    `from specheads.inference.proposers import eagle`. A kind's file may import its own kind's files elsewhere."""
    from specheads.kinds import KINDS

    kinds, own = set(KINDS.names()), path.stem
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for module in modules:
            package, _, name = module.rpartition(".")
            if package in KIND_PACKAGES and name in kinds and name != own:
                found.append((str(path.relative_to(ROOT)), module))
    return found


def kind_files() -> list[Path]:
    from specheads.kinds import KINDS

    return [ROOT / folder / f"{name}.py" for folder in KIND_PACKAGES.values() for name in KINDS.names()
            if (ROOT / folder / f"{name}.py").is_file()]


def test_no_kind_file_imports_another_kinds_file():
    """What several kinds share lives in named shared modules (fused_tree, block_tree, chain_loss, fused_chain,
    speculators, ...); a kind's file imports those, never a sibling kind's file."""
    bad = [hit for path in kind_files() for hit in sibling_kind_imports(path)]
    assert not bad, bad


def test_the_sibling_import_check_sees_imports():
    # Guard against a vacuous pass: the detector flags constructed bad imports of each form, passes a kind's own
    # files in other packages, and the kind files it reads do import shared modules.
    peagle = ROOT / "inference" / "proposers" / "peagle.py"
    assert sibling_kind_imports(peagle, "from specheads.inference.proposers.eagle import EagleProposer\n")
    assert sibling_kind_imports(peagle, "import specheads.train.dflash\n")
    assert sibling_kind_imports(peagle, "from specheads.heads import eagle3\n")
    assert not sibling_kind_imports(peagle, "from specheads.heads.peagle import KIND_NAME\n")
    assert not sibling_kind_imports(peagle, "from specheads.inference.proposers.fused_tree import catch_up\n")
    files = kind_files()
    assert len(files) >= 15, files  # every kind has files in several packages
    shared = ("specheads.inference.proposers.fused_tree", "specheads.inference.proposers.block_tree",
              "specheads.train.chain_loss", "specheads.heads.fused_chain", "specheads.formats.speculators")
    imported = {m for path in files for _, m in imported_modules_of(path)}
    assert set(shared) <= imported, set(shared) - imported


def imported_modules_of(path: Path) -> set[tuple[str, str]]:
    return {(f, m) for f, m in imported_modules(path.parent) if f == str(path.relative_to(ROOT))}
