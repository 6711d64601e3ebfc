"""Package discovery: every package and data file under the four source folders ships, none listed by hand.

kernels/, evals/ and recipes/ stay top-level folders but install as qtoolkit.kernels / .evals / .recipes (a PyPI
distribution named `kernels` exists and must not be shadowed). pyproject.toml's `packages.find` cannot rename a
folder, so the mapping lives here; everything else about the project is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOTS = {"qtoolkit": "qtoolkit", "qtoolkit.kernels": "kernels", "qtoolkit.evals": "evals",
         "qtoolkit.recipes": "recipes"}
SKIP = {"__pycache__", ".pytest_cache"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{p}" for p in find_packages(folder)]
    return found


def data_files_of(folder: str) -> list[str]:
    """Every non-Python file below `folder`, relative to it (setuptools ships them with the root package)."""
    root = Path(folder)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc", ".so") and not SKIP & set(p.parts))


class FreshBuildPy(build_py):
    """Copies the package into an emptied build/lib/qtoolkit: setuptools keeps what an earlier build left there, so
    a module moved or deleted since would ride along into the next wheel (a stale qtoolkit/ablation.py did)."""

    def run(self) -> None:
        shutil.rmtree(Path(self.build_lib) / "qtoolkit", ignore_errors=True)
        super().run()


setup(packages=packages(), package_dir=dict(ROOTS),
      package_data={name: data_files_of(folder) for name, folder in ROOTS.items()},
      cmdclass={"build_py": FreshBuildPy})
