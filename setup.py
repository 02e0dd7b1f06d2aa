# setuptools reads everything from pyproject.toml; this file exists only because
# cffi's API-mode extension is declared through `cffi_modules`, which has no
# pyproject.toml spelling.
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
