"""Every load and store a kernel makes under Triton's interpreter, checked against the tensors its launch was handed:
a CPU stand-in for compute-sanitizer's memcheck, run by every test and fuzz draw that interprets a kernel
(tests/conftest.py, tests/fuzz.py).

On the CPU an access outside the tensors goes unseen: the interpreter reads and writes raw host addresses, a stray
load returns whatever lies there (and is often masked off again later), a stray store lands in another tensor or
in the allocator's free memory. memcheck on a GPU is coarser than this check: it knows the driver's allocations,
which PyTorch's caching allocator carves into many tensors, so an access into a neighbouring tensor passes it. Here
each active lane of a load, store or atomic (masked-off lanes are not accesses) must lie, element and all, inside
the storage of a tensor the launch was handed: a tensor argument (a view counts as its whole storage, as the
kernel may step outside the view within it), a TMA descriptor's base, or the two tensors of a launch.Distance (a
second source addressed from the first: frames_before, channels_after; tconv3d's launch hands Triton the distance
as a plain int, so the Distances made into ints since the last launch count for the next). Anything else raises
IndexError naming the kernel, the access and the tensors, which the interpreter reports as the launch's error.

Where the interpreter's internals are not the ones this was written against (triton 3.6 to 3.9), nothing is
patched and `install` answers False.
"""

from __future__ import annotations

import bisect
import functools
import os

import numpy as np
import torch

_launches = []  # the address ranges of each launch in flight: (kernel name, starts, ends, what each range is)
_distances = []  # the Distances made plain ints since the last launch began


def _ranges(name: str, values) -> tuple:
    """(name, starts, ends, labels): the storages of every tensor among `values`, sorted by address."""
    found = {}

    def add(value, label):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            start = storage.data_ptr()
            if storage.nbytes() and start not in found:
                found[start] = (start + storage.nbytes(), f"{label} {tuple(value.shape)} {value.dtype}")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                add(item, f"{label}[{i}]")
        elif hasattr(value, "block_shape") and hasattr(value, "base"):  # a host-side TMA descriptor
            add(value.base, f"{label}.base")
        elif isinstance(value, int) and hasattr(value, "source"):  # launch.Distance
            add(value.source, f"{label}.source")
            add(value.base, f"{label}.base")

    for label, value in values:
        add(value, label)
    starts = sorted(found)
    return name, starts, [found[s][0] for s in starts], [found[s][1] for s in starts]


def check(kind: str, pointers, mask, element_size: int) -> None:
    """Raise IndexError where an active lane of an access of `element_size` bytes at `pointers` (numpy addresses;
    `mask` numpy booleans or None: all) leaves every storage of the launch in flight."""
    if not _launches:
        return
    name, starts, ends, labels = _launches[-1]
    addresses = np.asarray(pointers, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
    if addresses.size == 0:
        return
    low, high = int(addresses.min()), int(addresses.max()) + element_size
    i = bisect.bisect_right(starts, low) - 1
    if i >= 0 and high <= ends[i]:  # every lane in one storage: the usual case
        return
    flat = addresses.ravel().astype(np.int64)
    index = np.searchsorted(np.asarray(starts, dtype=np.int64), flat, side="right") - 1
    inside = (index >= 0) & (flat + element_size <= np.asarray(ends, dtype=np.int64)[np.maximum(index, 0)])
    if inside.all():
        return
    outside = flat[~inside]
    tensors = "; ".join(f"{label} at [{s:#x}, {e:#x})" for s, e, label in zip(starts, ends, labels, strict=True))
    raise IndexError(
        f"out-of-bounds {kind} in {name}: {outside.size} of {flat.size} active lanes outside every tensor the launch "
        f"was handed (first at {int(outside[0]):#x}, {element_size} bytes); its tensors: {tensors or 'none'}"
    )


def _element_size(pointers) -> int:
    from triton.runtime import interpreter

    return np.dtype(interpreter._get_np_dtype(pointers.get_element_ty())).itemsize


def install() -> bool:
    """Patch the interpreter's launches and memory operations, once a process, where kernels run on it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    names = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    if builder is None or executor is None or not hasattr(interpreter, "_get_np_dtype"):
        return False
    if not all(hasattr(builder, name) for name in names):
        return False
    if getattr(executor.__call__, "checks_bounds", False):
        return True
    run, load, store = executor.__call__, builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    @functools.wraps(run)
    def call(self, *args, **kwargs):
        values = list(zip(self.arg_names, args, strict=False)) + list(kwargs.items())
        values += [("a distance's", distance) for distance in _distances]
        _distances.clear()
        _launches.append(_ranges(getattr(self.fn, "__name__", "a kernel"), values))
        try:
            return run(self, *args, **kwargs)
        finally:
            _launches.pop()

    def masked_load(self, ptrs, mask, *rest, **kwargs):
        check("load", ptrs.data, mask.data, _element_size(ptrs))
        return load(self, ptrs, mask, *rest, **kwargs)

    def masked_store(self, ptrs, value, mask, *rest, **kwargs):
        check("store", ptrs.data, mask.data, _element_size(ptrs))
        return store(self, ptrs, value, mask, *rest, **kwargs)

    def atomic_rmw(self, op, ptr, val, mask, *rest, **kwargs):
        check("atomic", ptr.data, mask.data, _element_size(ptr))
        return rmw(self, op, ptr, val, mask, *rest, **kwargs)

    def atomic_cas(self, ptr, cmp, val, *rest, **kwargs):
        check("atomic", ptr.data, None, _element_size(ptr))
        return cas(self, ptr, cmp, val, *rest, **kwargs)

    try:
        from tconv3d.kernels.launch import Distance
    except ImportError:  # the kernels' path absent: no distance to follow
        pass
    else:

        def plain(distance):
            _distances.append(distance)
            return int.__int__(distance)

        Distance.__int__ = plain

    call.checks_bounds = True
    executor.__call__ = call
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    return True
