"""Speed-ups of Triton's interpreter, for the tests (tests/conftest.py) and the standalone fuzzer (tests/fuzz.py).

Each leaves the interpreter's results, types and errors as they were (tests/test_conftest.py holds them to the
interpreter's own path) and applies only where its internals are the ones this was written against (triton 3.6
and 3.9); elsewhere nothing is patched. `install()` applies them under TRITON_INTERPRET=1, after tconv3d's import.
"""

import contextlib
import dataclasses
import os


def patch_language_once_a_launch():
    """Make Triton's interpreter patch triton.language once a launch instead of once a device-function call.

    The interpreter swaps triton.language's builtins for interpreted ones when a launch starts (restoring them when
    it ends) and again, through inspect.getmembers over the whole module, at every call of a @triton.jit helper
    inside it: thousands of calls a test, a third of the interpreter's time on the TMA kernels. Inside a launch the
    modules a helper sees (triton.language, triton.language.core) are already patched unless it sees one the kernel
    does not; then it is patched as before. Same semantics, same kernels; where the interpreter's internals are not
    the ones this was written against (triton 3.6 and 3.9), it is left alone."""
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(scope_type, "restore"):
        return
    launch = []  # the live launch's patched modules (ids), while one runs

    @functools.cache
    def modules(fn):
        return frozenset(
            id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)
        )

    def patch_lang(fn):
        seen = modules(fn)
        if launch and seen <= launch[0]:
            return scope_type()  # a helper inside a launch: already patched
        scope = patch_lang.original(fn)
        if launch:  # a helper that sees a module the kernel does not: kept, as the interpreter keeps it
            launch[0] = launch[0] | seen
            return scope
        restore = scope.restore

        def restore_and_end():
            launch.clear()
            restore()

        scope.restore = restore_and_end
        launch.append(seen)
        return scope

    patch_lang.original = original  # the interpreter's own, which tests/test_launch.py counts
    interpreter._patch_lang = patch_lang


def shortcut_the_interpreters_frontend():
    """Shortcuts through Triton's interpreter where its own path builds objects only to arrive where it started.

    Profiled on an interpreted kernel (a small-tiles input gradient, 2026-11-30), three fifths of its time went to
    Python objects the frontend builds for every operation, not to numpy:
    - `tl.block_type(element, shape)` unwraps and validates its shape and formats its name each time, 200,000 times
      in that test: its fields are computed once a (element, shape) and reused; a tensor's shape (a tuple of
      constexprs, with its own tuple type) is built from its block type when first read, which most never are;
      `_get_np_dtype` (a 20-entry dict built a call) is looked up once a type; a builtin's stand-in passes its
      keyword arguments on without copying them into a new dict on every call.
    - `binary_op_type_checking_impl`, behind every `+`, `*`, `//`, `%`, comparison and mask combination: where the
      operands need no conversion it returns them as the interpreter would, without computing a common type and
      casting to it: two tensors of one type; a scalar tensor and a block of its element type (the scalar splat by
      the interpreter's own create_splat); a signed integer tensor and a Python int in its range (the int a constant
      of the tensor's type, by the interpreter's own get_int32/get_int64). Pointers, 16-bit floats divided, numbers
      meeting floats or bools, and every other case take the interpreter's path.
    Same tensors, types and errors as without (tests/test_conftest.py compares the two over every pair of operand
    kinds); where the interpreter's internals are not the ones this was written against (triton 3.6 and 3.9), it is
    left alone."""
    import functools
    import inspect

    from triton.language import core
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    check = getattr(semantic, "binary_op_type_checking_impl", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if check is None or np_dtype is None or getattr(semantic, "tensor", None) is not core.tensor:
        return
    if "shape" in vars(core.tensor):  # installed already, or a triton whose tensors have a shape of their own
        return

    blocks, block_init = {}, core.block_type.__init__

    def block_type_init(self, element_ty, shape):
        try:
            key = (str(element_ty), tuple(shape)) if isinstance(shape, (list, core.tuple)) else None
            fields = blocks.get(key)
        except TypeError:  # something that is no shape: the interpreter's own error
            key = fields = None
        if fields is None:
            block_init(self, element_ty, shape)
            self._shape_type = core.tuple([core.constexpr(s) for s in self.shape]).type
            if key is not None:
                blocks[key] = (self.shape, self.numel, self.name, self._shape_type)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name, self._shape_type = fields

    tensor_init, no_shape = core.tensor.__init__, core.tuple([]).type

    def tensor_init_typed(self, handle, type):
        if not isinstance(type, core.dtype) or (type.is_block() and not hasattr(type, "_shape_type")):
            return tensor_init(self, handle, type)
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel = core.constexpr(type.numel if type.is_block() else 1)

    def shape(self):  # a tensor's shape, built when first read (most of the interpreter's tensors never are)
        ty = self.type
        if ty.is_block():
            return core.tuple([core.constexpr(s) for s in ty.shape], ty._shape_type)
        return core.tuple([], no_shape)

    shape = functools.cached_property(shape)
    shape.__set_name__(core.tensor, "shape")

    np_dtypes = {}

    def np_dtype_once(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, core.block_type) else tt_dtype
        if isinstance(element, core.pointer_type):
            return np_dtype(tt_dtype)
        found = np_dtypes.get(element.name)
        if found is None:
            found = np_dtypes[element.name] = np_dtype(tt_dtype)
        return found

    def unconverted(element, div_or_mod) -> bool:
        if element.is_int():
            return True
        return element.is_floating() and not (div_or_mod and element.primitive_bitwidth < 32)

    def splat(scalar, block_ty):
        return core.tensor(semantic.builder.create_splat(block_ty, scalar.handle), block_ty)

    int_ranges = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}

    def operands(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        lhs_tensor, rhs_tensor = type(lhs) is core.tensor, type(rhs) is core.tensor
        if lhs_tensor and rhs_tensor:
            lhs_ty, rhs_ty = lhs.type, rhs.type
            element = lhs_ty.scalar
            if element == rhs_ty.scalar and unconverted(element, div_or_mod):
                if lhs_ty == rhs_ty:
                    return lhs, rhs
                if lhs_ty.is_block() and not rhs_ty.is_block():
                    return lhs, splat(rhs, lhs_ty)
                if rhs_ty.is_block() and not lhs_ty.is_block():
                    return splat(lhs, rhs_ty), rhs
        elif arithmetic_check and (lhs_tensor or rhs_tensor):
            tensor, number = (lhs, rhs) if lhs_tensor else (rhs, lhs)
            element = tensor.type.scalar
            bounds = int_ranges.get(element.name) if type(number) is int else None
            if bounds is not None and bounds[0] <= number <= bounds[1]:
                constant = core.tensor(getattr(semantic.builder, f"get_{element.name}")(number), element)
                if tensor.type.is_block():
                    constant = splat(constant, tensor.type)
                return (tensor, constant) if lhs_tensor else (constant, tensor)
        return check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    patch_attr = getattr(interpreter, "_patch_attr", None)

    def interpreted_builtin(obj, name, member, builder, scope):
        """The interpreter's stand-in for a builtin: the builtin called with `_semantic` set, without copying its
        keyword arguments into a new dict on every call (and, under triton 3.6, which made a TritonSemantic for each
        builtin, the one interpreter_semantic, whose only state is the same builder)."""
        on = semantic if semantic.builder is builder else type(semantic)(builder)

        def interpreted(*args, **kwargs):
            kwargs.pop("_semantic", None)
            return member(*args, **kwargs, _semantic=on)

        scope.set_attr(obj, name, interpreted)

    if patch_attr is not None and list(inspect.signature(patch_attr).parameters) == list(
        inspect.signature(interpreted_builtin).parameters
    ):
        interpreter._patch_attr = interpreted_builtin
    # what tests/test_conftest.py compares them with
    operands.original, block_type_init.original, tensor_init_typed.original = check, block_init, tensor_init
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init_typed
    core.tensor.shape = shape  # under the attribute the interpreter's own __init__ sets on its tensors
    interpreter._get_np_dtype = np_dtype_once
    semantic.binary_op_type_checking_impl = operands


def _interpreter_builder():
    """The builder Triton's interpreter traces kernels with, where it has the overflow options; None where the
    kernels are compiled."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if os.environ.get("TRITON_INTERPRET") != "1" or not hasattr(getattr(builder, "options", None), "sanitize_overflow"):
        return None
    return builder


@contextlib.contextmanager
def overflow_checks(checked: bool):
    """The interpreter's int32 overflow checks, on or off, inside the block.

    By default the interpreter redoes every int32 add, subtract and multiply in int64 and compares it with the range
    (sanitize_overflow), then drops the comparison: its assertion is emitted only in debug mode, which is off. That
    was a third to a half of an interpreted test's time for no check. Off, the arithmetic is the kernel's; on, it is
    checked for real (debug too, so that the assertion fires). Nothing where kernels are compiled."""
    builder = _interpreter_builder()
    if builder is None:
        yield
        return
    saved = builder.options
    builder.options = dataclasses.replace(saved, sanitize_overflow=checked, debug=checked)
    try:
        yield
    finally:
        builder.options = saved


_installed = []


def install():
    """Both speed-ups, once a process, where kernels run on the interpreter; nothing on a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1" and not _installed:
        patch_language_once_a_launch()
        shortcut_the_interpreters_frontend()
        _installed.append(True)
