"""Record calls of the CPU decode kernel (kvcal_decode_attention_cpu) on this machine and replay them on another
architecture: tests/cpu_replay/replay_decode.cpp, built for aarch64 and run under qemu-user, makes the same calls on
the same bytes and compares its output with this machine's.

A recording holds every memory region the call can reach (the storage of each tensor of the stores, the codec
tables, the query, the softmax state, the descriptor and lengths), the call's arguments with pointers as (region,
offset), the pointers inside the descriptor as relocations, and the output this machine computed. Layout, little-
endian: "KVRP", regions (u32 count; u64 size + bytes each), calls (u32 count; u32 arguments, then per argument a u8
kind: 0 pointer (u32 region, u64 offset), 1 int32, 2 int64, 3 float32, 4 null), relocations (u32 count; u32 region,
u64 offset, u32 target region, u64 target offset each), then the output: u32 region, u64 offset, u64 floats and
the floats."""

from __future__ import annotations

import ctypes
import struct
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from kvcal.runtime import cpu_kernel, kernels
from kvcal.runtime import kernel_source as src

# kvcal_decode_attention_cpu's arguments: pointer, int32, int64 or float32, in order
DECODE_ARGUMENTS = "PPPPPLIIIIIIFFPPPPIII"
QUERY, COS, SIN, ROPE_STRIDE, BATCH, KV_HEADS, GROUP, HEAD_DIM, VALUE_DIM, VALUES_SCORED = 0, 3, 4, 5, 6, 7, 8, 9, 10, 11
M_STATE, L_STATE, ACC_STATE, ROW_FIRST = 14, 15, 16, 17
_F = cpu_kernel.CpuSideField
DESCRIPTOR_POINTERS = (_F.SINK, _F.RECENT, _F.WORDS, _F.PARAM0, _F.PARAM1, _F.CODEBOOK, _F.OUTLIER_POSITIONS, _F.OUTLIER_VALUES,
                       _F.OUTLIER_OFFSETS, _F.OUTLIER_COUNTS, _F.GROUP_OF_CHANNEL)  # the fields that hold addresses
SIDE_FIELDS = _F.SIDE_FIELDS


def tensors_of(obj, depth: int = 4) -> list[torch.Tensor]:
    """Every tensor reachable from obj through attributes, dicts, lists and tuples (depth-limited)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or isinstance(obj, (str, bytes, int, float, type(None))):
        return []
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_of(child, depth - 1)]


class Regions:
    """Memory regions by start address: a tensor's whole storage, or a numpy array's buffer."""

    def __init__(self):
        self.starts: list[int] = []
        self.data: list[bytes] = []

    def add_tensor(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.add(storage.data_ptr(), storage.nbytes())

    def add_array(self, array: np.ndarray) -> None:
        self.add(array.ctypes.data, array.nbytes)

    def add(self, start: int, size: int) -> None:
        if size and start not in self.starts:
            self.starts.append(start)
            self.data.append(ctypes.string_at(start, size))

    def locate(self, address: int) -> tuple[int, int] | None:
        for index, (start, data) in enumerate(zip(self.starts, self.data)):
            if start <= address < start + len(data):
                return index, address - start
        return None


@contextmanager
def recording(path: Path, stores: list):
    """While open, calls of the CPU decode kernel are recorded (and run) with `stores`' tensors, the codec tables and
    the call's own buffers (query, RoPE tables, softmax state, descriptor, lengths) as the reachable memory; the recording is written to `path` when
    the block ends, with what the last call left in its acc_state (the output) as the expected output."""
    real = cpu_kernel.library()
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def kvcal_decode_attention_cpu(self, *args):
            regions = Regions()
            descriptor = np.ctypeslib.as_array(ctypes.cast(args[1], ctypes.POINTER(ctypes.c_longlong)), shape=(2 * SIDE_FIELDS,)).copy()
            meta_count = 2 * args[BATCH] * cpu_kernel.META_FIELDS
            meta = np.ctypeslib.as_array(ctypes.cast(args[2], ctypes.POINTER(ctypes.c_int32)), shape=(meta_count,)).copy()
            for tensor in (t for store in stores for t in tensors_of(store)):
                regions.add_tensor(tensor)
            for store in stores:
                for body in (store.body,) if hasattr(store, "body") else ():
                    for tensor in kernels.codec_tables(body).values():
                        regions.add_tensor(tensor)
                    if kernels.codec_id(body.codec) == src.PERMUTED_GROUPS:
                        regions.add_tensor(kernels.channel_groups(body.codec, "cpu"))
            for array in (descriptor, meta):
                regions.add_array(array)
            batch, heads, value_dim = args[BATCH], args[KV_HEADS] * args[GROUP], args[VALUE_DIM]
            query_width = args[HEAD_DIM] + (value_dim if args[VALUES_SCORED] else 0)  # (MLA's: keys' and latent's)
            sizes = {QUERY: batch * heads * query_width, COS: batch * args[ROPE_STRIDE], SIN: batch * args[ROPE_STRIDE],
                     M_STATE: batch * heads, L_STATE: batch * heads, ACC_STATE: batch * heads * value_dim,
                     ROW_FIRST: batch * heads}  # floats or int32s: 4 bytes each
            for index, floats in sizes.items():
                if args[index]:
                    regions.add(int(args[index]), 4 * floats)
            arguments = list(args)
            arguments[1], arguments[2] = descriptor.ctypes.data, meta.ctypes.data
            real.kvcal_decode_attention_cpu(*arguments)
            # the copies stay alive with the call, so that no later call's copies take their addresses
            calls.append((regions, arguments, (descriptor, meta), ctypes.string_at(int(args[ACC_STATE]), 4 * sizes[ACC_STATE])))

    original = cpu_kernel.library
    cpu_kernel.library = lambda: Recorder()
    try:
        yield
    finally:
        cpu_kernel.library = original
    write(path, calls)


def write(path: Path, calls: list) -> None:
    """One file per recording: the regions as they were before the first call, each call, the expected output."""
    regions = calls[0][0]
    for other, *_ in calls[1:]:  # later calls' own descriptor and lengths
        for start, data in zip(other.starts, other.data):
            if start not in regions.starts:
                regions.starts.append(start)
                regions.data.append(data)
    out = [b"KVRP", struct.pack("<I", len(regions.data))]
    for data in regions.data:
        out += [struct.pack("<Q", len(data)), data]
    out.append(struct.pack("<I", len(calls)))
    relocations = []
    for _, arguments, (descriptor, _meta), _output in calls:
        out.append(struct.pack("<I", len(arguments)))
        for kind, value in zip(DECODE_ARGUMENTS, arguments):
            if kind == "P":
                where = regions.locate(int(value)) if value else None
                out.append(struct.pack("<BIQ", 0, *where) if where else struct.pack("<B", 4))
                assert value == 0 or where is not None, f"pointer {value:#x} outside the recorded memory"
            else:
                out.append(struct.pack({"I": "<Bi", "L": "<Bq", "F": "<Bf"}[kind], {"I": 1, "L": 2, "F": 3}[kind], value))
        region, offset = regions.locate(descriptor.ctypes.data)
        for side in range(2):
            for field in DESCRIPTOR_POINTERS:
                index = side * SIDE_FIELDS + field
                if descriptor[index]:
                    target = regions.locate(int(descriptor[index]))
                    assert target is not None, f"descriptor field {index} points outside the recorded memory"
                    relocations.append((region, offset + 8 * index, *target))
    out.append(struct.pack("<I", len(relocations)))
    out += [struct.pack("<IQIQ", *r) for r in relocations]
    _, last, _, expected = calls[-1]
    out += [struct.pack("<IQQ", *regions.locate(int(last[ACC_STATE])), len(expected) // 4), expected]
    path.write_bytes(b"".join(out))
