"""Named sets of Conv3d problems, read from JSON: the one list the tuner and the benchmarks share.

A shape-set file holds {"name", "description", "cases": [...]}; each case has name, batch, cin, cout,
size [D, H, W], kernel (int or 3 ints) and optionally stride, padding (any form tconv3d.conv3d takes; default
kernel // 2 per dimension), dilation, groups (default 1) and dtypes (default ["bf16"]).
`load_shape_set("bench")` reads the set shipped in tconv3d/tune/shape_sets/; any other argument is a path to a file
in the same format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..geometry import DTYPES_BY_NAME, ConvGeometry, conv_geometry, resolve_padding, triple
from ..kernels import grouped

SHAPE_SET_DIR = Path(__file__).parent / "shape_sets"
# Multiples of one direction's FLOPs: backward is input-grad plus weight-grad.
DIRECTION_FLOP_FACTOR = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}


@dataclass(frozen=True)
class ConvShape:
    name: str
    batch: int
    cin: int
    cout: int
    size: tuple[int, int, int]
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int, int, int, int]
    dilation: tuple[int, int, int]
    dtypes: tuple[str, ...]
    groups: int = 1
    # Frames of a second tensor in front of the input along D (a causal video VAE's cached frames: conv3d's
    # frames_before), read in place by the forward.
    frames_before: int = 0
    # conv3d's padding_mode: "zeros", or a border mode (replicate, reflect, circular) in every dimension.
    padding_mode: str = "zeros"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch, self.cin, *self.size)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (self.cout, self.cin // self.groups, *self.kernel)

    @property
    def decoder_layer(self) -> bool:
        """A video VAE decoder's layer as a converted decode calls it (the `decoders` set): reading cached frames or
        bordered in a mode other than zeros. Timed in the forward alone (inference), by bench.variants: the suite's
        and the tuner's calls pass no cached frames, and tuning keys do not tell border modes apart."""
        return bool(self.frames_before) or self.padding_mode != "zeros"

    def require_plain(self) -> None:
        """ValueError for a decoder's layer, where the suite and the tuner would time it without its cached frames
        or its border mode."""
        if self.decoder_layer:
            raise ValueError(f"{self.name} is a decoder's layer (cached frames or borders): bench.variants times it")

    @property
    def frames_before_shape(self) -> tuple[int, ...] | None:
        return (self.batch, self.cin, self.frames_before, *self.size[1:]) if self.frames_before else None

    def geometry(self) -> ConvGeometry:
        return conv_geometry(
            self.input_shape, self.weight_shape, self.stride, self.padding, self.dilation, self.padding_mode,
            prefix_frames=self.frames_before, groups=self.groups,
        )  # fmt: skip

    def launched_geometry(self) -> ConvGeometry:
        """The geometry its kernels run (choice.launch): groups of few channels side by side (kernels/grouped.py).
        Tuning keys, tuned configs and compiled launches are this geometry's."""
        return grouped.coarsened(self.geometry())

    def flops(self, direction: str = "fwd") -> int:
        """2 * N*Do*Ho*Wo * Cout * Cin*kd*kh*kw per direction; backward counts twice, fwd+bwd three times."""
        return DIRECTION_FLOP_FACTOR[direction] * self.geometry().flops()


def _shape_from_dict(entry: dict, source: str) -> ConvShape:
    try:
        kernel = triple(entry["kernel"], "kernel")
        stride = triple(entry.get("stride", 1), "stride")
        dilation = triple(entry.get("dilation", 1), "dilation")
        padding = entry.get("padding", [k // 2 for k in kernel])
        padding = resolve_padding(padding, kernel, stride, dilation)
        dtypes = tuple(entry.get("dtypes", ["bf16"]))
        unknown = [d for d in dtypes if d not in DTYPES_BY_NAME]
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown}; expected some of {sorted(DTYPES_BY_NAME)}")
        shape = ConvShape(
            name=str(entry["name"]),
            batch=int(entry["batch"]),
            cin=int(entry["cin"]),
            cout=int(entry["cout"]),
            size=tuple(int(s) for s in entry["size"]),
            kernel=kernel,
            stride=stride,
            padding=padding,
            dilation=dilation,
            dtypes=dtypes,
            groups=int(entry.get("groups", 1)),
            frames_before=int(entry.get("frames_before", 0)),
            padding_mode=str(entry.get("padding_mode", "zeros")),
        )
        if len(shape.size) != 3:
            raise ValueError(f"size must be [D, H, W], got {entry['size']}")
        shape.geometry()  # checks that the convolution is well-formed
    except KeyError as missing:
        raise ValueError(f"{source}: case {entry.get('name', '?')!r} lacks the field {missing}") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: case {entry.get('name', '?')!r}: {error}") from None
    return shape


def load_shape_set(name_or_path: str | Path) -> list[ConvShape]:
    """The cases of a shipped shape set (by name, e.g. "bench") or of a JSON file in the same format."""
    path = Path(name_or_path)
    if not path.suffix and (SHAPE_SET_DIR / f"{name_or_path}.json").exists():
        path = SHAPE_SET_DIR / f"{name_or_path}.json"
    if not path.exists():
        shipped = sorted(p.stem for p in SHAPE_SET_DIR.glob("*.json"))
        raise FileNotFoundError(
            f"no shape set {str(name_or_path)!r}: not a file, nor one of the shipped sets {shipped}"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list) or not data["cases"]:
        raise ValueError(f"{path}: expected an object with a non-empty 'cases' list")
    shapes = [_shape_from_dict(entry, str(path)) for entry in data["cases"]]
    names = [s.name for s in shapes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{path}: case names must be unique, repeated: {duplicates}")
    return shapes
