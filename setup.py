"""Maps the root folders onto the `llmopt` namespace (llmopt.cli, llmopt.stages, ...).

Metadata lives in pyproject.toml; only the package discovery needs code, because setuptools'
declarative `package-dir` cannot map a whole sub-tree without listing every sub-package.
"""
from setuptools import find_packages, setup

ROOTS = ("cli", "stages", "kernels", "recipes")

packages = []
package_dir = {}
for root in ROOTS:
    package_dir[f"llmopt.{root}"] = root
    packages.append(f"llmopt.{root}")
    packages += [f"llmopt.{root}.{sub}" for sub in find_packages(root)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"llmopt.recipes": ["*.yaml"], "llmopt.kernels": ["csrc/*.c", "csrc/*.h"]},
)
