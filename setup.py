"""Packages found, not listed: every package under gpubuf/ (a gpubuf/kernels link left by a device check is
skipped), and kernels/ with its subpackages, shipped as gpubuf.kernels. The rest of the metadata is in
pyproject.toml."""

from setuptools import find_packages, setup

KERNELS = "kernels"
packages = find_packages(include=["gpubuf", "gpubuf.*"], exclude=["gpubuf.kernels", "gpubuf.kernels.*"])
kernels = [f"gpubuf.{name}" for name in find_packages(include=[KERNELS, f"{KERNELS}.*"])]
setup(packages=packages + kernels, package_dir={"gpubuf.kernels": KERNELS})
