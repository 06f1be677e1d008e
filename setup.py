"""Package discovery for the three source folders (metadata lives in pyproject.toml).

`train/` and `inference/` are installed as `specheads.train` and `specheads.inference`; every subpackage under
each folder is found here, so a new subpackage can never be left out of the wheel.
"""

from setuptools import find_packages, setup

ROOTS = {"specheads": "specheads", "specheads.train": "train", "specheads.inference": "inference"}

packages = [name for name in ROOTS if name != "specheads"] + ["specheads"]
for name, folder in ROOTS.items():
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=sorted(set(packages)), package_dir=ROOTS)
