"""`litevlm`: the ament_python package at the repository root (also a plain pip package)."""

from glob import glob

from setuptools import find_packages, setup

setup(
    name="litevlm",
    version="0.1.0",
    packages=find_packages(include=["litevlm_runtime", "litevlm_runtime.*"]),
    # The bundled default model's weights, tokenizer and card travel with the package, and the
    # low-bit CPU kernels' source (built on first use: kernels/lowbit_kernels.py).
    package_data={"litevlm_runtime": ["bundled/*/*", "bundled/*/*/*", "kernels/*.cpp", "kernels/*.h"]},
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/litevlm"]),
        ("share/litevlm", ["package.xml"]),
        ("share/litevlm/launch", glob("launch/*.py")),
        ("share/litevlm/config", glob("config/*")),
    ],
    python_requires=">=3.10",
    entry_points={"console_scripts": ["litevlm = litevlm_runtime.cli:main",
                                      "litevlm_drive_node = litevlm_runtime.ros.runner:main"]},
)
