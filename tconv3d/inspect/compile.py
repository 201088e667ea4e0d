"""Compile tconv3d's kernels for a GPU that is not there, exactly as their launchers would launch them, and read
what the compiler made: registers, spills, shared memory, the MMA instruction and the global-load kinds.

Triton's own JIT does the specialisation (16-byte-aligned pointers, unit strides as constants, divisibility
hints): the launchers run on meta tensors while a stand-in driver answers the JIT's questions with the requested
target, and every launch is turned into a compile-only warm-up. Nothing of this outlives `compile_only`: the
driver and each kernel's per-device caches are put back. The cubin is read with the cuobjdump and nvdisasm that
Triton's wheel ships (_disassemble). `python -m tconv3d.inspect` prints it; the tuner uses it to drop candidates
before timing them.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import importlib
import json
import math
import multiprocessing
import os
import pkgutil
import re
import struct
import subprocess
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime import driver as triton_driver
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from .. import kernels
from ..geometry import ConvGeometry
from ..kernels import conv_dgrad, conv_fwd, conv_wgrad, grouped, launch
from ..kernels.config import KernelConfig
from ..kernels.utils import tensor_map_problems


@dataclass(frozen=True)
class Arch:
    """A GPU model as the compiler and the grid see it."""

    capability: int
    device_name: str  # whose tuning table the choice reads
    sm_count: int
    smem_per_block: int  # the opt-in shared memory one program may use
    smem_per_sm: int
    # Dense tensor-core multiply-adds an SM completes per clock, by operand width in bits (the datasheet's peak
    # over SMs and boost clock: an H100 SXM's 989 bf16 TFLOP/s are 132 SMs x 1.83 GHz x 2 x 2048).
    mma_fma_per_clk: dict = field(default_factory=dict, hash=False, compare=False)
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    schedulers_per_sm: int = 4  # warp schedulers: one instruction a clock each


ARCHS = {
    90: Arch(90, "NVIDIA H100 80GB HBM3", sm_count=132, smem_per_block=232448, smem_per_sm=233472,
             mma_fma_per_clk={8: 4096, 16: 2048, 32: 1024}),
    80: Arch(80, "NVIDIA A100-SXM4-80GB", sm_count=108, smem_per_block=166912, smem_per_sm=167936,
             mma_fma_per_clk={8: 2048, 16: 1024, 32: 512}),
}  # fmt: skip


def _kernel_modules() -> tuple:
    """Every module of tconv3d.kernels: compile_only and stubbed_launches set aside each one's kernels' compiled
    caches, and a module left out (the split-K reduction's, the RMS norm's were) kept the first target's kernel for
    the next: sm_80's records read sm_90's cubin."""
    found = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    return (kernels, *found)


KERNEL_MODULES = _kernel_modules()


@functools.lru_cache(maxsize=16)
def arch_of(device: torch.device) -> Arch:
    """The Arch of a CUDA device that is there (the tuner's)."""
    props = torch.cuda.get_device_properties(device)
    return Arch(
        props.major * 10 + props.minor,
        props.name,
        sm_count=props.multi_processor_count,
        smem_per_block=getattr(props, "shared_memory_per_block_optin", 0) or 232448,
        smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 0) or 233472,
        mma_fma_per_clk=ARCHS.get(props.major * 10, ARCHS[90]).mma_fma_per_clk,  # an H200's are an H100's
    )


@dataclass
class KernelReport:
    """One compiled kernel of one launch."""

    kernel: str
    grid: list[int]
    num_warps: int
    sm: int | None = None  # the cubin's target, from its SASS header (sm_90a: 90)
    registers: int | None = None
    spill_bytes: int | None = None  # the stack frame: local memory for spills (none of our kernels has arrays)
    shared_bytes: int = 0
    mma: str = "none"  # the first MMA instruction, e.g. HGMMA.64x128x16.F32.BF16
    loads: list[str] = field(default_factory=list)  # the global-load instructions, e.g. LDGSTS.E.BYPASS.128
    local_accesses: int = 0  # LDL/STL in the SASS
    # Those of them in the main loop (None without one): a spill there costs every K step; one outside it (an
    # index kept across the loop: one store and a few loads a program) costs next to nothing.
    loop_local_accesses: int | None = None
    # The main loop (the innermost loop holding the MMA): its shared-memory round trips through registers
    # (LDS/LDSM/STS/STSM: an operand fed to the MMA from registers, or staged by hand), and the depth N of each
    # wgmma wait (WARPGROUP.DEPBAR.LE gsb0, N) in it: [1] is one group in flight; [0, 0, 0, 0] is every wgmma
    # waiting for the one before it.
    loop_smem_ops: int | None = None
    loop_wgmma_waits: list[int] = field(default_factory=list)
    loop_barriers: int | None = None  # CTA-wide BAR.SYNC in the main loop
    # Every innermost loop holding an MMA (a kernel may have several: the Gluon kernel's half tiles run their own,
    # half_tail), in address order: {"mma": its first MMA instruction, "smem_ops", "waits"} as above.
    mma_loops: list[dict] = field(default_factory=list)
    # What one pass of the main loop asks of a warp: instructions issued, and the tensor-core multiply-adds its
    # MMAs do, counted per warp (a wgmma is one warpgroup's: a quarter of it per warp), with their operand width.
    loop_instructions: int | None = None
    loop_mma_fma: int | None = None
    loop_mma_bits: int | None = None
    # A warp-specialized kernel's producer: the instructions one pass of its load loop issues (one K step's TMA
    # loads, their coordinates and the wait for a free stage), on one warp, so their latency adds up.
    producer_instructions: int | None = None
    producer_divisions: int | None = None  # runtime integer divisions in it (one MUFU.RCP each): a dependent chain
    # A persistent kernel's MMA warps between two tiles (_tile_loop_rest): instructions, and divisions among them.
    tile_instructions: int | None = None
    tile_divisions: int | None = None
    # The tiled tensor maps the launch hands the driver (tensor_maps): one dict each, with what tensor_map_problems
    # says of it.
    tensor_maps: list[dict] = field(default_factory=list)
    compile_s: float = 0.0
    cubin: bytes | None = field(default=None, repr=False)  # what it says is read into the fields above

    @property
    def mma_kind(self) -> str:
        return self.mma.split(".")[0] if self.mma != "none" else "none"

    def programs(self) -> int:
        return math.prod(self.grid)

    def waves(self, arch: Arch) -> float:
        """Programs over what the device holds at once (per-SM limits of registers, shared memory, threads)."""
        threads = 32 * self.num_warps
        per_sm = [arch.threads_per_sm // threads, 32]
        if self.registers:
            per_sm.append(arch.regs_per_sm // (-(-self.registers // 8) * 8 * threads))
        if self.shared_bytes:
            per_sm.append(arch.smem_per_sm // (self.shared_bytes + 1024))  # 1 KB reserved per program
        resident = max(min(per_sm), 1) * arch.sm_count
        return self.programs() / resident

    def issue_ceiling(self, arch: Arch) -> float | None:
        """The fraction of the tensor cores' peak the main loop's instruction issue allows: the clocks its MMAs
        take on an SM over the clocks the SM's schedulers take to issue every warp's instructions of one pass (each
        program's warps alike, so the programs an SM holds cancel out). 1.0: the loop can keep the tensor cores
        busy; 0.6: 40% of their time goes waiting for address arithmetic, masks and loads to issue. An upper
        bound: latency and memory come on top. None without a main loop."""
        if not self.loop_instructions or not self.loop_mma_fma or self.loop_mma_bits not in arch.mma_fma_per_clk:
            return None
        tensor_clks = self.loop_mma_fma * self.num_warps / arch.mma_fma_per_clk[self.loop_mma_bits]
        issue_clks = self.loop_instructions * self.num_warps / arch.schedulers_per_sm
        return min(1.0, tensor_clks / issue_clks)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "cubin"}, "mma_kind": self.mma_kind}


class _StandInDriver:
    """What JITFunction.run asks of the driver before a launch, answered for a target with no device."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):
        raise RuntimeError(f"tconv3d.static_compile: the stand-in driver cannot {name!r}; nothing may launch here")


def _jit_functions() -> list[JITFunction]:
    return list(dict.fromkeys(v for m in KERNEL_MODULES for v in vars(m).values() if isinstance(v, JITFunction)))


def tensor_maps(args, kernel: CompiledKernel) -> list[dict]:
    """The tiled tensor maps a launch with `args` hands the driver: each descriptor argument's shape and strides
    with the box, swizzle and element size the compiled kernel encodes it with (its tensordesc_meta: Triton splits
    a box wider than the swizzle span into several copies of a narrower one), and tensor_map_problems' verdict."""
    descriptors = [a for a in args if hasattr(a, "block_shape") and hasattr(a, "strides")]
    metas = getattr(kernel.metadata, "tensordesc_meta", None) or [None] * len(descriptors)
    found = []
    for descriptor, meta in zip(descriptors, metas, strict=True):
        shape, strides = [int(v) for v in descriptor.shape], [int(v) for v in descriptor.strides]
        if meta is None:  # a Triton that hands the driver the descriptor as made: its own box, swizzle unknown
            box, swizzle, size = list(descriptor.block_shape), None, descriptor.base.element_size()
        else:
            box, swizzle, size = list(meta["block_size"]), meta["swizzle"], meta["elem_size"]
        problems, risks = tensor_map_problems(shape, strides, box, size, swizzle)
        found.append({"shape": shape, "strides": strides, "box": box, "swizzle": swizzle, "element_size": size,
                      "problems": problems, "risks": risks})  # fmt: skip
    return found


@contextlib.contextmanager
def compile_only(capability: int, launches: list):
    """Inside, every tconv3d kernel launch compiles for sm_<capability> instead of running, and appends
    (kernel name, grid, num_warps, CompiledKernel, seconds, tensor_maps) to `launches`."""
    target = GPUTarget("cuda", capability, 32)
    functions = _jit_functions()
    saved_caches = {fn: fn.device_caches for fn in functions}
    saved_driver = triton_driver._active  # reset_active() would look for a real GPU driver
    original_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        seconds = time.perf_counter() - start
        maps = tensor_maps(args, kernel)
        # The compiled kernel's warps: a warp-specialized one also has its workers' (and their warpgroups' rest).
        warps = getattr(kernel.metadata, "num_warps", None) or kwargs.get("num_warps", 4)
        launches.append((self.__name__, list(grid), warps, kernel, seconds, maps))
        return kernel

    for fn in functions:  # binders made for this target must not serve a real device later
        fn.device_caches = defaultdict(fn.create_binder)
    triton_driver.set_active(_StandInDriver(target))
    JITFunction.run = run
    try:
        with launch.suspended():  # nor may the direct launch path remember what is compiled here
            yield launches
    finally:
        JITFunction.run = original_run
        triton_driver._active = saved_driver
        for fn, caches in saved_caches.items():
            fn.device_caches = caches


@contextlib.contextmanager
def stubbed_launches(capability: int, record: list | None = None):
    """Inside, tconv3d's kernels launch for real as far as the host goes (Triton's run or the direct path of
    kernels/launch.py, compiling for sm_<capability> on first use) and stop at the driver: each compiled
    kernel's launcher is a stand-in that appends (kernel name, launcher arguments) to `record` if given, and
    refuses a grid past CUDA's (launch.MAX_GRID) as the driver would and, for an arch of ARCHS, more shared memory
    than a program may have as Triton would (OutOfResources). For timing the host's launch path and
    checking what reaches the driver, without a GPU. Everything is put back on exit, the direct path's memory of
    kernels compiled here included."""
    target = GPUTarget("cuda", capability, 32)
    functions = _jit_functions()
    saved_caches = {fn: fn.device_caches for fn in functions}
    saved_driver = triton_driver._active
    saved_run, saved_init = CompiledKernel.run, CompiledKernel._init_handles

    most_x, most_y, most_z = launch.MAX_GRID
    most_shared = ARCHS[capability].smem_per_block if capability in ARCHS else None

    def stand_in(self):
        def launched(*args):
            # What the driver refuses (a grid past its limits: "invalid argument") and Triton before it (more shared
            # memory than a program may have), which the interpreter would run
            if args[0] > most_x or args[1] > most_y or args[2] > most_z:
                raise RuntimeError(f"{self.name}: grid {args[:3]} passes CUDA's {launch.MAX_GRID}")
            if most_shared is not None and self.metadata.shared > most_shared:
                raise OutOfResources(self.metadata.shared, most_shared, "shared memory")
            if record is not None:
                record.append((self.name, args))

        return launched

    for fn in functions:
        fn.device_caches = defaultdict(fn.create_binder)
    triton_driver.set_active(_StandInDriver(target))
    CompiledKernel.run = property(stand_in)
    CompiledKernel._init_handles = lambda self: None  # no module to load: the launch metadata is built as usual
    launch.forget()
    try:
        yield record
    finally:
        launch.forget()
        CompiledKernel.run, CompiledKernel._init_handles = saved_run, saved_init
        triton_driver._active = saved_driver
        for fn, caches in saved_caches.items():
            fn.device_caches = caches


def _nvidia_tool(name: str) -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this triton wheel ships no {name}")
    return str(path)


def _elf64(cubin: bytes) -> bool:
    """Whether the bytes begin as a 64-bit little-endian ELF does (a cubin), its header whole."""
    return cubin[:6] == b"\x7fELF\x02\x01" and len(cubin) >= 64


def _elf_sections(cubin: bytes) -> dict[str, bytes] | None:
    """A 64-bit little-endian ELF's sections by name (NOBITS ones empty); None for anything else."""
    if not _elf64(cubin):
        return None
    try:
        shoff, entsize, count, names = *struct.unpack_from("<Q", cubin, 0x28), *struct.unpack_from("<HHH", cubin, 0x3A)
        headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
        table = headers[names][4]
        sections = {}
        for name, kind, _, _, offset, size in headers:
            label = cubin[table + name : cubin.index(b"\0", table + name)].decode()
            sections[label] = b"" if kind == 8 else cubin[offset : offset + size]
        return sections
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


# nvdisasm's name of each architecture whose SASS is read from raw instructions (sm_90's as sm_90a, wgmma's).
_RAW_ARCH = {90: ("SM90a", "sm_90a"), 80: ("SM80", "sm_80")}


def cubin_capability(cubin: bytes) -> int | None:
    """The compute capability a cubin's ELF flags name: the old format's low byte (sm_20 onwards: 0x50 for sm_80),
    the new format's second byte (its low byte a small format number: 0x0a006402 for sm_100); None for no ELF."""
    if not _elf64(cubin):
        return None
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    return flags & 0xFF if flags & 0xFF >= 20 else (flags >> 8) & 0xFF


def _raw_code(cubin: bytes) -> tuple[int, str, bytes] | None:
    """(capability, kernel name, instructions) of a cubin whose SASS nvdisasm may read as raw instructions: one
    .text section (a kernel, the internal functions it calls inside it), nothing relocated in it, an architecture
    of _RAW_ARCH (cubin_capability); None otherwise."""
    sections = _elf_sections(cubin)
    if sections is None:
        return None
    texts = [name for name in sections if name.startswith(".text.")]
    relocated = [name for name, data in sections.items() if name.startswith(".rel") and ".text" in name and data]
    capability = cubin_capability(cubin)
    if len(texts) != 1 or relocated or capability not in _RAW_ARCH or not sections[texts[0]]:
        return None
    return capability, texts[0][len(".text.") :], sections[texts[0]]


_RAW_LINE = re.compile(r"^(\s*)/\*([0-9a-f]{4,})\*/(.*)$")
# The instructions whose last operand is a code address (absolute in the disassembly, as cuobjdump prints it).
_TARGETED = re.compile(r"^(\s*(?:@!?U?P\w+\s+)?(?:BRA|CALL|BSSY|JMP|RET)\b[^;]*?)\b0x([0-9a-f]+)(\s*;.*)$")
_INDIRECT = re.compile(r"^\s*(?:@!?U?P\w+\s+)?(?:BRX|JMX)\b")  # a jump table's offsets: read by cuobjdump


def _raw_sass(capability: int, codes: list[tuple[str, bytes]]) -> list[str | None]:
    """cuobjdump -sass's text of each (kernel name, instructions) of one architecture, from one nvdisasm run over
    all of them laid end to end (nvdisasm's set-up, some 0.5 s a run whatever the size, was most of reading a
    cubin): each kernel's lines cut out by address, addresses and branch targets made its own again. None for a
    kernel with a branch leaving its own code or an indirect one (read by cuobjdump instead)."""
    starts, blob = [], bytearray()
    for _, code in codes:
        starts.append(len(blob))
        blob += code
    with tempfile.NamedTemporaryFile(suffix=".bin", delete=False) as f:
        f.write(blob)
    try:
        arch, _ = _RAW_ARCH[capability]
        command = [_nvidia_tool("nvdisasm"), "-b", arch, "-hex", "-novliw", f.name]
        text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    lines: list[list[str] | None] = [[] for _ in codes]
    index = None
    for line in text.splitlines():
        found = _RAW_LINE.match(line)
        if found is None:
            if index is not None and line.strip().startswith("/*") and lines[index] is not None:
                lines[index].append(line)  # the instruction's second encoding word
            continue
        address = int(found.group(2), 16)
        index = bisect.bisect_right(starts, address) - 1
        if lines[index] is None:
            continue
        start, end = starts[index], starts[index] + len(codes[index][1])
        rest = found.group(3)
        if _INDIRECT.match(rest):
            lines[index] = None
            continue
        targeted = _TARGETED.match(rest)
        if targeted:
            target = int(targeted.group(2), 16)
            if not start <= target <= end:
                lines[index] = None
                continue
            rest = f"{targeted.group(1)}0x{target - start:x}{targeted.group(3)}"
        lines[index].append(f"{found.group(1)}/*{address - start:04x}*/{rest}")
    _, name = _RAW_ARCH[capability]
    return [
        None if body is None else f"\n\tcode for {name}\n\t\tFunction : {kernel}\n" + "\n".join(body) + "\n"
        for (kernel, _), body in zip(codes, lines, strict=True)
    ]


# What made the kept disassembly besides the cubin and the wheel: this module (_raw_code, _raw_sass).
_KEPT_SOURCE = hashlib.sha256(Path(__file__).read_bytes()).digest()


def _disassemble(cubins: list[bytes]) -> list[tuple[str, str]]:
    """cuobjdump's resource usage and SASS of each cubin, kept by content next to Triton's cache.

    The SASS of the cubins that allow it (_raw_code) comes from one nvdisasm run an architecture, over their
    instructions laid end to end (_raw_sass: the same lines as cuobjdump -sass, which runs nvdisasm once a cubin,
    some 0.5 s of set-up each); the rest's from cuobjdump. The same cubin comes back often (a config and
    specialisation shared by several shapes, the split-K reduction of every weight gradient): the text is kept,
    compressed, under the cubin's hash, the wheel's version and this module's source (a text made by an older
    _raw_sass is not read), so each is read once across processes and runs. What is made of it is not kept:
    read_cubins parses it afresh every time."""
    knobs = getattr(triton, "knobs", None)
    found: dict[bytes, tuple[str, str]] = {}
    kept = {}
    for cubin in dict.fromkeys(cubins):
        digest = hashlib.sha256(cubin + triton.__version__.encode() + _KEPT_SOURCE).hexdigest()
        kept[cubin] = Path(knobs.cache.dir) / "tconv3d-cuobjdump" / f"{digest}.json.z" if knobs is not None else None
        if kept[cubin] is not None:
            with contextlib.suppress(OSError, ValueError, zlib.error):  # not kept yet, or torn: the tools read it
                usage, sass = json.loads(zlib.decompress(kept[cubin].read_bytes()))
                found[cubin] = usage, sass
    missing = [cubin for cubin in kept if cubin not in found]
    raw = {cubin: code for cubin in missing if (code := _raw_code(cubin)) is not None}
    sass: dict[bytes, str | None] = {}
    for capability in sorted({code[0] for code in raw.values()}):
        batch = [cubin for cubin, code in raw.items() if code[0] == capability]
        sass.update(zip(batch, _raw_sass(capability, [raw[c][1:] for c in batch]), strict=True))
    for cubin in missing:
        read = sass.get(cubin)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        try:
            flags = ("-res-usage",) if read is not None else ("-res-usage", "-sass")
            texts = [
                subprocess.run([_nvidia_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True)
                .stdout for flag in flags
            ]  # fmt: skip
        finally:
            os.unlink(f.name)
        found[cubin] = texts[0], read if read is not None else texts[1]
        if kept[cubin] is not None:
            with contextlib.suppress(OSError):  # a read-only or full cache: the next read runs the tools again
                kept[cubin].parent.mkdir(parents=True, exist_ok=True)
                partial = kept[cubin].with_suffix(f".{os.getpid()}.tmp")
                partial.write_bytes(zlib.compress(json.dumps(found[cubin]).encode(), 6))
                os.replace(partial, kept[cubin])  # whole or not at all, for the other processes reading it
    return [found[cubin] for cubin in cubins]


def read_cubins(cubins: list[bytes]) -> list[dict]:
    """Registers, stack frame and SASS facts of each cubin, their SASS disassembled together (_disassemble)."""
    return [_cubin_facts(usage, sass) for usage, sass in _disassemble(cubins)]


def read_cubin(cubin: bytes) -> dict:
    """Registers, stack frame and SASS facts of a cubin, from cuobjdump's resource usage and SASS."""
    return read_cubins([cubin])[0]


def _cubin_facts(usage: str, sass: str) -> dict:
    regs = re.search(r"REG:(\d+)", usage)
    target = re.search(r"code for sm_(\d+)", sass)
    stack = re.search(r"STACK:(\d+)", usage)
    mma = max(re.finditer(_MMA_INSTRUCTION, sass), key=lambda m: _mma_size(m.group(0)), default=None)  # the widest
    loads = sorted(set(re.findall(r"\b(?:LDGSTS|UTMALDG|LDG)(?![A-Z])(?:\.[0-9A-Z_]+)*", sass)))
    lines = _sass_lines(sass)
    loops = _mma_loops(lines)  # found once: the span search is the costly part of reading a cubin
    main = _main_span(lines, loops)
    body = _span_body(lines, main)
    smem_ops, waits, barriers = _loop_sync(body)
    instructions, fma, bits = _loop_mma(body)
    return {
        "sm": int(target.group(1)) if target else None,
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(stack.group(1)) if stack else None,
        "mma": mma.group(0).rstrip(".") if mma else "none",
        "loads": loads,
        "local_accesses": len(re.findall(_LOCAL_ACCESS, sass)),
        "loop_local_accesses": None if body is None else sum(bool(re.search(_LOCAL_ACCESS, t)) for t in body),
        "loop_smem_ops": smem_ops,
        "loop_wgmma_waits": waits,
        "loop_barriers": barriers,
        "loop_instructions": instructions,
        "loop_mma_fma": fma,
        "loop_mma_bits": bits,
        "mma_loops": [{k: v for k, v in loop.items() if k != "span"} for loop in loops],
        **_specialized_loops(lines, main),
    }


_LOCAL_ACCESS = re.compile(r"\b(?:LDL|STL)\b")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


_MMA = re.compile(r"\bH(?:G)?MMA\.")
_TMA_LOAD = re.compile(r"\bUTMALDG\b")


def _sass_lines(sass: str) -> list[tuple[int, str]]:
    return [(int(address, 16), text) for address, text in _SASS_LINE.findall(sass)]


def _loop_span(lines, holds=None, lacks=None, around=None) -> tuple[int, int] | None:
    """(first, last address) of the innermost loop whose body has an instruction matching `holds` (and none
    matching `lacks`), or that strictly contains the span `around`: the innermost span of a predicated backward
    branch (`@P0 BRA` to a lower address: the loop's back edge). An unconditional jump back (the mbarrier retry
    stub returning into the loop) marks no loop; it is taken only where no predicated one qualifies. None when no
    loop does."""
    spans = []
    for address, text in lines:
        branch = re.search(r"^(@!?U?P\w+\s+)?BRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text.strip())
        if not branch or int(branch.group(2), 16) >= address:
            continue
        start = int(branch.group(2), 16)
        if around and not (start <= around[0] and around[1] <= address and (start, address) != around):
            continue
        body = [t for a, t in lines if start <= a <= address]
        if (holds and not any(holds.search(t) for t in body)) or (lacks and any(lacks.search(t) for t in body)):
            continue
        spans.append((branch.group(1) is None, address - start, start, address))
    return min(spans)[2:] if spans else None  # predicated first, then the innermost


_MMA_INSTRUCTION = re.compile(r"\b(?:HGMMA|HMMA)\.[0-9A-Za-z.]+")


def _mma_size(instruction: str) -> int:
    """M x N x K of an HGMMA.MxNxK (HMMA: 0): which of a kernel's MMAs is its widest."""
    found = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", instruction)
    return math.prod(int(v) for v in found.groups()) if found else 0


def _mma_loops(lines) -> list[dict]:
    """Each innermost loop (a predicated backward branch's span holding no other such span) with an MMA in it:
    its span, first MMA instruction, shared-memory round trips and wgmma wait depths (_loop_sync), in address
    order."""
    spans = set()
    for address, text in lines:
        branch = re.search(r"^@!?U?P\w+\s+BRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text.strip())
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            if any(_MMA.search(t) for a, t in lines if start <= a <= address):
                spans.add((start, address))
    loops = []
    for span in sorted(spans):
        if any(other != span and span[0] <= other[0] and other[1] <= span[1] for other in spans):
            continue  # an outer loop around an MMA loop
        body = _span_body(lines, span)
        mma = next(m.group(0).rstrip(".") for t in body if (m := _MMA_INSTRUCTION.search(t)))
        smem_ops, waits, _ = _loop_sync(body)
        loops.append({"span": span, "mma": mma, "smem_ops": smem_ops, "waits": waits})
    return loops


def _main_span(lines, loops: list[dict]) -> tuple[int, int] | None:
    """The main loop's span among a kernel's MMA loops (_mma_loops): the widest MMA's (a half tile's loop beside the
    full tiles' is not it: half_tail), then the innermost, then the first; _loop_span's where no predicated loop holds
    an MMA."""
    if not loops:
        return _loop_span(lines, _MMA)
    first, last = min(loops, key=lambda loop: (-_mma_size(loop["mma"]), loop["span"][1] - loop["span"][0],
                                               loop["span"]))["span"]  # fmt: skip
    return first, last


def _span_body(lines, span) -> list[str] | None:
    return None if span is None else [t for a, t in lines if span[0] <= a <= span[1]]


def _main_loop_body(sass: str) -> list[str] | None:
    """The main loop: the innermost loop around an HGMMA/HMMA, the widest MMA's where there are several
    (_main_span)."""
    lines = _sass_lines(sass)
    return _span_body(lines, _main_span(lines, _mma_loops(lines)))


def _tile_loop_rest(lines, main) -> list[str] | None:
    """A persistent kernel's tile loop less its main loop (the span `main`): what the MMA warps do between one
    tile's last wgmma and the next tile's first (the epilogue, the next tile's coordinates), while the tensor cores
    wait (a program an SM) or serve another program. None where no loop holds the main loop (one tile a
    program)."""
    outer = main and _loop_span(lines, around=main)
    if outer is None:
        return None
    return [t for a, t in lines if outer[0] <= a <= outer[1] and not main[0] <= a <= main[1]]


def _specialized_loops(lines, main) -> dict:
    # The producer's load loop: the innermost loop issuing TMA loads (UTMALDG) and no MMA, which must issue each K
    # step's loads in less time than the MMAs take to consume them; none where loads and MMAs share a loop.
    producer = _span_body(lines, _loop_span(lines, _TMA_LOAD, _MMA))
    found = {}
    for name, body in (("producer", producer), ("tile", _tile_loop_rest(lines, main))):
        found[f"{name}_instructions"] = None if body is None else len(body)
        found[f"{name}_divisions"] = None if body is None else sum("MUFU.RCP" in t for t in body)
    return found


def specialized_loops(sass: str) -> dict:
    """A warp-specialized persistent kernel's two other loops: the producer warp's load loop and the MMA warps'
    path between two tiles (_tile_loop_rest), their instructions and the runtime integer divisions among them (one
    MUFU.RCP each: a dependent chain of some fifteen instructions); None where there is none."""
    lines = _sass_lines(sass)
    return _specialized_loops(lines, _main_span(lines, _mma_loops(lines)))


def main_loop(sass: str) -> tuple[int | None, list[int], int | None]:
    """(shared-memory ops, wgmma wait depths, CTA-wide barriers) of the main loop (_main_loop_body); (None, [],
    None) when no loop holds an MMA. A warp-specialized loop synchronises by mbarriers alone: no BAR.SYNC."""
    return _loop_sync(_main_loop_body(sass))


def _loop_sync(body: list[str] | None) -> tuple[int | None, list[int], int | None]:
    if body is None:
        return None, [], None
    smem_ops = sum(bool(re.search(r"\b(?:LDS|LDSM|STS|STSM)(?:\.|\s|$)", t)) for t in body)
    waits = [int(m.group(1), 16) for t in body if (m := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", t))]
    barriers = sum(bool(re.search(r"\bBAR\.SYNC\b", t)) for t in body)
    return smem_ops, waits, barriers


def _operand_bits(suffixes: str) -> int:
    """The operand width of an MMA from its instruction's suffixes: .BF16, .TF32, .E4M3...; fp16 operands carry no
    suffix (HMMA.16816.F32 is fp16 in, fp32 out)."""
    tokens = set(suffixes.split("."))
    return 8 if tokens & {"E4M3", "E5M2"} else 32 if "TF32" in tokens else 16


def loop_work(sass: str) -> tuple[int | None, int | None, int | None]:
    """(instructions, tensor-core multiply-adds per warp, operand bits) of one pass of the main loop. HGMMA.MxNxK
    is a warpgroup's: M*N*K/4 a warp; HMMA.16816 (m16 n8 k16) a warp's own."""
    return _loop_mma(_main_loop_body(sass))


def _loop_mma(body: list[str] | None) -> tuple[int | None, int | None, int | None]:
    if body is None:
        return None, None, None
    fma, bits = 0, None
    for text in body:
        if found := re.search(r"\bHGMMA\.(\d+)x(\d+)x(\d+)((?:\.[0-9A-Z]+)*)", text):
            m, n, k = (int(v) for v in found.groups()[:3])
            fma += m * n * k // 4
        elif found := re.search(r"\bHMMA\.16(8)(\d+)((?:\.[0-9A-Z]+)*)", text):
            fma += 16 * int(found.group(1)) * int(found.group(2))
        else:
            continue
        bits = _operand_bits(found.groups()[-1])
    return len(body), fma, bits


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta").contiguous(memory_format=torch.channels_last_3d)


def launch_on_meta(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, config: KernelConfig, bias: bool = False
) -> None:
    """Run `direction`'s launcher on meta tensors of the problem (under compile_only, this compiles). A grouped
    problem of few channels a group runs as choice.launch runs it, on its coarse geometry (kernels/grouped.py),
    whose config `config` is, handed the problem's own weight and returning its own weight gradient. `bias`: the
    forward with a bias (a layer's), the input gradient with one per input channel (a transposed convolution's)."""
    coarse = grouped.coarsened(geom)
    weight_shape = geom.weight_shape()
    extra = {"diagonal": geom.groups // coarse.groups} if coarse is not geom else {}
    geom = coarse
    # The input, and the frames before it along D or the channels after its own when the geometry has a second
    # source there (the input gradient's: after grad_output's channels).
    n, c, d, h, w = geom.input_shape()
    p, a = geom.prefix_frames, geom.after_channels
    x, frames_before = _meta((n, c - a, d - p, h, w), dtype), _meta((n, c, p, h, w), dtype) if p else None
    channels_after = _meta((n, a, d, h, w), dtype) if a else None
    if direction == "fwd":
        b = torch.empty(geom.out_channels, dtype=dtype, device="meta") if bias else None
        conv_fwd.conv3d_fwd(x, _meta(weight_shape, dtype), b, frames_before, geom, config, channels_after, **extra)
    elif direction == "dgrad":  # and grad_output's channels_after (a transposed convolution's skip connection)
        n, _, *out_size = geom.output_shape()
        first, after = geom.out_channel_sources
        grad_after = _meta((n, after, *out_size), dtype) if after else None
        grad_out = _meta((n, first, *out_size), dtype)
        if bias:
            extra["bias"] = torch.empty(geom.in_channels, dtype=dtype, device="meta")
        conv_dgrad.conv3d_dgrad(grad_out, _meta(weight_shape, dtype), geom, config, grad_after, **extra)
    elif direction == "wgrad":
        grad_out = _meta(geom.output_shape(), dtype)
        conv_wgrad.conv3d_wgrad(grad_out, x, frames_before, geom, config, channels_after, **extra)
    else:
        raise ValueError(f"unknown direction {direction!r}")


def compile_launch(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, config: KernelConfig, capability: int, read: bool = True,
    bias: bool = False,
) -> list[KernelReport]:  # fmt: skip
    """Compile, without a GPU, what one launch of `direction` with `config` runs on sm_<capability> (launch_on_meta):
    one report per kernel (a launch with split-K also runs its reduction of the splits). Compile errors propagate.
    With `read` off, the reports hold their cubins unread: read_reports reads many launches' at once. `bias`: as
    launch_on_meta's."""
    launches: list = []
    with compile_only(capability, launches):
        launch_on_meta(direction, geom, dtype, config, bias)
    reports = []
    for name, grid, num_warps, kernel, seconds, maps in launches:
        reports.append(
            KernelReport(
                name, grid, num_warps, shared_bytes=kernel.metadata.shared, tensor_maps=maps, compile_s=seconds,
                cubin=kernel.asm["cubin"],
            )
        )  # fmt: skip
    if read:
        read_reports(reports)
    return reports


def read_reports(reports: list[KernelReport]) -> None:
    """Fill in what each report's cubin says (read_cubins: one disassembler run an architecture for them all)."""
    for report, facts in zip(reports, read_cubins([r.cubin for r in reports]), strict=True):
        vars(report).update(facts)


def report_rows(pending: list[tuple[dict, KernelReport | bytes]]) -> list[dict]:
    """Each (fields, kernel) as one dict: the fields, and the report (compiled unread: compile_launch's read=False)
    or what a cubin says, every cubin read at once (read_cubins)."""
    cubins = [kernel.cubin if isinstance(kernel, KernelReport) else kernel for _, kernel in pending]
    rows = []
    for (fields, kernel), facts in zip(pending, read_cubins(cubins), strict=True):
        if isinstance(kernel, KernelReport):
            vars(kernel).update(facts)
            facts = kernel.to_dict()
        rows.append({**fields, **facts})
    return rows


def fits(reports: list[KernelReport], arch: Arch) -> bool:
    """No spills and every kernel within the shared memory one program may take."""
    return all(not r.spill_bytes and not r.local_accesses and r.shared_bytes <= arch.smem_per_block for r in reports)


def compiles_cleanly(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, config: KernelConfig, arch: Arch, bias: bool = False
) -> bool:
    """Whether `config` compiles for `arch` without spills and within its shared memory: the tuner's filter
    before it spends device time on a candidate (the compile is cached, so timing it later costs no second).
    `bias`: launch_on_meta's."""
    try:
        return fits(compile_launch(direction, geom, dtype, config, arch.capability, bias=bias), arch)
    except Exception:  # out of resources at compile time, or a config the compiler rejects
        return False


Launch = tuple[str, ConvGeometry, torch.dtype, KernelConfig]  # direction, geometry, dtype, config


def compile_ahead(
    launches: Iterable[Launch], arch: Arch, workers: int
) -> tuple[Callable[[Launch], bool | None], Callable[[], None]]:
    """Compile `launches` (in their order) in `workers` processes while the caller times earlier ones on the GPU:
    the static compile fills Triton's on-disk cache under the key the JIT looks up, so the launch later compiles
    nothing (compiling, not timing, is most of a tuning key's or a variant's time; seen on the H100: every
    candidate found in the cache). Returns `wait(launch)` (whether it compiled cleanly, once it has; None for a
    launch not planned) and a shutdown."""
    # Spawned, not forked: the caller has CUDA initialised. Niced, so that the timing's launches come first.
    spawn = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=spawn, initializer=os.nice, initargs=(10,))
    pending: dict[Launch, Future] = {}
    for planned in launches:
        if planned not in pending:
            pending[planned] = pool.submit(compiles_cleanly, *planned, arch)

    def wait(planned: Launch) -> bool | None:
        future = pending.get(planned)
        return None if future is None else future.result()

    return wait, lambda: pool.shutdown(wait=False, cancel_futures=True)
