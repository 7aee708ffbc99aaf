"""The one build step pyproject.toml cannot say: the wheel carries the built-in stacks (``compose/``), the
scenario catalogue (``scenarios/``) and the pins (``pins.toml``) as ``drills/_shipped/``, where
``drills/shipped.py`` finds them when kvdrill runs from an installed wheel rather than a checkout.

They stay top-level folders in the source tree (they are what people read and edit), and they are copied
rather than declared as packages because they are not importable and must not land loose in site-packages.
Everything else about the package is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("compose", "scenarios", "pins.toml")
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "l2")  # compose/gpu/l2: a user's bind mount, not ours


class BuildPyWithShipped(build_py):
    def run(self) -> None:
        super().run()
        here = Path(__file__).resolve().parent
        dest = Path(self.build_lib) / "drills" / "_shipped"
        shutil.rmtree(dest, ignore_errors=True)  # a reused build directory keeps no file the tree deleted
        dest.mkdir(parents=True)
        for name in SHIPPED:
            src = here / name
            if src.is_dir():
                shutil.copytree(src, dest / name, ignore=SKIP)
            else:
                shutil.copy2(src, dest / name)


setup(cmdclass={"build_py": BuildPyWithShipped})
