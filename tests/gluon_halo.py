"""A probe of the step that would lift the narrow layers (bench/NOTES.md, "What 64 columns cost"): the input's halo
reused across taps in shared memory, not a product kernel.

`_halo_conv2d_kernel` computes a 3x3 zero-padded 2-D convolution of one [BOX_H, 64, K] image into N channels the
way an implicit-GEMM tile with halo reuse would: per kw, ONE TMA box of BOX_H + 2 rows of the 64-voxel-wide patch
(shifted by kw - 1 along W, its rows -1 and BOX_H past the image read as zeros), and per output row r and tap kh one
m64 wgmma whose A operand is row r + kh of that box: a 64-row slice of its 2-D view, in shared memory. The three kh
taps read one box instead of three (tests/test_gluon_halo.py).

What Gluon allows (3.6 and 3.9, compiled for sm_90): a slice of a shared-memory view at an offset that is a
multiple of its length ("The split offset may not touch the tile" otherwise) and no reshape of a slice ("NYI:
memdesc_reshape of memdesc_subslice"); boxes and allocations have power-of-two shapes. So a patch is 64 voxels wide
(one m64 wgmma an output row) and BOX_H + 2 a power of two (one box). At 64 rows x 128 bytes a slice starts on a
whole 1024-byte swizzle period, where the wgmma descriptor needs no base offset."""

import torch

from tconv3d.kernels import conv_gluon

if conv_gluon.UNAVAILABLE is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = conv_gluon._tma_load  # async_copy_global_to_shared in 3.6, async_load from 3.7

    @gluon.jit
    def _halo_conv2d_kernel(x_desc, w_desc, out_ptr, num_warps: gl.constexpr):
        """out[r * 64 + w, n] = sum over (kh, kw, k) of x[r + kh - 1, w + kw - 1, k] * weight[(kh * 3 + kw) * K + k, n],
        for the BOX_H == 2 rows r of a 64-wide image x [1, 1, 2, 64, K] (zeros past its edges)."""
        HALO_H: gl.constexpr = x_desc.block_type.shape[2]  # BOX_H + 2
        BOX_W: gl.constexpr = x_desc.block_type.shape[3]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[4]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
        halos = gl.allocate_shared_memory(x_desc.dtype, [3, 1, 1, HALO_H, BOX_W, BLOCK_K], x_desc.layout)
        weights = gl.allocate_shared_memory(w_desc.dtype, [9, BLOCK_K, BLOCK_N], w_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, 3 * x_desc.block_type.nbytes + 9 * w_desc.block_type.nbytes)
        for kw in gl.static_range(3):  # one box a kw, shifted along W; its first and last rows are the padding
            _tma_load(x_desc, [0, 0, -1, kw - 1, 0], bar, halos.index(kw))
        for tap in gl.static_range(9):
            _tma_load(w_desc, [tap * BLOCK_K, 0], bar, weights.index(tap))
        mbarrier.wait(bar, 0)
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        acc0 = gl.zeros((BOX_W, BLOCK_N), dtype=gl.float32, layout=layout)
        acc1 = gl.zeros((BOX_W, BLOCK_N), dtype=gl.float32, layout=layout)
        for kw in gl.static_range(3):
            rows = halos.index(kw).reshape([HALO_H * BOX_W, BLOCK_K])
            for kh in gl.static_range(3):  # output row r reads the box's row r + kh
                w = weights.index(kh * 3 + kw)
                acc0 = warpgroup_mma(rows.slice(kh * BOX_W, BOX_W, dim=0), w, acc0, is_async=True)
                acc1 = warpgroup_mma(rows.slice((kh + 1) * BOX_W, BOX_W, dim=0), w, acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        mbarrier.invalidate(bar)
        offs_m = gl.arange(0, BOX_W, layout=gl.SliceLayout(1, layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + offs_m[:, None] * BLOCK_N + offs_n[None, :]
        gl.store(ptrs, acc0)
        gl.store(ptrs + BOX_W * BLOCK_N, acc1)


def halo_conv2d(x: torch.Tensor, weight: torch.Tensor, launch=None) -> torch.Tensor:
    """The probe on x [2, 64, K] (rows, columns, channels) and weight [N, K, 3, 3], bf16: [2, 64, N] fp32.
    `launch(kernel, grid, *args, **kwargs)` runs it (default: the kernel itself; the emulator's on CPU)."""
    rows, width, channels = x.shape
    if (rows, width) != (2, 64) or x.dtype != torch.bfloat16 or weight.shape[1:] != (channels, 3, 3):
        raise ValueError(f"the probe takes x [2, 64, K] bf16 and weight [N, K, 3, 3], got {x.shape}, {weight.shape}")
    n = weight.shape[0]
    image = x.reshape(1, 1, rows, width, channels).contiguous()
    taps = weight.permute(2, 3, 1, 0).reshape(9 * channels, n).contiguous()  # [(kh, kw, k), n]
    box = [1, 1, rows + 2, width, channels]
    x_desc = TensorDescriptor(
        image, list(image.shape), list(image.stride()), box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    )
    w_desc = TensorDescriptor(
        taps, list(taps.shape), list(taps.stride()), [channels, n],
        gl.NVMMASharedLayout.get_default_for([channels, n], gl.bfloat16),
    )  # fmt: skip
    out = torch.empty(rows * width, n, dtype=torch.float32, device=x.device)
    if launch is None:
        _halo_conv2d_kernel[(1,)](x_desc, w_desc, out, num_warps=4)
    else:
        launch(_halo_conv2d_kernel, (1,), x_desc, w_desc, out, num_warps=4)
    return out.reshape(rows, width, n)
