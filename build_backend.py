"""The build backend: setuptools' own (setuptools.build_meta), with jaxlib required to build a wheel, whose
CPU kernels setup.py compiles against jaxlib's FFI headers; an editable install or an sdist compiles
nothing, so their builds need setuptools alone."""

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403 (every other hook, as setuptools defines it)

FFI_HEADERS = "jaxlib>=0.4.35"  # pyproject.toml's runtime requirement: the headers of a jaxlib it may load


def get_requires_for_build_wheel(config_settings=None):
    return [*build_meta.get_requires_for_build_wheel(config_settings), FFI_HEADERS]
