"""A metadata-only stand-in for torch, for running vLLM's scheduler-side code in tests.

It models exactly what vLLM's KV-cache view and canonical-mapping code reads from tensors:
dtypes with their element sizes, and tensors as *metadata*: shape, stride (in elements),
storage offset, dtype and the byte size of the storage they view. Tensors made by ``zeros``,
``empty`` and friends have no data. The operations modelled only transform metadata, with
torch's own rules and checks:

* ``torch.zeros`` / ``torch.empty`` / ``torch.empty_strided`` / ``torch.tensor`` (shape only);
* ``torch.as_strided`` (bounds-checked against the storage like torch);
* ``Tensor.view(dtype)`` (reinterpreting the last dimension, torch's divisibility rules) and
  ``Tensor.view(*shape)`` of a contiguous tensor;
* ``Tensor[i]`` / ``Tensor[a:b]`` on the first dimension;
* ``shape``, ``size()``, ``stride()``, ``storage_offset()``, ``element_size()``, ``dim()``,
  ``numel()``, ``is_contiguous()``, ``dtype``, ``device``.

One exception carries bytes, because vLLM's shared CPU region is a real mapping:
``torch.frombuffer(buffer, dtype)`` views a Python buffer (the region's mmap); tensors over it
answer ``data_ptr()`` and ``numpy()`` (a numpy array sharing those bytes), which is how vLLM
hands the region to secondary tiers (``create_kv_memoryview``).

It reports ``__version__ = "2.14.0"``, the version vLLM 0.33.0 pins, and no accelerator
(``torch.cuda.is_available()`` is False). Everything else is a placeholder from
``kvtier_placeholders``: importable and callable at import time, refusing to be used as a
value. See tests/python/README.md.
"""

import builtins as _builtins
import math as _math

import kvtier_placeholders as _placeholders

__version__ = "2.14.0"


class dtype:  # noqa: N801 (torch's name)
    """A tensor element type: its name and size in bytes."""

    def __init__(self, name: str, itemsize: int, is_floating_point: bool, is_signed: bool):
        self._name = name
        self.itemsize = itemsize
        self.is_floating_point = is_floating_point
        self.is_complex = False
        self.is_signed = is_signed

    def __repr__(self) -> str:
        return f"torch.{self._name}"

    __str__ = __repr__


# name, bytes per element, floating point, signed
_DTYPES = [
    ("float16", 2, True, True),
    ("bfloat16", 2, True, True),
    ("float32", 4, True, True),
    ("float64", 8, True, True),
    ("float8_e4m3fn", 1, True, True),
    ("float8_e4m3fnuz", 1, True, True),
    ("float8_e5m2", 1, True, True),
    ("float8_e5m2fnuz", 1, True, True),
    ("int8", 1, False, True),
    ("uint8", 1, False, False),
    ("int16", 2, False, True),
    ("int32", 4, False, True),
    ("int64", 8, False, True),
    ("uint16", 2, False, False),
    ("uint32", 4, False, False),
    ("uint64", 8, False, False),
    ("bool", 1, False, False),
]
for _name, _size, _float, _signed in _DTYPES:
    globals()[_name] = dtype(_name, _size, _float, _signed)
# torch's aliases (after the loop: `bool`, `float`, `int` shadow the builtins from here on).
half, double, short, long = float16, float64, int16, int64  # noqa: F821
globals()["float"] = float32  # noqa: F821
globals()["int"] = int32  # noqa: F821


class Size(tuple):
    """A tensor shape."""

    def numel(self):
        return _math.prod(self)


class device:  # noqa: N801 (torch's name)
    """A device name (only ``cpu`` exists here)."""

    def __init__(self, type_name="cpu", index=None):
        if isinstance(type_name, device):
            type_name, index = type_name.type, type_name.index
        self.type = _builtins.str(type_name).split(":")[0]
        self.index = index

    def __repr__(self) -> str:
        return f"device(type='{self.type}')"

    def __eq__(self, other):
        return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))


class _Storage:
    """The backing allocation of one or more tensors: its size in bytes, and the bytes only
    when it views a Python buffer (``frombuffer``)."""

    def __init__(self, nbytes: int, buffer=None):
        self._nbytes = nbytes
        self._buffer = buffer

    def nbytes(self):
        return self._nbytes

    def bytes_array(self):
        """The storage as a flat numpy uint8 array sharing its bytes."""
        if self._buffer is None:
            raise RuntimeError("metadata torch: this tensor has no data (not from frombuffer)")
        import numpy as np

        return np.frombuffer(self._buffer, dtype=np.uint8)


class _PlaceholderClassAttrs(type):
    # vLLM reads some Tensor methods at import (to wrap them); they are placeholders.
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholders.Placeholder(f"torch.{cls.__name__}.{name}")


def _contiguous_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class Tensor(metaclass=_PlaceholderClassAttrs):
    """Tensor metadata: shape, stride (elements), storage offset (elements), dtype, storage."""

    def __init__(self, shape, stride, storage_offset, dtype_, storage, device_=None):
        self._shape = Size(_builtins.int(n) for n in shape)
        self._stride = tuple(_builtins.int(s) for s in stride)
        self._offset = _builtins.int(storage_offset)
        self._dtype = dtype_
        self._storage = storage
        self._device = device_ or device("cpu")
        if len(self._shape) != len(self._stride):
            raise RuntimeError(f"shape {tuple(self._shape)} and stride {self._stride} differ in rank")
        _check_bounds(self._shape, self._stride, self._offset, dtype_, storage)

    # -- metadata --------------------------------------------------------------------------
    @property
    def shape(self):
        return self._shape

    def size(self, dim=None):
        return self._shape if dim is None else self._shape[dim]

    def stride(self, dim=None):
        return self._stride if dim is None else self._stride[dim]

    def storage_offset(self):
        return self._offset

    def element_size(self):
        return self._dtype.itemsize

    @property
    def dtype(self):
        return self._dtype

    @property
    def device(self):
        return self._device

    def dim(self):
        return len(self._shape)

    @property
    def ndim(self):
        return len(self._shape)

    def numel(self):
        return self._shape.numel()

    def is_contiguous(self):
        return all(
            n == 1 or s == c
            for n, s, c in zip(self._shape, self._stride, _contiguous_strides(self._shape))
        )

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __repr__(self) -> str:
        return (
            f"tensor(metadata only, shape={tuple(self._shape)}, stride={self._stride}, "
            f"storage_offset={self._offset}, dtype={self._dtype})"
        )

    # -- metadata transformations ----------------------------------------------------------
    def view(self, *args):
        """``view(dtype)`` reinterprets the elements; ``view(*shape)`` reshapes a contiguous
        tensor (one ``-1`` allowed)."""
        if len(args) == 1 and isinstance(args[0], dtype):
            return _view_dtype(self, args[0])
        shape = list(_shape_arg(args))
        if shape.count(-1) > 1:
            raise RuntimeError("only one dimension can be inferred")
        known = _math.prod(n for n in shape if n != -1)
        if -1 in shape:
            if known == 0 or self.numel() % known:
                raise RuntimeError(f"shape {tuple(shape)} is invalid for input of size {self.numel()}")
            shape[shape.index(-1)] = self.numel() // known
        if _math.prod(shape) != self.numel():
            raise RuntimeError(f"shape {tuple(shape)} is invalid for input of size {self.numel()}")
        if not self.is_contiguous():
            raise NotImplementedError("metadata torch reshapes contiguous tensors only")
        return Tensor(shape, _contiguous_strides(shape), self._offset, self._dtype,
                      self._storage, self._device)

    # -- bytes (only for tensors over a buffer, see frombuffer) -------------------------------
    def data_ptr(self):
        base = self._storage.bytes_array().ctypes.data
        return base + self._offset * self._dtype.itemsize

    def numpy(self):
        """A numpy array sharing this tensor's bytes (like torch's ``numpy()``)."""
        import numpy as np

        np_dtype = _NUMPY_DTYPES.get(self._dtype._name)
        if np_dtype is None:
            raise TypeError(f"metadata torch: {self._dtype} has no numpy equivalent")
        flat = self._storage.bytes_array().view(np_dtype)
        item = self._dtype.itemsize
        return np.lib.stride_tricks.as_strided(
            flat[self._offset:],
            shape=tuple(self._shape),
            strides=tuple(s * item for s in self._stride),
        )

    def __getitem__(self, index):
        if not self._shape:
            raise IndexError("invalid index of a 0-d tensor")
        n, s = self._shape[0], self._stride[0]
        if isinstance(index, _builtins.int):
            i = index + n if index < 0 else index
            if not 0 <= i < n:
                raise IndexError(f"index {index} is out of bounds for dimension 0 with size {n}")
            return Tensor(self._shape[1:], self._stride[1:], self._offset + i * s,
                          self._dtype, self._storage, self._device)
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(n)
            count = max(0, stop - start)
            return Tensor((count, *self._shape[1:]), self._stride, self._offset + start * s,
                          self._dtype, self._storage, self._device)
        raise NotImplementedError("metadata torch models t[i] and t[a:b] on dimension 0 only")

    def __getattr__(self, name):
        raise AttributeError(f"metadata torch: Tensor.{name} is not modelled")


_NUMPY_DTYPES = {
    "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32", "int64": "int64",
    "float16": "float16", "float32": "float32", "float64": "float64", "bool": "bool",
}


def _check_bounds(shape, stride, offset, dtype_, storage):
    """torch's setStorage check: the view must lie inside its storage."""
    if offset < 0 or any(s < 0 for s in stride):
        raise RuntimeError("negative strides or storage offset are not supported")
    if any(n == 0 for n in shape):
        return
    needed = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
    available = storage.nbytes() // dtype_.itemsize
    if needed > available:
        raise RuntimeError(
            f"setStorage: sizes {list(shape)}, strides {list(stride)}, storage offset {offset}, "
            f"and itemsize {dtype_.itemsize} requiring a storage size of "
            f"{needed * dtype_.itemsize} are out of bounds for storage of size {storage.nbytes()}"
        )


def _view_dtype(t, new):
    """torch's Tensor.view(dtype) rules for element sizes that differ by a whole factor."""
    old = t._dtype
    if new.itemsize == old.itemsize:
        return Tensor(t._shape, t._stride, t._offset, new, t._storage, t._device)
    if not t._shape:
        raise RuntimeError("self.dim() cannot be 0 to view when the element size differs")
    if t._stride[-1] != 1:
        raise RuntimeError("self.stride(-1) must be 1 to view when the element size differs")
    if new.itemsize > old.itemsize:
        ratio = new.itemsize // old.itemsize
        if new.itemsize % old.itemsize:
            raise RuntimeError("element sizes must divide each other")
        if t._shape[-1] % ratio:
            raise RuntimeError(f"self.size(-1) must be divisible by {ratio} to view {old} as {new}")
        if t._offset % ratio:
            raise RuntimeError(f"self.storage_offset() must be divisible by {ratio}")
        if any(s % ratio for s in t._stride[:-1]):
            raise RuntimeError(f"self.stride(i) must be divisible by {ratio} for i < dim-1")
        shape = (*t._shape[:-1], t._shape[-1] // ratio)
        stride = (*(s // ratio for s in t._stride[:-1]), 1)
        return Tensor(shape, stride, t._offset // ratio, new, t._storage, t._device)
    ratio = old.itemsize // new.itemsize
    if old.itemsize % new.itemsize:
        raise RuntimeError("element sizes must divide each other")
    shape = (*t._shape[:-1], t._shape[-1] * ratio)
    stride = (*(s * ratio for s in t._stride[:-1]), 1)
    return Tensor(shape, stride, t._offset * ratio, new, t._storage, t._device)


def _shape_arg(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list, Size)):
        size = size[0]
    return tuple(_builtins.int(n) for n in size)


def empty(*size, dtype=None, device=None, **_ignored):
    """A fresh contiguous tensor (metadata only; nothing is allocated)."""
    shape = _shape_arg(size)
    dt = dtype or float32  # noqa: F821
    storage = _Storage(_math.prod(shape) * dt.itemsize)
    return Tensor(shape, _contiguous_strides(shape), 0, dt, storage, _device_of(device))


zeros = empty


def empty_strided(size, stride, *, dtype=None, device=None, **_ignored):
    shape = tuple(size)
    dt = dtype or float32  # noqa: F821
    needed = sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
    return Tensor(shape, stride, 0, dt, _Storage(needed * dt.itemsize), _device_of(device))


def tensor(data, dtype=None, device=None, **_ignored):
    """The shape of ``data``; its values are not kept (there is no data)."""
    shape, probe = [], data
    while isinstance(probe, (list, tuple)):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    if dtype is None:
        dtype = {_builtins.bool: bool, _builtins.int: int64}.get(type(probe), float32)  # noqa: F821
    return empty(tuple(shape), dtype=dtype, device=device)


def frombuffer(buffer, *, dtype, count=-1, offset=0, **_ignored):
    """A 1-D tensor over a writable Python buffer (its bytes are shared, like torch's)."""
    view = memoryview(buffer).cast("B")
    nbytes = len(view)
    if offset or count != -1:
        raise NotImplementedError("metadata torch models frombuffer(buffer, dtype=...) only")
    if nbytes % dtype.itemsize:
        raise ValueError(f"buffer length {nbytes} is not a multiple of element size {dtype.itemsize}")
    n = nbytes // dtype.itemsize
    return Tensor((n,), (1,), 0, dtype, _Storage(nbytes, view), device("cpu"))


def as_strided(input, size, stride, storage_offset=None):  # noqa: A002 (torch's name)
    offset = input.storage_offset() if storage_offset is None else storage_offset
    return Tensor(size, stride, offset, input.dtype, input._storage, input.device)


def is_tensor(obj):
    return isinstance(obj, Tensor)


def _device_of(d):
    return d if isinstance(d, device) else device(d or "cpu")


# Everything else in torch (and every torch.* submodule without a file here) is a placeholder.
def __getattr__(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _placeholders.Placeholder(f"torch.{name}")


_placeholders.install_submodules_of("torch")

from . import cuda, version  # noqa: E402,F401  (real modules: no accelerator)
