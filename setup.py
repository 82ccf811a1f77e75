"""Build the compiled parts: the core of the advisor's PrefixIndex (``advisor/index/_core.pyx``),
the event encoder of the block pools (``event_plane/_fastenc.pyx``), the core of the block
pools (``kvbm_runtime/_pool_core.pyx``) and the storage agent's verified reads
(``storage_backends/_readcore.pyx``).

Project metadata lives in ``pyproject.toml``; this file only declares the Cython extensions
(built by ``pip install -e .`` / ``make install``; Cython comes from ``[build-system] requires``).
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [
            Extension("advisor.index._core", ["advisor/index/_core.pyx"], extra_compile_args=["-O2"]),
            Extension("event_plane._fastenc", ["event_plane/_fastenc.pyx"], extra_compile_args=["-O2"]),
            Extension("kvbm_runtime._pool_core", ["kvbm_runtime/_pool_core.pyx"], extra_compile_args=["-O2"]),
            Extension("storage_backends._readcore", ["storage_backends/_readcore.pyx"], extra_compile_args=["-O2"]),
        ],
        compiler_directives={"language_level": "3"},
    ),
)
