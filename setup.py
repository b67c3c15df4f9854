# cffi's setuptools hook builds the C shim; all other metadata lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["fmha_rt/shim_build.py:ffibuilder"])
