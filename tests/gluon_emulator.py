"""An emulator of the Gluon kernels (tconv3d/kernels/conv_gluon.py) on CPU tensors, for the tests.

Triton's interpreter cannot run Gluon, and a GPU is lent to few sessions; without this the Gluon kernels would be
compile-checked only until one runs them. The emulator runs the kernels' own Python source, one program after
another, with the Gluon operations they use replaced by ones on torch tensors, and checks the things a hardware
run would get wrong silently or by hanging:

- TMA: a load copies its box (zeros outside the tensor, negative coordinates included) and counts its bytes on
  the barrier; a store writes the box's in-bounds part. Boxes and buffers must agree in shape and dtype.
- mbarriers: arrivals, expected bytes and phases as the hardware counts them; `wait(bar, parity)` passes once the
  phase of that parity has completed (a new barrier passes parity 1). Waiting where nothing can complete the phase
  is a deadlock, reported with every waiter.
- Hazards, checked as the hardware's asynchronous proxies would expose them: reading a buffer (wgmma, load, TMA
  store) before the barrier its TMA load counts on was waited for; a TMA load or a register store into a buffer an
  unretired wgmma or an unfinished TMA store still reads; a TMA store of a buffer written from registers without
  `fence_async_shared`; a barrier invalidated with bytes in flight; using an accumulator of a wgmma not yet
  waited for.
- wgmma: `is_async` groups retire in order at `warpgroup_mma_wait(num_outstanding)`, reading their operands
  from shared memory then (a buffer overwritten too early gives a wrong result as well as a hazard report);
  fp32 accumulation.
- Pointers: loads and stores outside the tensor's storage under their mask are reported (memcheck's job).
- Integers are int32 (int64 where the argument does not fit) and wrap as the hardware's do; `//` and `%` truncate
  as C's.
- `gl.warp_specialize`: every partition runs in its own thread, one at a time, switching at each barrier, TMA and
  wgmma operation in a seeded random order, so that the producer and the consumers interleave differently from run
  to run.

What it cannot show: anything below the source (register allocation, swizzles beyond a slice's whole swizzle
rows, the compiler's aliasing of allocations, descriptor encoding limits beyond Triton's own host checks, timing).
Those need the GPU."""

import contextlib
import inspect
import itertools
import math
import random
import threading
import types

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from tconv3d.kernels import conv_gluon


class KernelFault(AssertionError):
    """What a hardware run would do wrong: a hazard, a deadlock, an access out of bounds."""


class _Abort(BaseException):
    """Unwinds a partition's thread after another partition failed."""


def _torch_dtype(dtype) -> torch.dtype:
    names = {
        "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64,
        "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "int1": torch.bool,
        "uint8": torch.uint8,
    }  # fmt: skip
    if isinstance(dtype, torch.dtype):
        return dtype
    return names[str(dtype)]


def _gl_dtype(dtype: torch.dtype):
    gl = conv_gluon.gl
    return {
        torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float64: gl.float64,
        torch.int64: gl.int64, torch.int32: gl.int32, torch.bool: gl.int1,
    }[dtype]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Values


def _raw(x):
    return x.t if isinstance(x, Val) else x


def _both_int(a, b) -> bool:
    def is_int(x):
        return isinstance(x, (int, bool)) or (isinstance(x, torch.Tensor) and not x.dtype.is_floating_point)

    return is_int(a) and is_int(b)


def _div(a, b):
    if _both_int(a, b):
        return torch.div(torch.as_tensor(a), b, rounding_mode="trunc")
    return torch.floor_divide(torch.as_tensor(a), b)


def _mod(a, b):
    if _both_int(a, b):
        return torch.fmod(torch.as_tensor(a), b)
    return torch.remainder(torch.as_tensor(a), b)


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


# Integer scalars (program ids, sizes, coordinates: most of what a kernel computes) are Python ints with their
# dtype's wrap-around, not 0-d tensors: the same results, ten times faster.
_SCALAR_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "floordiv": _trunc_div, "mod": lambda a, b: a - b * _trunc_div(a, b),
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "lshift": lambda a, b: a << b, "rshift": lambda a, b: a >> b,
}  # fmt: skip
_SCALAR_COMPARE = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
}  # fmt: skip
_BITS = {torch.int32: 32, torch.int64: 64}


def _wrap(value: int, dtype: torch.dtype) -> int:
    if dtype is torch.bool:
        return value & 1
    half = 1 << (_BITS[dtype] - 1)
    return (value + half) % (2 * half) - half


def _scalar_dtype(a, b) -> torch.dtype:
    """Triton's promotion of two integer scalars (a Python int takes the other's dtype)."""
    da = a.dt if isinstance(a, Val) else None
    db = b.dt if isinstance(b, Val) else None
    kinds = {d for d in (da, db) if d is not None}
    if torch.int64 in kinds:
        return torch.int64
    if kinds == {torch.bool}:
        return torch.bool if all(isinstance(x, (Val, bool)) for x in (a, b)) else torch.int32
    return torch.int32


def _scalar(value: int, dtype: torch.dtype) -> "Val":
    val = object.__new__(Val)
    val._t, val.i, val.dt = None, value, dtype
    return val


_INT32_MIN, _INT32_END = -(2**31), 2**31


def _binary(name, op, reflected=False):
    scalar_op, compare = _SCALAR_OPS.get(name), _SCALAR_COMPARE.get(name)

    def method(self, other):
        si = self.i
        if si is not None and (scalar_op or compare):
            kind = type(other)
            if kind is int or kind is bool:
                oi, odt = int(other), (torch.bool if kind is bool else None)
            elif kind is Val:
                oi, odt = other.i, other.dt
            else:
                oi = None
            if oi is not None:
                a, b = (oi, si) if reflected else (si, oi)
                if compare:
                    return _scalar(int(compare(a, b)), torch.bool)
                sdt = self.dt
                if sdt is torch.int64 or odt is torch.int64:
                    dtype = torch.int64
                elif sdt is torch.bool and odt is torch.bool:
                    dtype = torch.bool
                else:
                    dtype = torch.int32
                value = scalar_op(a, b)
                if dtype is torch.int32:
                    if not _INT32_MIN <= value < _INT32_END:
                        value = _wrap(value, dtype)
                else:
                    value = _wrap(value, dtype)
                return _scalar(value, dtype)
        if isinstance(other, (Ptr, Pending, Smem)):
            return NotImplemented
        a, b = (_raw(other), self.t) if reflected else (self.t, _raw(other))
        if not isinstance(a, torch.Tensor):
            a = torch.tensor(a, dtype=b.dtype) if not isinstance(a, float) or b.dtype.is_floating_point else a
        return Val(op(a, b))

    return method


class _Type:
    def __init__(self, shape, dtype=None):
        self.shape = list(shape)
        self.element_ty = dtype


class Val:
    """A Gluon tensor or scalar: a torch tensor with Triton's integer semantics (`//`, `%` truncate), or an
    integer scalar kept as a Python int `i` of dtype `dt`."""

    __slots__ = ("_t", "dt", "i")

    def __init__(self, t, dtype: torch.dtype | None = None):
        if isinstance(t, Val):
            self._t, self.i, self.dt = t._t, t.i, t.dt
        elif isinstance(t, torch.Tensor):
            self._t, self.i, self.dt = t, None, t.dtype
        elif isinstance(t, (bool, int)):
            if dtype is None:
                dtype = torch.bool if isinstance(t, bool) else torch.int32 if -(2**31) <= t < 2**31 else torch.int64
            self._t, self.i, self.dt = None, int(t), dtype
        else:
            self._t, self.i, self.dt = torch.tensor(t), None, None
            self.dt = self._t.dtype

    @property
    def t(self) -> torch.Tensor:
        if self._t is None:
            self._t = torch.tensor(self.i, dtype=self.dt)
        return self._t

    @property
    def type(self):
        return _Type(self.t.shape, _gl_dtype(self.dt))

    @property
    def shape(self):
        return list(self.t.shape)

    @property
    def dtype(self):
        return _gl_dtype(self.dt)

    def to(self, dtype, **_):
        dtype = _torch_dtype(dtype)
        if self.i is not None and dtype in _BITS:
            return Val(_wrap(self.i, dtype), dtype)
        return Val(self.t.to(dtype))

    def __bool__(self):
        return bool(self.i) if self.i is not None else bool(self.t)

    def __index__(self):
        if self.i is not None:
            return self.i
        if self.t.dtype.is_floating_point:
            raise TypeError("a float used as an index")
        return int(self.t)

    __int__ = __index__

    def __repr__(self):
        return f"Val({self.i if self.i is not None else self.t!r})"

    def __neg__(self):
        return Val(_wrap(-self.i, self.dt), self.dt) if self.i is not None and self.dt in _BITS else Val(-self.t)

    def __invert__(self):
        if self.i is not None:
            return Val(1 - self.i, torch.bool) if self.dt is torch.bool else Val(_wrap(~self.i, self.dt), self.dt)
        return Val(~self.t)

    def __getitem__(self, index):
        return Val(self.t[index])

    __add__, __radd__ = _binary("add", torch.add), _binary("add", torch.add, True)
    __sub__, __rsub__ = _binary("sub", torch.sub), _binary("sub", torch.sub, True)
    __mul__, __rmul__ = _binary("mul", torch.mul), _binary("mul", torch.mul, True)
    __truediv__ = _binary("truediv", torch.true_divide)
    __rtruediv__ = _binary("truediv", torch.true_divide, True)
    __floordiv__, __rfloordiv__ = _binary("floordiv", _div), _binary("floordiv", _div, True)
    __mod__, __rmod__ = _binary("mod", _mod), _binary("mod", _mod, True)
    __and__, __rand__ = _binary("and", torch.bitwise_and), _binary("and", torch.bitwise_and, True)
    __or__, __ror__ = _binary("or", torch.bitwise_or), _binary("or", torch.bitwise_or, True)
    __xor__, __rxor__ = _binary("xor", torch.bitwise_xor), _binary("xor", torch.bitwise_xor, True)
    __lshift__ = _binary("lshift", torch.bitwise_left_shift)
    __rshift__ = _binary("rshift", torch.bitwise_right_shift)
    __lt__, __le__ = _binary("lt", torch.lt), _binary("le", torch.le)
    __gt__, __ge__ = _binary("gt", torch.gt), _binary("ge", torch.ge)
    __eq__, __ne__ = _binary("eq", torch.eq), _binary("ne", torch.ne)
    __hash__ = None


def _same_dtype(a, b):
    """Python scalars take the other operand's dtype, as Triton's do."""
    a, b = _raw(a), _raw(b)
    if not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=b.dtype) if isinstance(b, torch.Tensor) else torch.tensor(a)
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype)
    return a, b


class Ptr:
    """A pointer (tensor) into a tensor argument: `offsets` are element offsets from its first element, checked
    against its storage on every access."""

    def __init__(self, tensor: torch.Tensor, offsets=None):
        self.tensor = tensor
        self.offsets = torch.zeros((), dtype=torch.int64) if offsets is None else offsets

    @property
    def dtype(self):
        return _Type([], _gl_dtype(self.tensor.dtype))

    @property
    def type(self):
        return _Type(self.offsets.shape, _gl_dtype(self.tensor.dtype))

    def __add__(self, other):
        return Ptr(self.tensor, self.offsets + _raw(other).to(torch.int64) if isinstance(other, Val) else
                   self.offsets + other)  # fmt: skip

    __radd__ = __add__

    def _flat(self) -> torch.Tensor:
        t = self.tensor
        length = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
        return torch.as_strided(t, (length,), (1,))

    def _checked(self, mask):
        flat = self._flat()
        offsets = self.offsets
        mask = torch.ones(offsets.shape, dtype=torch.bool) if mask is None else _raw(mask).to(torch.bool)
        offsets, mask = torch.broadcast_tensors(offsets, mask)
        live = offsets[mask]
        if live.numel() and (live.min() < 0 or live.max() >= flat.numel()):
            raise KernelFault(
                f"an access outside its tensor ({tuple(self.tensor.shape)}, {flat.numel()} elements from the "
                f"pointer): offsets {int(live.min())}..{int(live.max())}"
            )
        return flat, offsets, mask


# ---------------------------------------------------------------------------------------------------------------
# Shared memory, barriers and the asynchronous operations of one program (a CTA)


class _Alloc:
    ids = itertools.count()

    def __init__(self, dtype: torch.dtype, shape, swizzle: int = 0):
        self.id, self.swizzle = next(self.ids), swizzle  # swizzle: the layout's swizzle width in bytes
        if dtype.is_floating_point:  # never-written shared memory reads as NaN
            self.t = torch.full(shape, float("nan"), dtype=dtype)
        else:
            self.t = torch.zeros(shape, dtype=dtype)


class Smem:
    """A shared-memory descriptor: a view of an allocation; index, reshape and permute are views, as Gluon's."""

    def __init__(self, alloc: _Alloc, view: torch.Tensor):
        self.alloc, self.t, self._region = alloc, view, None

    @property
    def type(self):
        return _Type(self.t.shape, _gl_dtype(self.t.dtype))

    @property
    def shape(self):
        return list(self.t.shape)

    @property
    def dtype(self):
        return _gl_dtype(self.t.dtype)

    def index(self, i):
        return Smem(self.alloc, self.t[int(i)])

    def reshape(self, shape):
        return Smem(self.alloc, self.t.view([int(s) for s in shape]))

    def permute(self, order):
        return Smem(self.alloc, self.t.permute([int(o) for o in order]))

    def slice(self, start, length, dim=0):
        """A view of `length` elements from `start` along `dim`. Along a swizzled buffer's rows (its unit-stride
        dimension) the slice must hold whole swizzle rows: the compiler refuses narrower ones ("Block shape is too
        small for the swizzle byte size")."""
        start, length, dim = int(start), int(length), int(dim)
        width = self.alloc.swizzle
        if width and self.t.stride(dim) == 1:
            size = self.t.element_size()
            if (length * size) % width or (start * size) % width:
                raise KernelFault(
                    f"a slice of {length * size} bytes at byte {start * size} along the rows of a buffer swizzled "
                    f"{width} bytes wide: the compiler takes whole swizzle rows only"
                )
        return Smem(self.alloc, self.t.narrow(dim, start, length))

    def region(self):
        """(allocation, first element, one past the last) of the view; a view with gaps in that span (a column
        slice) says which elements it holds (_Strided), so that two slices side by side do not overlap."""
        if self._region is None:
            lo = self.t.storage_offset()
            hi = lo + sum((n - 1) * s for n, s in zip(self.t.shape, self.t.stride(), strict=True)) + 1
            self._region = self.alloc.id, lo, hi
            if self.t.numel() != hi - lo:
                offsets = torch.arange(self.alloc.t.numel())
                self._region = _Strided(self._region, torch.as_strided(offsets, self.t.shape, self.t.stride(), lo))
        return self._region

    def store(self, value):
        _ctx().generic_write(self)
        self.t.copy_(_raw(value).to(self.t.dtype))

    def load(self, layout=None):
        _ctx().check_readable(self, "a register load")
        return Val(self.t.clone())


class _Strided(tuple):
    """A view's (allocation, first element, one past the last) with the elements it holds in that span."""

    def __new__(cls, region, offsets: torch.Tensor):
        strided = super().__new__(cls, region)
        strided.offsets = offsets.reshape(-1)
        return strided


def _elements(region) -> torch.Tensor:
    return region.offsets if isinstance(region, _Strided) else torch.arange(region[1], region[2])


def _overlap(r1, r2) -> bool:
    if not (r1[0] == r2[0] and r1[1] < r2[2] and r2[1] < r1[2]):
        return False
    if isinstance(r1, _Strided) or isinstance(r2, _Strided):  # spans that cross: do the elements?
        return bool(torch.isin(_elements(r1), _elements(r2)).any())
    return True


class _Barrier:
    def __init__(self, count: int, where: str):
        self.count, self.pending, self.tx, self.completed, self.where = count, count, 0, 0, where
        self.valid = True

    def state(self) -> str:
        return f"{self.where}: {self.completed} phases done, {self.pending} arrivals and {self.tx} bytes to come"


class Pending:
    """The accumulator of a wgmma group not yet waited for: only another wgmma may take it."""

    def __init__(self, mma):
        self.mma = mma

    def __getattr__(self, name):
        raise KernelFault(f"the accumulator of an in-flight wgmma was used ({name}) before warpgroup_mma_wait")


class _Mma:
    def __init__(self, a: Smem, b: Smem, acc, use_acc):
        self.a, self.b, self.acc, self.use_acc = a, b, acc, use_acc
        self.result = None

    def retire(self):
        acc = self.acc.mma.result if isinstance(self.acc, Pending) else _raw(self.acc)
        if acc is None:
            raise KernelFault("a wgmma retired before the group whose accumulator it took")
        product = _as_mma_operand(self.a.t) @ _as_mma_operand(self.b.t)
        self.result = (acc + product) if self.use_acc else product


# The low mantissa bits wgmma ignores in an fp32 operand: it reads fp32 as TF32 (10 mantissa bits of 23).
TF32_DROPPED_BITS = 0x1FFF


def _as_mma_operand(t: torch.Tensor) -> torch.Tensor:
    """An operand as wgmma's multipliers take it, in fp32: 16-bit floats exactly, fp32 truncated to TF32."""
    if t.dtype == torch.float32:
        return (t.contiguous().view(torch.int32) & ~TF32_DROPPED_BITS).view(torch.float32)
    return t.to(torch.float32)


class _Program:
    """The state of one program: its barriers, the asynchronous operations in flight, the hazards' bookkeeping."""

    def __init__(self, pid, grid, rng):
        self.pid, self.grid, self.rng = pid, grid, rng
        self.barriers: dict = {}
        self.loads: list = []  # [region, barrier key, phase index] of TMA loads no wait has made visible
        self.mmas: list = []  # wgmma groups in flight, oldest first
        self.stores: list = []  # [region] of TMA stores in flight, oldest first
        self.unfenced: list = []  # regions written from registers since the last fence_async_shared
        self.scheduler = _Scheduler(rng)

    # barriers
    def barrier(self, bar: Smem) -> _Barrier:
        key = bar.region()
        state = self.barriers.get(key)
        if state is None or not state.valid:
            raise KernelFault(f"an mbarrier used before mbarrier.init (or after invalidate): {key}")
        return state

    def complete_phase(self, state: _Barrier):
        if state.pending == 0 and state.tx == 0:
            state.completed += 1
            state.pending = state.count

    # hazards
    def check_readable(self, buf: Smem, what: str):
        region = buf.region()
        for load in self.loads:
            if _overlap(load[0], region):
                raise KernelFault(f"{what} read shared memory {region} whose TMA load no mbarrier wait has seen")
        for written in self.unfenced:
            if _overlap(written, region) and what != "a register load":
                raise KernelFault(
                    f"{what} read shared memory {region} written from registers with no fence_async_shared"
                )

    def check_writable(self, buf: Smem, what: str):
        region = buf.region()
        for mma in self.mmas:
            for operand in (mma.a, mma.b):
                if _overlap(operand.region(), region):
                    raise KernelFault(f"{what} overwrote shared memory {region} that an unretired wgmma reads")
        for store in self.stores:
            if _overlap(store, region):
                raise KernelFault(f"{what} overwrote shared memory {region} that a TMA store in flight reads")
        for load in self.loads:
            if _overlap(load[0], region):
                raise KernelFault(f"{what} wrote shared memory {region} while a TMA load into it is unobserved")

    def generic_write(self, buf: Smem):
        self.check_writable(buf, "a register store")
        self.unfenced.append(buf.region())

    def observe(self, key, state: _Barrier, parity: int):
        """A wait for `parity` passed: the loads of the last completed phase of that parity are visible."""
        last = state.completed - 1
        if last >= 0 and (last & 1) != parity:
            last -= 1
        self.loads = [load for load in self.loads if not (load[1] == key and load[2] <= last)]


_STATE = threading.local()


def _ctx() -> _Program:
    program = getattr(_STATE, "program", None)
    if program is None:
        raise RuntimeError("a Gluon operation outside an emulated launch")
    return program


def _pred(pred) -> bool:
    return bool(pred)


# ---------------------------------------------------------------------------------------------------------------
# Partitions: threads taking turns


class _Part:
    def __init__(self, name):
        self.name, self.done, self.waiting = name, False, None


class _Scheduler:
    """Partitions of one program run one at a time; the one running hands the turn on at each synchronising
    operation (to a random runnable partition, itself included) and when it must wait."""

    def __init__(self, rng):
        self.rng, self.cv, self.failure = rng, threading.Condition(), None
        self.parts = [_Part("kernel")]
        self.turn = self.parts[0]

    def _runnable(self):
        return [p for p in self.parts if not p.done and (p.waiting is None or p.waiting[0]())]

    def _hand_on(self, current, include_current=True):
        """Pick who runs next and wait for our turn again (the caller holds cv)."""
        candidates = [p for p in self._runnable() if include_current or p is not current]
        if not candidates:
            if current.done and all(p.done for p in self.parts):
                return
            waits = "; ".join(f"{p.name} waits for {p.waiting[1]()}" for p in self.parts if p.waiting)
            self.failure = self.failure or KernelFault(f"deadlock: {waits}")
            self.cv.notify_all()
            raise _Abort()
        self.turn = self.rng.choice(candidates)
        self.cv.notify_all()
        if current.done:
            return
        while self.turn is not current and self.failure is None:
            self.cv.wait()
        if self.failure is not None:
            raise _Abort()

    def point(self):
        if len(self.parts) > 1:
            with self.cv:
                self._hand_on(self.turn)

    def block(self, ready, describe):
        current = self.turn
        while not ready():
            with self.cv:
                current.waiting = (ready, describe)
                try:
                    self._hand_on(current, include_current=False)
                finally:
                    current.waiting = None

    def run_partitions(self, calls):
        """Run calls[0] in this thread (the default partition) and the others in their own threads; return when
        all have finished."""
        current = self.turn
        workers = [_Part(f"worker{i}") for i in range(1, len(calls))]
        program = _ctx()

        def body(part, call):
            _STATE.program = program
            with self.cv:
                while self.turn is not part and self.failure is None:
                    self.cv.wait()
            try:
                if self.failure is None:
                    call()
            except _Abort:
                pass
            except BaseException as error:  # reported through the default partition
                with self.cv:
                    self.failure = self.failure or error
                    self.cv.notify_all()
            finally:
                with self.cv:
                    part.done = True
                    if self.failure is None:
                        with contextlib.suppress(_Abort):
                            self._hand_on(part)
                    self.cv.notify_all()

        self.parts.extend(workers)
        pairs = zip(workers, calls[1:], strict=True)
        threads = [threading.Thread(target=body, args=pair, daemon=True) for pair in pairs]
        for thread in threads:
            thread.start()
        try:
            self.point()
            calls[0]()
            self.block(lambda: all(p.done for p in workers), lambda: "the other partitions to finish")
        except _Abort:
            pass
        except BaseException as error:  # the workers must stop before it is raised
            with self.cv:
                self.failure = self.failure or error
        finally:
            with self.cv:
                self.cv.notify_all()
            for thread in threads:
                thread.join(timeout=60)
            self.parts = [current]
            self.turn = current
        if self.failure is not None:
            raise self.failure


# ---------------------------------------------------------------------------------------------------------------
# The Gluon operations


class Desc:
    """A host TensorDescriptor as the kernel sees it."""

    def __init__(self, host):
        self.host = host
        self.block_shape = [int(b) for b in host.block_shape]
        self.dtype = _gl_dtype(host.base.dtype)
        self.layout = host.layout
        self.block_type = types.SimpleNamespace(
            shape=self.block_shape, nbytes=math.prod(self.block_shape) * host.base.element_size()
        )
        self.global_view = torch.as_strided(host.base, [int(s) for s in host.shape], [int(s) for s in host.strides])

    def box(self, coords):
        coords = [int(c) for c in coords]
        if len(coords) != len(self.block_shape):
            raise KernelFault(f"{len(coords)} coordinates for a rank-{len(self.block_shape)} descriptor")
        inside, outside = [], []
        for c, b, n in zip(coords, self.block_shape, self.global_view.shape, strict=True):
            lo, hi = max(c, 0), min(c + b, n)
            inside.append(slice(lo, max(hi, lo)))
            outside.append(slice(lo - c, max(hi, lo) - c))
        return tuple(inside), tuple(outside)


def _tma_load(desc, coords, bar, result, pred=True):
    program = _ctx()
    program.scheduler.point()
    if not _pred(pred):
        return
    if not isinstance(desc, Desc):
        raise KernelFault(f"a TMA load from {type(desc).__name__}, not a descriptor")
    if list(result.t.shape) != desc.block_shape or result.t.dtype != desc.host.base.dtype:
        raise KernelFault(f"a TMA box {desc.block_shape} into a buffer {list(result.t.shape)} ({result.t.dtype})")
    program.check_writable(result, "a TMA load")
    state = program.barrier(bar)
    inside, outside = desc.box(coords)
    box = torch.zeros(desc.block_shape, dtype=result.t.dtype)
    box[outside] = desc.global_view[inside]
    result.t.copy_(box)
    state.tx -= desc.block_type.nbytes
    program.loads.append([result.region(), bar.region(), state.completed])
    program.complete_phase(state)


def _tma_store(desc, coords, src):
    program = _ctx()
    program.scheduler.point()
    if list(src.t.shape) != desc.block_shape or src.t.dtype != desc.host.base.dtype:
        raise KernelFault(f"a TMA store of a buffer {list(src.t.shape)} ({src.t.dtype}) to a box {desc.block_shape}")
    program.check_readable(src, "a TMA store")
    inside, outside = desc.box(coords)
    desc.global_view[inside] = src.t[outside]
    program.stores.append(src.region())


def _store_wait(pendings):
    program = _ctx()
    program.scheduler.point()
    keep = int(pendings)
    while len(program.stores) > keep:
        program.stores.pop(0)


def _barrier_init(bar, count):
    program = _ctx()
    key = bar.region()
    if key in program.barriers and program.barriers[key].valid:
        raise KernelFault(f"mbarrier.init of a barrier already initialised: {key}")
    program.barriers[key] = _Barrier(int(count), f"barrier {key}")


def _barrier_invalidate(bar):
    program = _ctx()
    state = program.barrier(bar)
    if state.tx != 0:
        raise KernelFault(f"mbarrier.invalidate with TMA bytes in flight: {state.state()}")
    state.valid = False


def _barrier_expect(bar, nbytes, pred=True):
    program = _ctx()
    program.scheduler.point()
    if not _pred(pred):
        return
    state = program.barrier(bar)
    state.tx += int(nbytes)
    _arrive(program, state, 1)


def _arrive(program, state, count):
    state.pending -= count
    if state.pending < 0:
        raise KernelFault(f"more arrivals than the barrier's count: {state.state()}")
    program.complete_phase(state)


def _barrier_arrive(bar, count=1, pred=True):
    program = _ctx()
    program.scheduler.point()
    if _pred(pred):
        _arrive(program, program.barrier(bar), int(count))


def _barrier_wait(bar, phase, pred=True, deps=()):
    program = _ctx()
    program.scheduler.point()
    if not _pred(pred):
        return
    parity = int(phase) & 1
    state = program.barrier(bar)
    key = bar.region()
    program.scheduler.block(lambda: (state.completed & 1) != parity, lambda: f"parity {parity} of {state.state()}")
    program.observe(key, state, parity)


def _warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    program = _ctx()
    program.scheduler.point()
    for operand in (a, b):
        if not isinstance(operand, Smem):
            raise KernelFault("this emulator takes wgmma operands from shared memory only")
        program.check_readable(operand, "a wgmma")
    shape = (acc.mma.a.t.shape[0], acc.mma.b.t.shape[1]) if isinstance(acc, Pending) else tuple(_raw(acc).shape)
    m, k = a.t.shape
    k2, n = b.t.shape
    if k != k2 or (m, n) != tuple(shape):
        raise KernelFault(f"wgmma shapes: A {m}x{k}, B {k2}x{n}, accumulator {tuple(shape)}")
    if a.t.dtype != b.t.dtype:
        raise KernelFault(f"wgmma operands of two dtypes: {a.t.dtype}, {b.t.dtype}")
    # wgmma reads an fp32 (TF32) operand from shared memory only K-major: A [M, K] and B [K, N] with K innermost.
    if a.t.dtype == torch.float32 and (a.t.stride(1) != 1 or b.t.stride(0) != 1):
        raise KernelFault(
            f"wgmma takes fp32 operands only K-major: A {m}x{k} strides {a.t.stride()}, B {k2}x{n} strides "
            f"{b.t.stride()}"
        )
    mma = _Mma(a, b, acc, bool(use_acc))
    program.mmas.append(mma)
    if not is_async:
        _warpgroup_mma_wait(0)
        return Val(mma.result)
    return Pending(mma)


def _warpgroup_mma_wait(num_outstanding=0, deps=()):
    program = _ctx()
    program.scheduler.point()
    while len(program.mmas) > int(num_outstanding):
        program.mmas.pop(0).retire()
    resolved = tuple(Val(d.mma.result) if isinstance(d, Pending) and d.mma.result is not None else d for d in deps)
    return resolved[0] if len(resolved) == 1 else resolved


def _fence_async_shared(cluster=False):
    _ctx().unfenced.clear()


def _allocate_shared_memory(element_ty, shape, layout=None, value=None):
    alloc = _Alloc(_torch_dtype(element_ty), [int(s) for s in shape], getattr(layout, "swizzle_byte_width", 0))
    smem = Smem(alloc, alloc.t)
    if value is not None:
        smem.store(value)
    return smem


def _warp_specialize(functions_and_args, worker_num_warps=None, worker_num_regs=None, **_):
    if callable(functions_and_args):  # triton 3.6's positional form: (default_args, default_fn, worker_args, fns)
        raise KernelFault("the emulator takes warp_specialize([(fn, args), ...], warps, regs)")
    calls = [lambda fn=fn, args=args: fn(*args) for fn, args in functions_and_args]
    _ctx().scheduler.run_partitions(calls)


def _load(pointer, mask=None, other=None, **_):
    flat, offsets, mask = pointer._checked(mask)
    fill = 0 if other is None else _raw(other)
    values = torch.full(offsets.shape, fill, dtype=flat.dtype)
    values[mask] = flat[offsets[mask]]
    return Val(values)


def _store(pointer, value, mask=None, **_):
    flat, offsets, mask = pointer._checked(mask)
    values = _raw(value).to(flat.dtype) if isinstance(value, Val) else torch.tensor(value, dtype=flat.dtype)
    values = torch.broadcast_to(values, offsets.shape)
    live = offsets[mask]
    if live.numel() != live.unique().numel():
        raise KernelFault("a store writes one address twice")
    flat[live] = values[mask].to(flat.dtype)


def _extreme(a, b, pick, op):
    if not isinstance(a, Val) and not isinstance(b, Val):
        return pick(a, b)
    if all(isinstance(x, int) or x.i is not None for x in (a, b)):
        return Val(pick(int(a), int(b)), _scalar_dtype(a, b))
    return Val(op(*_same_dtype(a, b)))


def _minimum(a, b, *_, **__):
    return _extreme(a, b, min, torch.minimum)


def _maximum(a, b, *_, **__):
    return _extreme(a, b, max, torch.maximum)


def _where(condition, x, y):
    x, y = _same_dtype(x, y)
    return Val(torch.where(_raw(condition).to(torch.bool), x, y))


def _cdiv(a, b):
    return (a + b - 1) // b


def _program_id(axis):
    return Val(_ctx().pid[int(axis)], torch.int32)


def _num_programs(axis):
    return Val(_ctx().grid[int(axis)], torch.int32)


def _zeros(shape, dtype, layout=None):
    return Val(torch.zeros([int(s) for s in shape], dtype=_torch_dtype(dtype)))


def _arange(start, end, layout=None):
    return Val(torch.arange(int(start), int(end), dtype=torch.int32))


def _expand_dims(x, axis):
    return Val(_raw(x).unsqueeze(int(axis)))


def _static_range(*args):
    return range(*[int(a) for a in args])


def _static_assert(condition, message=""):
    if not condition:
        raise KernelFault(f"static_assert: {message}")


# The asm statements the kernels hold, each as what it computes: a conversion of two fp32 elements an instruction,
# rounding to nearest even as torch's `.to` does (conv_gluon._downcast). Any other asm is refused.
_ASM = {
    "cvt.rn.bf16x2.f32 $0, $2, $1;": torch.bfloat16,
    "cvt.rn.f16x2.f32 $0, $2, $1;": torch.float16,
}


def _inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
    if asm not in _ASM or _torch_dtype(dtype) != _ASM[asm] or len(args) != 1 or int(pack) != 2:
        raise KernelFault(f"the emulator has no stand-in for the asm statement {asm!r} (pack {pack}, {dtype})")
    (value,) = args
    if value.dt != torch.float32 or value.t.shape[-1] % 2:
        raise KernelFault(f"{asm!r} converts pairs of fp32 elements, not {value.dt} of shape {value.shape}")
    return Val(value.t.to(_ASM[asm]))


_OPERATIONS = dict(
    inline_asm_elementwise=_inline_asm_elementwise,
    allocate_shared_memory=_allocate_shared_memory, static_range=_static_range, static_assert=_static_assert,
    program_id=_program_id,
    num_programs=_num_programs, zeros=_zeros, arange=_arange, expand_dims=_expand_dims, where=_where,
    minimum=_minimum, maximum=_maximum, cdiv=_cdiv, load=_load, store=_store, warp_specialize=_warp_specialize,
    # mbarrier
    init=_barrier_init, invalidate=_barrier_invalidate, expect=_barrier_expect, arrive=_barrier_arrive,
    wait=_barrier_wait,
    # tma: 3.6's names and 3.7's
    async_load=_tma_load, async_copy_global_to_shared=_tma_load, async_store=_tma_store,
    async_copy_shared_to_global=_tma_store, store_wait=_store_wait,
    # hopper
    warpgroup_mma=_warpgroup_mma, warpgroup_mma_wait=_warpgroup_mma_wait, fence_async_shared=_fence_async_shared,
)  # fmt: skip


def _mocks() -> dict:
    """id(real object) -> its stand-in, for the modules gl, tl, mbarrier and tma and every operation of theirs
    (and of Gluon's hopper module) in _OPERATIONS: however a kernel's module names them. Taken from Triton's
    modules, not from conv_gluon's names, so that a test may replace one of those with a @gluon.jit function."""
    import triton.language as tl
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper

    mocks = {}
    for real in (gl, tl, hopper.mbarrier, hopper.tma, hopper):
        names = {n: getattr(real, n) for n in dir(real) if not n.startswith("__")}
        names.update({n: op for n, op in _OPERATIONS.items() if n in names}, constexpr=lambda x: x)
        mocks[id(real)] = types.SimpleNamespace(**names)
        for name, op in _OPERATIONS.items():
            if hasattr(real, name):
                mocks[id(getattr(real, name))] = op
    return mocks


def _python(jit, mocks: dict, cache: dict):
    """The Python function of a @gluon.jit or @triton.jit function, its globals replaced by stand-ins."""
    fn = jit.fn
    if fn in cache:
        return cache[fn]
    scope = dict(fn.__globals__)
    emulated = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    cache[fn] = emulated
    for name, value in fn.__globals__.items():
        if id(value) in mocks:
            scope[name] = mocks[id(value)]
        elif isinstance(value, (JITFunction, InterpretedFunction)):
            scope[name] = _python(value, mocks, cache)
        elif isinstance(value, tl.constexpr):  # a module's constant, as the compiler reads it
            scope[name] = value.value
    return emulated


def _argument(value, constexpr: bool):
    if constexpr or value is None:
        return value
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            raise ValueError("the Gluon emulator runs on CPU tensors")
        return Ptr(value)
    if type(value).__name__ == "TensorDescriptor":
        return Desc(value)
    if isinstance(value, (bool, int)):
        return Val(value)
    if isinstance(value, float):
        return Val(torch.tensor(value, dtype=torch.float32))
    return value


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    return "constexpr" in str(parameter.annotation)


class Emulator:
    """Runs launches of the Gluon kernels; `launches` counts them by kernel name, `grids` holds each launch's
    (kernel name, grid, num_warps, launch options). `seed` orders the partitions' turns."""

    def __init__(self, seed: int = 0):
        self.seed, self.launches, self.programs, self.grids = seed, {}, 0, []
        self._cache: dict = {}

    def launch(self, kernel, grid, *args, **kwargs):
        fn = _python(kernel, _mocks(), self._cache)
        parameters = inspect.signature(kernel.fn).parameters
        options = {k: v for k, v in kwargs.items() if k not in parameters}  # maxnreg, ...: recorded, not emulated
        self.grids.append((kernel.fn.__name__, tuple(grid), kwargs.get("num_warps"), options))
        kwargs = {k: v for k, v in kwargs.items() if k in parameters}
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
        values = {
            name: _argument(value, _is_constexpr(parameters[name])) for name, value in bound.arguments.items()
        }  # fmt: skip
        grid = tuple(grid) + (1,) * (3 - len(grid))
        rng = random.Random(self.seed + sum(self.launches.values()))
        self.launches[kernel.fn.__name__] = self.launches.get(kernel.fn.__name__, 0) + 1
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiles are small: a thread pool costs more than it gives, and spins when shared
        try:
            self._programs(fn, values, grid, rng, kernel.fn.__name__)
        finally:
            torch.set_num_threads(threads)

    def _programs(self, fn, values, grid, rng, name):
        for pid in itertools.product(*(range(g) for g in grid)):
            program = _Program(pid, grid, rng)
            _STATE.program = program
            try:
                try:
                    fn(**values)
                except _Abort:
                    raise program.scheduler.failure from None
                if program.mmas:
                    raise KernelFault(f"program {pid} ended with {len(program.mmas)} wgmma groups unretired")
                if program.stores:
                    raise KernelFault(f"program {pid} ended with {len(program.stores)} TMA stores in flight")
            except KernelFault as fault:
                raise KernelFault(f"{name}, program {pid}: {fault}") from None
            finally:
                _STATE.program = None
            self.programs += 1


@contextlib.contextmanager
def emulating(monkeypatch, seed: int = 0):
    """Run the Gluon kernels through an Emulator wherever tconv3d would launch them, and let the CPU take them
    (choice._gluon_runs). Yields the emulator."""
    from tconv3d.tune import choice

    emulator = Emulator(seed)
    monkeypatch.setattr(conv_gluon, "launch", emulator.launch)
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)
    monkeypatch.setattr(choice, "_memo", {})
    yield emulator
