"""A data-bearing ``torch`` for vLLM's ``test_fs_tier.py`` only (``test_vllm_fs_tier.py``).

The suite's ``stubs/torch`` is metadata-only (no bytes), and vLLM's modules keep it. vLLM's
fs-tier tests use torch only for a CPU buffer whose memory the tier reads and writes through
``memoryview(tensor.numpy())``: ``zeros``/``rand``, ``data_ptr``, slicing on dimension 0,
``view(dtype)`` and ``view(rows, cols)``, assignment, ``clone``, ``allclose``. Here each of
those is the numpy operation on the same memory (a ``Tensor`` wraps an ``ndarray`` view, never
a copy unless torch copies too), so the bytes the tier moves are real. Anything else raises
``NotImplementedError`` naming it, so a test that needs more fails instead of passing on a
stand-in. The module is given to the test module as its ``torch`` and nowhere else.

Why not the real torch: a CPU wheel is about 180 MB to download (700 MB installed) for what
numpy already does on the same memory; the suite avoids heavy packages (tests/python/README.md).
"""

from __future__ import annotations

import numpy as np

__version__ = "2.14.0+numpy"


class dtype:  # noqa: N801 (torch's name)
    """A torch dtype: its numpy equivalent."""

    def __init__(self, name: str, np_dtype):
        self.name = name
        self.np = np.dtype(np_dtype)

    def __repr__(self):
        return f"torch.{self.name}"


float32 = dtype("float32", np.float32)
float16 = dtype("float16", np.float16)
uint8 = dtype("uint8", np.uint8)
int8 = dtype("int8", np.int8)
int32 = dtype("int32", np.int32)
int64 = dtype("int64", np.int64)


def _np_dtype(d):
    if d is None:
        return np.dtype(np.float32)
    if isinstance(d, dtype):
        return d.np
    raise NotImplementedError(f"numpy_torch: dtype {d!r}")


class Tensor:
    """A CPU tensor: an ``ndarray`` (a view of the memory it was cut from)."""

    def __init__(self, array: np.ndarray):
        self._a = array

    # -- metadata ---------------------------------------------------------------------------
    @property
    def shape(self):
        return self._a.shape

    def element_size(self) -> int:
        return self._a.itemsize

    def data_ptr(self) -> int:
        return self._a.ctypes.data

    def numpy(self) -> np.ndarray:
        return self._a

    # -- views and copies -------------------------------------------------------------------
    def view(self, *args):
        if len(args) == 1 and isinstance(args[0], dtype):
            return Tensor(self._a.view(args[0].np))
        shape = args[0] if len(args) == 1 and isinstance(args[0], tuple) else args
        out = self._a.view()
        out.shape = shape  # raises instead of copying when no view is possible
        return Tensor(out)

    def clone(self):
        return Tensor(self._a.copy())

    def __getitem__(self, index):
        return Tensor(self._a[index])

    def __setitem__(self, index, value):
        self._a[index] = value._a if isinstance(value, Tensor) else value

    def __len__(self):
        return len(self._a)

    def __getattr__(self, name):
        raise NotImplementedError(f"numpy_torch: Tensor.{name}")


def zeros(*shape, dtype=None):
    if len(shape) == 1 and isinstance(shape[0], tuple):
        shape = shape[0]
    return Tensor(np.zeros(shape, dtype=_np_dtype(dtype)))


def tensor(data, dtype=None):
    return Tensor(np.array(data, dtype=_np_dtype(dtype)))


_rng = np.random.default_rng(0x6B767469)


def rand(*shape, dtype=None):
    if len(shape) == 1 and isinstance(shape[0], tuple):
        shape = shape[0]
    return Tensor(_rng.random(shape).astype(_np_dtype(dtype)))


def allclose(a: Tensor, b: Tensor) -> bool:
    return bool(np.allclose(a._a, b._a))


def __getattr__(name):
    raise NotImplementedError(f"numpy_torch: torch.{name}")
