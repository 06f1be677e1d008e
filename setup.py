"""Package discovery for the three source folders (metadata lives in pyproject.toml).

`train/` and `inference/` are installed as `specheads.train` and `specheads.inference`; every subpackage under
each folder is found here, so a new subpackage can never be left out of the wheel.
"""

from setuptools import find_packages, setup

ROOTS = {"specheads": "specheads", "specheads.train": "train", "specheads.inference": "inference"}

packages = [name for name in ROOTS if name != "specheads"] + ["specheads"]
for name, folder in ROOTS.items():
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

# the C++ source of the engine's libllama, compiled on the user's machine against llama.cpp's headers
setup(packages=sorted(set(packages)), package_dir=ROOTS, package_data={"specheads.llamacpp": ["*.cpp"]})
