"""Package discovery (the rest of the metadata is in pyproject.toml).

radixrt's sub-packages are found, not listed, so a new one cannot drop out of the wheel; frontend/
and kernels/ sit at the top of the repository and install as radixrt.frontend and radixrt.kernels.
"""

from setuptools import find_packages, setup

TOP_LEVEL = ("frontend", "kernels")

packages = find_packages(include=["radixrt", "radixrt.*"])
for top in TOP_LEVEL:
    packages += [f"radixrt.{name}" for name in find_packages(include=[top, f"{top}.*"])]
setup(packages=packages, package_dir={f"radixrt.{top}": top for top in TOP_LEVEL})
