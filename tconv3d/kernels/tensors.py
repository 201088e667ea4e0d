"""The kernel layer's helpers on torch tensors and dtypes alone (layouts, vmap's batching, the host's ceil
division, the border fold's reference): what torch's own path (aten.py), the config type and the layers above
share with the kernels' launchers. It imports no Triton, so tconv3d imports where Triton is not installed
(settings.TRITON_MISSING)."""

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor


def parameter_grad_dtype(weight) -> torch.dtype:
    """The dtype of a norm's weight and bias gradients: the weight's (a model's parameters share one dtype; a bias
    of another is cast by the autograd kernel), fp32 without one. Written so by the kernel that sums them: a bf16
    model's backward makes no two casts of fp32 sums."""
    return weight.dtype if weight is not None else torch.float32


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. triton.cdiv costs ~2 us a call outside kernels (its constexpr wrapper), and a
    launch takes several: the launchers' grids and splits use this."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), on the host: triton.next_power_of_2 is a constexpr function
    too (Triton 3.9: ~3.6 us a call outside kernels, where a launch that no plan replays pays it)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def func_transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) runs this call, eagerly or traced by torch.compile
    (dynamo traces the transforms over fake tensors wrapped as eager wraps them, and answers this). It refuses a
    ctx-style Function (vmap any Function without a vmap rule) whether or not it wraps the Function's inputs: a
    tensor made inside the call (a cache's first frames, zeros) is not wrapped."""
    return torch._C._are_functorch_transforms_active()


def traced(t: torch.Tensor) -> bool:
    """Whether `t` is a fake or functional tensor: the ops' torch ops traced into a graph in their place
    (ops.decompositions, which torch.onnx.export runs below functionalization), where they must write nothing in
    place and need no strides of their own."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


def exporting_to_onnx() -> bool:
    """Whether torch.onnx.export traces this. ONNX has no strides: its as_strided reads the input in logical order,
    so a view that restrides a channels-last tensor in place (the same memory) would read other elements there."""
    import torch.onnx

    return torch.onnx.is_in_onnx_export()


def batched(*tensors: torch.Tensor | None) -> bool:
    """Whether torch.func.vmap batches any of `tensors`, at any of the transforms that wrap it (vmap of grad: a
    grad wrapper around a batched tensor). vmap writes a batched tensor only into one batched at its levels, and
    clones or queries no layout but NCDHW: the adapters' rearrangements and kept frames, which write into tensors
    made inside the call (tconv3d.nn's `empty_for`) and keep them channels_last_3d, and the aten path's layouts
    (a norm's backward differentiated under vmap of grad runs its forward in torch ops) ask this. While dynamo
    traces: whether a torch.func transform runs (its wrappers cannot be unwrapped there)."""
    if torch.compiler.is_compiling():
        # Dynamo traces vmap and grad over fake tensors wrapped as eager wraps them, but not functorch's
        # unwrapping: under a traced transform any tensor may be batched (a compiled grad alone keeps NCDHW too)
        return func_transformed()
    for t in tensors:
        while t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t):
            if torch._C._functorch.is_batchedtensor(t):
                return True
            t = torch._C._functorch.get_unwrapped(t)
    return False


def channels_last(x: torch.Tensor, clone: bool = False) -> torch.Tensor:
    """x.contiguous(memory_format=channels_last_3d), or with `clone` x.clone(memory_format=...): a copy kept
    apart from x (a causal conv's cached frames). Under torch.func.vmap, which lays out nothing but NCDHW, x as it
    is (its clone)."""
    if batched(x):
        return x.clone() if clone else x
    memory_format = torch.channels_last_3d
    return x.clone(memory_format=memory_format) if clone else x.contiguous(memory_format=memory_format)


# Dimensions from the innermost out, per layout; any other format is the contiguous one.
_INNERMOST_FIRST = {torch.channels_last_3d: (1, 4, 3, 2, 0), torch.channels_last: (1, 3, 2, 0)}


def format_strides(shape: tuple[int, ...], memory_format) -> tuple[int, ...]:
    """The strides torch.empty gives `shape` in `memory_format`, in plain Python, so that torch.compile traces it
    with no cache wrapper to warn about. Like torch, the contiguous layout steps over a size-0 dim as if it had
    size 1; the channels-last ones do not."""
    order = _INNERMOST_FIRST.get(memory_format)
    strides, step = [0] * len(shape), 1
    for dim in order or range(len(shape) - 1, -1, -1):
        strides[dim] = step
        step *= shape[dim] if order else max(shape[dim], 1)
    return tuple(strides)


def on_storage(t: torch.Tensor, shape, strides, offset: int) -> torch.Tensor:
    """A tensor of `shape` and `strides` at `offset` into t's storage, not a view of t: an op may return it (autograd
    lets callers modify an op's output in place, where a view made inside the op would refuse)."""
    return t.new_empty(0).set_(t.untyped_storage(), offset, shape, strides)


def as_allocated(t: torch.Tensor) -> torch.Tensor:
    """`t`, channels_last_3d by torch's rule (which ignores the strides of size-1 dimensions), with the strides a
    tensor allocated channels_last_3d has (format_strides: empty_ndhwc's, the ops' fakes'), on its storage and not
    a view of it (on_storage); t itself where they are already, or where a torch.func transform or autograd sees
    it. A one-channel output of torch's convolution is NCDHW (channel stride D*H*W), which
    contiguous(memory_format=channels_last_3d) leaves so: torch.cat lays out a concatenation of such tensors NCDHW,
    of the fakes' channels_last_3d, and a compiled graph traced on the fakes then views the real one wrongly (MONAI
    AHNet's pyramid of one-channel branches: 'view size is not compatible' in training, its batch folded for
    BatchNorm). Nor where `traced`: no fake of the op's stands for it there, and the set_ would be in the graph."""
    if t.dim() != 5 or not t.numel() or t.requires_grad or func_transformed() or traced(t):
        return t
    strides = format_strides(t.shape, torch.channels_last_3d)
    if t.stride() == strides or not t.is_contiguous(memory_format=torch.channels_last_3d):
        return t
    return on_storage(t, t.shape, strides, t.storage_offset())


def ndhwc(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its channels (dim 1) are contiguous, as in channels_last_3d or a view of it; otherwise a
    channels_last_3d copy. The kernels take any other strides as they come."""
    if t.stride(1) == 1 or t.shape[1] == 1:
        return t
    return t.contiguous(memory_format=torch.channels_last_3d)


def unit_channels(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` (channels unit-stride or a single channel, as ndhwc leaves it) with channel stride 1 exactly: a second
    channel source is addressed with the input's channel stride."""
    if t is None or t.stride(1) == 1:
        return t
    sn, _, sd, sh, sw = t.stride()
    return t.as_strided(t.shape, (sn, 1, sd, sh, sw), t.storage_offset())


def dense_voxels(t: torch.Tensor) -> torch.Tensor:
    """t as a dense channels_last_3d tensor: itself when it is one (what the norm kernels index), else a copy."""
    return t.contiguous(memory_format=torch.channels_last_3d)


def empty_ndhwc(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An uninitialised channels_last_3d tensor on `like`'s device, in `dtype` (default like's)."""
    dtype = like.dtype if dtype is None else dtype
    return torch.empty(shape, dtype=dtype, device=like.device, memory_format=torch.channels_last_3d)


def cat_channels(x: torch.Tensor, channels_after: torch.Tensor | None) -> torch.Tensor:
    """torch.cat([x, channels_after], dim=1), channels_last_3d: the copy of a second channel source that a launch
    which cannot read it in place (config.reads_channels_after) makes; x itself without one."""
    if channels_after is None:
        return x
    if batched(x, channels_after) or traced(x):  # vmap writes no batched tensor into one it does not batch
        return torch.cat([x, channels_after], dim=1)
    out = empty_ndhwc((x.shape[0], x.shape[1] + channels_after.shape[1], *x.shape[2:]), like=x)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1] :] = channels_after
    return out


def source_index(p: int, size: int, front: int, mode: str) -> int:
    """padded_coord on the host: the input index that padded index `p` (0 = first border voxel) reads."""
    i = p - front
    if mode == "replicate":
        return min(max(i, 0), size - 1)
    if mode == "reflect":
        i = -i if i < 0 else i
        return 2 * size - 2 - i if i >= size else i
    if mode == "circular":
        return i + size if i < 0 else i - size if i >= size else i
    raise ValueError(f"no border to fold for padding_mode {mode!r}")


def border_sources(size: int, front: int, back: int, mode: str) -> list[list[int]]:
    """For each of a bordered dimension's `size` input indices, the bordered indices whose gradient lands on it: its
    own (front + i), then the borders that read it (source_index), in order."""
    read = [[front + i] for i in range(size)]
    for p in [*range(front), *range(front + size, front + size + back)]:
        read[source_index(p, size, front, mode)].append(p)
    return read


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, torch.float32) of a floating dtype, without its dispatch: aten.promote_types
    reaches a dispatch mode as an op, and a call plan's recording (plans._Watch) refuses a call that ran one."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def fold_padding(
    grad_bordered: torch.Tensor, geom, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The input gradient from the gradient of geom.border_geometry()'s input, which carries the borders of the
    dimensions whose mode reads input voxels: every border voxel's gradient is added to the voxel its mode read,
    in a fixed order (deterministic, no atomics), summed in float32 at least and rounded once a dimension (in
    bf16 a running sum rounded at every add loses a bit per few terms: a replicated border of 5 on a 1-voxel
    dimension, 1e-2 off). `bias` (per channel): every voxel of grad_bordered, borders too, carries it once (a
    transposed convolution's, added with the sum and rounded once); each border's copy is taken off as it is
    added, so the voxel it read carries one. Returns channels_last_3d, in `dtype` (default grad_bordered's): aten's
    path computes a 16-bit gradient's bordered buffer in float32 (config.destination_dtype), and the fold's one
    copy rounds it. The kernels' path folds in one launch instead (fold.fold_bordered); this is its reference.

    grad_bordered is the caller's own buffer, which the fold overwrites: each dimension's sums go into the planes
    they fold onto, in place, and the dimension's interior is then a view; one copy of the interior at the end,
    whatever the number of dimensions folded (a copy per dimension, each the gradient's size, before). Where
    `traced`, the same sums in the same order without writing: each dimension's interior concatenated from its
    planes (a copy a dimension)."""
    grad = grad_bordered
    sum_dtype = at_least_float32(grad.dtype)
    copy_of_bias = None if bias is None else bias.to(sum_dtype).view(1, -1, 1, 1, 1)
    for dim, (size, mode) in enumerate(zip(geom.in_size, geom.dim_modes, strict=True)):
        front, back = geom.padding[2 * dim], geom.padding[2 * dim + 1]
        if mode == "zeros" or (not front and not back):
            continue
        axis = 2 + dim
        functional = traced(grad)
        pieces, start = [], 0  # (functional) the interior's planes: runs of those without borders, the summed ones
        for i, (_, *borders) in enumerate(border_sources(size, front, back, mode)):
            if not borders:
                continue
            # the interior plane written, the borders (outside it) read
            target = grad.narrow(axis, front + i, 1)
            # summed in place in the target itself where it is float32, else in a float32 copy
            plane = target if target.dtype == sum_dtype and not functional else target.to(sum_dtype, copy=True)
            for p in borders:
                border = grad.narrow(axis, p, 1)
                plane = plane + border if functional else plane.add_(border)
                if copy_of_bias is not None:
                    plane = plane - copy_of_bias if functional else plane.sub_(copy_of_bias)
            if functional:
                pieces += [grad.narrow(axis, front + start, i - start), plane.to(grad.dtype)]
                start = i + 1
            elif plane is not target:
                target.copy_(plane)
        if functional:
            grad = torch.cat([*pieces, grad.narrow(axis, front + start, size - start)], dim=axis)
        else:
            grad = grad.narrow(axis, front, size)
    dtype = grad.dtype if dtype is None else dtype
    if grad is grad_bordered or traced(grad):
        return grad.to(dtype).contiguous(memory_format=torch.channels_last_3d)
    return torch.empty_like(grad, dtype=dtype, memory_format=torch.channels_last_3d).copy_(grad)
