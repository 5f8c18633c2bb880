"""Placeholders for heavy packages that vLLM's scheduler-side modules import but never use.

vLLM's offloading and tiering modules pull in torch, transformers, openai and friends at
import time (type annotations, custom-op registration, pydantic models of the OpenAI
server), yet the code the tests run (canonical mappings, back-pressure, the tiering manager)
never computes with them. Instead of installing gigabytes, ``install(names)`` makes every
module under those top-level names a placeholder module:

* any attribute is a :class:`Placeholder` named after its path (``torch.library.Library``);
* a placeholder can be imported, subclassed (the class then derives from ``object``), used
  in annotations (``|``, ``[]``), concatenated (``+``), described to pydantic (any value)
  and called, as import-time registration code does; every call is recorded in ``CALLS``;
* the *result* of a call (and anything reached from it) has no value: ``bool()``, iteration,
  ``len()`` and comparisons raise ``TypeError`` naming it, so no code path can silently branch
  on a stand-in.

The metadata-only torch (``stubs/torch``) uses the same placeholders for everything it does
not model.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

#: Packages vLLM's scheduler-side modules import but never compute with (model loading, the
#: OpenAI server, structured output, HTTP). They are placeholders, never installed (the test
#: set-up ``conftest.py`` and ``kvtier layout check`` install them).
VLLM_STAND_INS = (
    "aiohttp",
    "cloudpickle",
    "cpuinfo",
    "fastapi",
    "huggingface_hub",
    "llguidance",
    "openai",
    "openai_harmony",
    "partial_json_parser",
    "PIL",
    "pybase64",
    "requests",
    "safetensors",
    "transformers",
    "urllib3",
    "uvloop",
    "xgrammar",
)

#: Names of placeholder calls made so far (import-time registrations, mostly).
CALLS: set[str] = set()


class Placeholder:
    """A named stand-in for an object of a package that is not installed."""

    __slots__ = ("_name", "_is_value")

    def __init__(self, name: str, is_value: bool = False):
        object.__setattr__(self, "_name", name)
        # True for the result of a call and everything reached from it.
        object.__setattr__(self, "_is_value", is_value)

    def _refuse(self, what: str):
        raise TypeError(
            f"kvtier test stand-in: {self._name} has no value ({what}); the code under test "
            "uses a package that tests/python/stubs only stands in for"
        )

    def __call__(self, *args, **kwargs):
        CALLS.add(self._name)
        return Placeholder(f"{self._name}()", is_value=True)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._name}.{name}", self._is_value)

    def __setattr__(self, name: str, value) -> None:
        CALLS.add(f"{self._name}.{name} = ...")

    def __getitem__(self, key):
        return Placeholder(f"{self._name}[...]", self._is_value)

    def __setitem__(self, key, value) -> None:
        CALLS.add(f"{self._name}[...] = ...")

    def __or__(self, other):
        return self

    def __ror__(self, other):
        return self

    def __add__(self, other):
        return self

    def __radd__(self, other):
        return self

    def __mro_entries__(self, bases):
        return (object,)

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __bool__(self) -> bool:
        if self._is_value:
            self._refuse("truth value")
        return True

    def __iter__(self):
        self._refuse("iteration")

    def __len__(self) -> int:
        self._refuse("len")

    def __eq__(self, other):
        if self._is_value:
            self._refuse("comparison")
        return self is other

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f"<kvtier stand-in {self._name}>"


def placeholder_module(name: str) -> types.ModuleType:
    """A package module whose every attribute is a placeholder."""
    module = types.ModuleType(name, f"kvtier test stand-in for {name}")
    module.__path__ = []  # a package: submodules import too

    def __getattr__(attr: str, _prefix=name):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{_prefix}.{attr}")

    module.__getattr__ = __getattr__
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves placeholder modules for the registered top-level names (and their submodules)."""

    def __init__(self) -> None:
        self.roots: set[str] = set()
        # Packages that exist as real stub code (torch): only their submodules are stood in.
        self.submodules_only: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        root = fullname.split(".", 1)[0]
        if root in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if root in self.submodules_only and "." in fullname:
            # A submodule the stub really provides (a file) wins over a placeholder.
            if path and importlib.machinery.PathFinder.find_spec(fullname, path):
                return None
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return placeholder_module(spec.name)

    def exec_module(self, module) -> None:
        pass


_FINDER = _Finder()


def _registered() -> None:
    if _FINDER not in sys.meta_path:
        # First, so an installed copy of a stood-in package is never half used.
        sys.meta_path.insert(0, _FINDER)


def install(names) -> None:
    """Stand in for the top-level packages ``names`` (and everything under them)."""
    _FINDER.roots.update(names)
    _registered()


def install_submodules_of(package: str) -> None:
    """Stand in for every submodule of ``package`` that has no real file (``torch.cuda``...)."""
    _FINDER.submodules_only.add(package)
    _registered()
