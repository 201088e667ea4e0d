"""Call plans: a convolution op's launches replayed without the Python that chose them (issue 29).

A layer calls its op with the same arguments but data step after step, and each call checks them, chooses a
config, and builds every launch's grid, descriptors and integer arguments again: 60-100 us of host Python an op on
an H100's host, more than the kernels of a small layer take. A plan is what one such call did, kept by its
arguments (`key`): the tensors it allocated (shape, strides, dtype, device), and each launch's compiled kernel,
grid and arguments, every tensor among them as a slot (an input of the call, or an allocation) or a view of one,
every TMA descriptor as its checked template on such a tensor. A later call with the same key allocates the same
tensors and calls the compiled kernels' launchers directly (kernels/launch.py's direct path, the last step of
each launch); nothing else runs.

A convolution's backward (ops._gradients) is one call, with one plan of its gradients' launches. A plan is
recorded from a call that already ran every launch directly (so not the first, which compiles), and it is only made
where replaying it is the same call:
- what the key holds decides everything the call did: every tensor's shape, strides, storage offset, dtype,
  device and 16-byte alignment, the integer arguments (plain ints only, as geometry's memo), the groups and
  padding mode, and whether fp32 may run as TF32;
- an int computed from addresses (a pointer kernel's launch.Distance: a second source's, frames_before's or
  channels_after's, distance from the input) is computed again from the two tensors at each replay; where it
  falls in another class of Triton's specialisation than the recorded one (its range or divisibility by 16,
  which the key's 16-byte alignments do not fix), that call takes the whole path;
- every aten op the call ran was an allocation, a view, or a copy, clone or fill between tensors of the call (a
  TorchDispatchMode watches the recording call): these are replayed in their place among the launches (a grouped
  weight gradient's diagonal blocks; a weight cloned into channels_last_3d, as an allocation and a copy); any
  other op on the host side (a reduction, an op on a tensor of unknown origin) is not, so a call that ran one
  gets no plan;
- every tensor a launch reads is an input's storage or a tensor the call allocated;
- every launch was direct: a kernel that goes through Triton's run (pre-run hooks, a callable grid) has no plan.
Such calls are remembered as refused and run as before.

Plans live in tune/choice.py's memo of decisions, so whatever clears or swaps that memo (a setting changed in a
test, a forced variant in the bench) drops them with it; they hold compiled kernels, so launch.forget() ends them
too (launch.generation). A replay is checked the same way as the direct path: the device and Triton's debug and
instrumentation settings must be those recorded. Under the interpreter, with TCONV3D_DIRECT_LAUNCH=0, while a
graph is traced for Inductor or compile-only runs are made, there are no plans (`key` is None).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import settings
from .geometry import PLAIN_TENSORS, int_sequence_key
from .kernels import launch
from .kernels.utils import on_base
from .tune import choice

aten = torch.ops.aten
_ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                aten.new_empty_strided.default, aten.empty_like.default)  # fmt: skip
# Host-side ops a plan replays in place among its launches: what they do depends on the tensors' shapes, strides
# and dtypes alone, which the key holds.
_REPLAYED = (aten.copy_.default, aten.zero_.default, aten.fill_.Scalar)
_PLAN = object()  # first element of a plan's key in choice's memo, so no decision's key equals it
MAX_ENTRIES = 16384  # entries of choice's memo past which no call is remembered for a plan


class Refused(str):
    """A key's entry when its calls cannot be replayed: why."""


_SEEN = Refused("called once: the next call records")


_bypassed = 0


@contextlib.contextmanager
def bypassed():
    """Inside, calls neither replay nor record plans: each takes the whole path (to time or check one against the
    other)."""
    global _bypassed
    _bypassed += 1
    try:
        yield
    finally:
        _bypassed -= 1


def key(op: str, tensors: tuple, int_sequences: tuple, *scalars) -> tuple | None:
    """The plan key of a call of `op` with these tensors (None where absent), sequences of ints and other
    scalars (str, int, float or bool: a norm's eps), or None where the call can have no plan (see the module's
    docstring)."""
    if launch.OFF is not None or launch._suspended or launch._traced or _bypassed:
        return None
    parts = [_PLAN, op, *scalars]
    for s in scalars:
        if type(s) not in (int, str, float, bool):
            return None
    for values in int_sequences:
        values = int_sequence_key(values)
        if values is None:
            return None
        parts.append(values)
    fp32 = False
    for t in tensors:
        if t is None:
            parts.append(None)
            continue
        if type(t) not in PLAIN_TENSORS:
            return None
        dtype = t.dtype
        fp32 = fp32 or dtype == torch.float32
        parts += (t.shape, t.stride(), t.storage_offset(), dtype, t.device, t.data_ptr() % 16)
    if fp32:
        parts.append(settings.tf32_allowed())
    return tuple(parts)


def find(plan_key):
    """The plan remembered for `plan_key` (a `key`), or None: none yet, refused, or made before launch.forget()."""
    if plan_key is None:
        return None
    plan = choice._memo.get(plan_key)
    if type(plan) is not Plan or plan.generation != launch.generation:
        return None
    return plan


def recorded(plan_key, inputs: tuple, call):
    """call(), which launches the op's kernels on `inputs`; from the second call of `plan_key` on, recorded as its
    plan where it can be replayed (see the module's docstring): the first may tune or compile. Returns what call
    returns."""
    if plan_key is None:
        return call()
    entry = choice._memo.get(plan_key)
    if entry is None or type(entry) is Plan:  # none yet, or one made before launch.forget() (find passed it by)
        if len(choice._memo) < MAX_ENTRIES:  # past that (shapes that never repeat), calls run whole
            choice._memo[plan_key] = _SEEN
        return call()
    if entry is not _SEEN:
        return call()
    launches = []
    watch = _Watch(launches)
    with launch.recording(launches), watch:  # the dispatch mode is this thread's too
        output = call()
    plan = _plan(inputs, output, watch, launches)
    if plan is not None:  # a call that compiled a kernel is recorded again next time
        choice._memo[plan_key] = plan
    return output


class _Watch(TorchDispatchMode):
    """The tensors allocated under it; each copy or fill (_REPLAYED), appended to `steps` (the recording's launches,
    so that it keeps its place among them) as (func, args), a clone as an allocation and a copy; and the first aten
    op that was none of these nor a view."""

    def __init__(self, steps: list):
        super().__init__()
        self.allocated, self.steps, self.other = [], steps, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:  # an op that may alias or copy (contiguous, reshape) reaches a mode whole where another
            with self:  # mode is stacked below this one: what it does, an alias or a clone, is seen here
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(out)
        elif func in _REPLAYED and not kwargs:
            self.steps.append(_HostOp(func, args))
        elif func is aten.clone.default:  # its strides follow from its input's and the format: empty + copy
            self.allocated.append(out)
            self.steps.append(_HostOp(aten.copy_.default, (out, args[0])))
        elif not func.is_view and self.other is None:
            self.other = str(func)
        return out


class _HostOp:
    __slots__ = ("args", "func")

    def __init__(self, func, args):
        self.func, self.args = func, args


class Plan:
    """One recorded call: `allocations` [(shape, strides, dtype, device)], `constants` [tensor], `launches`
    [_Launch], `outputs` ((slot, view) or None, ...), returned as a tuple (a norm's output and statistics; None
    where the call returned None: a GroupNorm backward's PReLU weight gradient without a PReLU) or, `single`, the
    one tensor. Slots are the call's inputs, its allocations, then the constants. An allocation is made before
    the first step that uses it and dropped after its last (an output at the end), as the whole path's Python
    lets go of it: a backward's split partials of the input gradient are freed before the weight gradient's are
    made (`lifetimes`)."""

    __slots__ = ("allocations", "checks", "constants", "frees", "generation", "launches", "makes", "outputs",
                 "single", "state")  # fmt: skip

    def __init__(self, allocations, constants, launches, outputs, single, lifetimes, inputs):
        self.allocations, self.constants, self.launches = allocations, constants, launches
        self.outputs, self.single = outputs, single
        self.state, self.generation = launch.signature_state(), launch.generation
        # per step (and one past the last): the allocations made before it, those dropped after it (_lifetimes)
        self.makes, self.frees = lifetimes
        # the distances between two of the `inputs` inputs (a second source and the input, the usual case): checked
        # before the first step; one that involves an allocation is checked at its step
        self.checks = [d[1:] for step in launches for d in step.distances if d[1][0] < inputs and d[2][0] < inputs]

    def __call__(self, inputs: tuple) -> torch.Tensor:
        state = launch.signature_state()
        if state != self.state:
            raise _Stale
        first = len(inputs)
        slots = [*inputs, *([None] * len(self.allocations)), *self.constants]
        for source, base, itemsize, specialized in self.checks:
            _check_distance(slots, source, base, itemsize, specialized)
        allocations, makes, frees = self.allocations, self.makes, self.frees
        device = state[0]
        launch.context_current(device)
        for index, step in enumerate(self.launches):
            for made in makes[index]:
                shape, strides, dtype, place = allocations[made]
                slots[first + made] = torch.empty_strided(shape, strides, dtype=dtype, device=place)
            values = step.template.copy()
            for position, slot, view, descriptor in step.tensors:
                t = slots[slot] if view is None else slots[slot].as_strided(*view)
                if descriptor is not None:
                    t = on_base(descriptor, t)
                values[position] = t
            for position, source, base, itemsize, specialized in step.distances:
                values[position] = _check_distance(slots, source, base, itemsize, specialized)
            if step.compiled is None:  # a copy or fill on the host side: grid is its aten op
                step.grid(*values)
            else:
                launch.launch_compiled(step.compiled, step.grid, values, device)
            values = t = None  # nothing here keeps a dropped allocation alive
            for freed in frees[index]:
                slots[first + freed] = None
        for made in makes[-1]:  # outputs no step uses
            shape, strides, dtype, place = allocations[made]
            slots[first + made] = torch.empty_strided(shape, strides, dtype=dtype, device=place)
        if self.single:
            return _output(slots, self.outputs[0])
        return tuple(_output(slots, returned) for returned in self.outputs)


class _Stale(Exception):
    """A plan recorded under another device or Triton setting than the current ones."""


class _Unreplayable(Exception):
    """A call whose distance between two of its tensors falls in another class of Triton's specialisation than
    the recorded call's: it takes the whole path, and the plan stays for the calls that fit. Raised before the
    first step where both tensors are inputs; else at the distance's step, after earlier steps wrote only into
    allocations of their own, which the whole path makes again."""


def _address(slots: list, slot: int, view: tuple | None, itemsize: int) -> int:
    """The address of a plan step's tensor of `itemsize`-byte elements: slot `slot`, or its `.as_strided(*view)`,
    without making the view."""
    t = slots[slot]
    return t.data_ptr() if view is None else t.untyped_storage().data_ptr() + view[2] * itemsize


def _check_distance(slots: list, source: tuple, base: tuple, itemsize: int, specialized) -> int:
    """The distance in elements from `base`'s tensor to `source`'s ((slot, view) each, one dtype), if it falls in
    the recorded class `specialized` of Triton's specialisation; else _Unreplayable."""
    distance = (_address(slots, *source, itemsize) - _address(slots, *base, itemsize)) // itemsize
    if launch.specialization(distance) != specialized:
        raise _Unreplayable
    return distance


def replay(plan: Plan, plan_key, inputs: tuple, call):
    """plan(inputs), or call() recorded afresh where the device or Triton's settings changed since it was made
    (run whole where a distance does not fit the plan's kernels: _Unreplayable)."""
    try:
        return plan(inputs)
    except _Stale:
        del choice._memo[plan_key]
        return recorded(plan_key, inputs, call)
    except _Unreplayable:
        return call()


class _Launch:
    """A step of a plan: a compiled kernel's launch on `grid`, or (compiled None) the aten op `grid` called on the
    values; `template` holds the values that are neither tensors nor distances, `tensors` (position, slot, view,
    descriptor) the tensors, `distances` (position, (slot, view) of the source and of the base, their element size,
    the recorded value's launch.specialization) the ints computed from addresses."""

    __slots__ = ("compiled", "distances", "grid", "template", "tensors")

    def __init__(self, compiled, grid, template, tensors, distances):
        self.compiled, self.grid, self.template, self.tensors = compiled, grid, template, tensors
        self.distances = distances

    def slots(self):
        """The slots this step reads: its tensors', and its distances' two tensors'."""
        for _, slot, _, _ in self.tensors:
            yield slot
        for _, source, base, _, _ in self.distances:
            yield source[0]
            yield base[0]


def _output(slots: list, returned):
    """A replayed call's output: its slot's tensor (as the view the call returned), or None."""
    if returned is None:
        return None
    slot, view = returned
    return slots[slot] if view is None else slots[slot].as_strided(*view)


def _plan(inputs: tuple, output, watch: _Watch, launches: list) -> Plan | Refused | None:
    """The plan of a recorded call, Refused (why), or None where the call compiled a kernel (record again)."""
    if watch.other is not None:
        return Refused(f"the call ran {watch.other} on the host side")
    if any(step is launch.RUN_ALWAYS for step in launches):
        return Refused("a launch goes through Triton's run")
    if any(step is launch.RUN_NOW for step in launches):
        return None
    try:
        slots = _Slots(inputs, watch.allocated)
        steps = [_launch_of(step, slots) for step in launches]
        returned = output if isinstance(output, tuple) else (output,)
        tensors = [t for t in returned if t is not None]
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise _Unplanned("the call returns something other than tensors (and None)")
        returned = [slots.of(t) if t is not None else None for t in returned]
    except _Unplanned as why:
        return Refused(str(why))
    # Allocations no launch reads and the call does not return (a launcher's attempt that raised before it
    # launched, choice.launch's RiskyTensorMap) are not made again; constants follow the allocations kept.
    used = {slot for slot, _ in filter(None, returned)} | {slot for step in steps for slot in step.slots()}
    count = len(inputs)
    kept = [i for i in range(count, count + len(watch.allocated)) if i in used]
    renumber = {i: i for i in range(count)}
    for new, old in enumerate(kept + slots.constants):
        renumber[old] = count + new
    for step in steps:
        step.tensors = [(position, renumber[slot], view, d) for position, slot, view, d in step.tensors]
        step.distances = [
            (position, (renumber[source[0]], source[1]), (renumber[base[0]], base[1]), itemsize, specialized)
            for position, source, base, itemsize, specialized in step.distances
        ]
    returned = tuple((renumber[r[0]], r[1]) if r is not None else None for r in returned)
    tensors = slots.tensors
    allocations = [(tuple(tensors[i].shape), tensors[i].stride(), tensors[i].dtype, tensors[i].device) for i in kept]
    constants = [tensors[i] for i in slots.constants]
    lifetimes = _lifetimes(count, kept, steps, returned)
    return Plan(allocations, constants, steps, returned, not isinstance(output, tuple), lifetimes, count)


def _lifetimes(count: int, kept: list, steps: list, returned: tuple) -> tuple:
    """(makes, frees) of Plan: per step, the allocations (numbered from 0) made before it (one more entry: those
    made after the last step, outputs that no step uses), and those dropped after it (the last step to use them,
    unless returned)."""
    first_use, last_use = {}, {}
    for index, step in enumerate(steps):
        for slot in step.slots():
            if count <= slot < count + len(kept):
                first_use.setdefault(slot - count, index)
                last_use[slot - count] = index
    outputs = {slot - count for slot, _ in filter(None, returned)}
    makes = [[] for _ in range(len(steps) + 1)]
    frees = [[] for _ in steps]
    for made in range(len(kept)):
        makes[first_use.get(made, len(steps))].append(made)
        if made in last_use and made not in outputs:
            frees[last_use[made]].append(made)
    return [tuple(m) for m in makes], [tuple(f) for f in frees]


class _Unplanned(Exception):
    pass


class _Slots:
    """The tensors of a recorded call by storage: its inputs, its allocations, and the constants its launches
    read (a table a launcher keeps, marked `plan_constant`: conv_tma.live_tap_table's), in that order."""

    def __init__(self, inputs, allocated):
        self.tensors, self.by_storage, self.constants = [*inputs, *allocated], {}, []
        for index, t in enumerate(self.tensors):
            if t is None:
                continue
            if t.untyped_storage().nbytes() == 0:
                raise _Unplanned("an empty tensor")
            if self.by_storage.setdefault(_storage(t), index) != index:
                raise _Unplanned("two inputs or allocations share a storage")

    def of(self, t: torch.Tensor) -> tuple:
        """(slot, view): t is the slot's tensor if view is None, else its .as_strided(*view)."""
        if type(t) not in PLAIN_TENSORS:
            raise _Unplanned(f"a launch reads a {type(t).__name__}")
        slot = self.by_storage.get(_storage(t))
        if slot is None:
            if not getattr(t, "plan_constant", False):
                raise _Unplanned("a launch reads a tensor that is neither an input nor allocated by the call")
            slot = self.by_storage[_storage(t)] = len(self.tensors)
            self.tensors.append(t)
            self.constants.append(slot)
        own = self.tensors[slot]
        if t is own or (t.shape, t.stride(), t.storage_offset(), t.dtype) == (
            own.shape, own.stride(), own.storage_offset(), own.dtype
        ):  # fmt: skip
            return slot, None
        if t.dtype != own.dtype:
            raise _Unplanned("a launch reads a tensor as another dtype")
        return slot, (tuple(t.shape), t.stride(), t.storage_offset())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _launch_of(step, slots: _Slots) -> _Launch:
    if type(step) is _HostOp:
        compiled, trailing, grid, args = None, (), step.func, step.args
    else:
        compiled, trailing, grid, args = step
        grid = tuple(grid)
    template, tensors, distances = [], [], []
    for position, a in enumerate(args):
        if a is None or type(a) in (int, float, bool, str):
            template.append(a)
        elif type(a) is launch.Distance:  # of one dtype's tensors (utils.second_source_arguments)
            template.append(None)
            distances.append((position, slots.of(a.source), slots.of(a.base), a.base.element_size(),
                              launch.specialization(a)))  # fmt: skip
        elif isinstance(a, torch.Tensor):
            template.append(None)
            tensors.append((position, *slots.of(a), None))
        elif hasattr(a, "launch_signature") and isinstance(a.base, torch.Tensor):  # utils.tensor_descriptor's
            template.append(None)
            tensors.append((position, *slots.of(a.base), on_base(a, None)))
        else:
            raise _Unplanned(f"a launch takes a {type(a).__name__}")
    return _Launch(compiled, grid, template + list(trailing), tensors, distances)
