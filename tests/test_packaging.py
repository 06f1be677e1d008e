"""The wheel and sdist hold every module, and a wheel installed into a fresh environment runs every command's help.

The editable install of the set-up maps the source folders directly, so a package left out of the distribution
would only show in a real install: these tests build one from the working tree, as a user's `pip install .` does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.cli_help import help_without_torch

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the import name it installs as (setup.py's ROOTS).
FOLDERS = {"specheads": "specheads", "train": "specheads/train", "inference": "specheads/inference"}
SUBCOMMANDS = ("generate", "bench", "serve", "calibrate", "loadtest", "export")


def _source_files() -> set[str]:
    """Every tracked or new (not ignored) module of the three source folders, as its installed path."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *FOLDERS], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    out = set()
    for rel in listed:
        if rel.endswith(".py") and (ROOT / rel).exists():
            folder, _, rest = rel.partition("/")
            out.add(f"{FOLDERS[folder]}/{rest}")
    return out


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the working tree's tracked and new files: what a clean clone builds from (no egg-info, no caches)."""
    dst = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    for rel in listed:
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


@pytest.fixture(scope="module")
def wheel(tree: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(tree),
                    "-w", str(out)], check=True, capture_output=True, text=True)
    (found,) = out.glob("specheads-*.whl")
    return found


def test_the_wheel_holds_every_module(wheel: Path):
    modules = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    want = _source_files()
    assert len(want) > 50  # the check sees the whole tree, not an empty listing
    assert want - modules == set(), "modules missing from the wheel"
    assert modules - want == set(), "the wheel holds modules that are not in the source tree"


def test_the_sdist_holds_every_module_and_builds_the_same_wheel(tree: Path, tmp_path):
    script = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    name = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=tree, check=True, capture_output=True,
                          text=True).stdout.split()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile()}
    folder_of = {installed: folder for folder, installed in FOLDERS.items()}
    for installed in _source_files():
        top = max((p for p in folder_of if installed.startswith(p + "/")), key=len)
        assert folder_of[top] + installed[len(top):] in members, installed
    assert {"setup.py", "pyproject.toml", "README.md"} <= members


def test_a_fresh_environment_runs_every_commands_help(wheel: Path, tmp_path):
    # 1. A new venv with the wheel and nothing else of this project; the dependencies (torch, transformers, ...)
    #    come from the test's own environment through a path entry, which does not run its editable-install hook.
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    # 2. The package that runs is the installed one, not the source tree.
    where = subprocess.run([str(python), "-c", "import specheads.inference.cli as c; print(c.__file__)"],
                           cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(env)), where

    # 3. Every command answers --help from the installed console script.
    script = env / "bin" / "specheads"
    top = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert top.returncode == 0, top.stderr
    for sub in SUBCOMMANDS:
        assert sub in top.stdout
        proc = subprocess.run([str(script), sub, "--help"], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, (sub, proc.stderr)
        assert proc.stdout.startswith(f"usage: specheads {sub}"), (sub, proc.stdout[:200])
    train = subprocess.run([str(python), "-m", "specheads.train", "--help"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert train.returncode == 0 and "recipe:" in train.stdout, train.stderr

    # 4. ... and none of them imports torch or transformers to do it (so each answers at once).
    for argv in (["--help"], *([sub, "--help"] for sub in SUBCOMMANDS)):
        done = help_without_torch(str(python), argv, cwd=tmp_path)
        assert done["code"] == 0 and not done["torch"] and not done["transformers"], (argv, done)
