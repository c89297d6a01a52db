"""Package discovery (the rest of the metadata is in pyproject.toml).

radixrt's sub-packages are found, not listed, so a new one cannot drop out of the wheel; frontend/
and kernels/ sit at the top of the repository and install as radixrt.frontend and radixrt.kernels;
the CPU kernels' C sources (kernels/csrc/, compiled on first use) ship with them.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ("frontend", "kernels")

packages = find_packages(include=["radixrt", "radixrt.*"])
for top in TOP_LEVEL:
    packages += [f"radixrt.{name}" for name in find_packages(include=[top, f"{top}.*"])]
# the CPU kernels' C sources: a folder of data, listed as a package as setuptools asks of one
packages.append("radixrt.kernels.csrc")
setup(
    packages=packages,
    package_dir={f"radixrt.{top}": top for top in TOP_LEVEL},
    package_data={"radixrt.kernels.csrc": ["*.c", "*.h"]},
)
