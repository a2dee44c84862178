"""Checkpoint files: standard safetensors files written as a stream, with a checksum per chunk, and read
back by byte range.

[Note: why our own safetensors reader and writer]
The file format is safetensors' (an 8-byte header length, a JSON header naming each tensor's dtype,
shape and byte range, then the bytes), so any safetensors reader opens a rank file or a consolidated
model. The library's own writer (`safetensors.torch.save_file`) first turns every tensor into a Python
`bytes` copy, doubling a rank's memory for the length of the save, and its reader maps the file without
verifying what it returns. Here a writer streams each tensor's memory to the file as it is (no copy)
and records a CRC-32 for every CHUNK_BYTES of the file; a reader reads only the chunks that hold the
byte range it is asked for (`os.pread`, no memory map: pages read do not stay in the process), checks
each chunk once, and keeps the last few, so neighbouring small tensors cost one read. A truncated file
or a flipped byte is then an error naming the file and the bytes, never wrong weights.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

import numpy
import torch

CHUNK_BYTES = 4 << 20  # a checksum per 4 MiB of file: a range read over-reads at most two chunks
CACHED_CHUNKS = 4  # chunks a reader keeps, so neighbouring small tensors cost one read
ALIGN = 8  # safetensors pads its header so that data starts 8-byte aligned

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, truncated, corrupted or not what the manifest says it is."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: what the header says about it."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FileRecord:
    """What the manifest knows of one file: its size and a CRC-32 per chunk."""

    name: str
    bytes: int
    crc32: tuple[int, ...]
    chunk_bytes: int = CHUNK_BYTES

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "chunk_bytes": self.chunk_bytes, "crc32": list(self.crc32)}

    @classmethod
    def from_json(cls, data: dict) -> "FileRecord":
        return cls(data["name"], int(data["bytes"]), tuple(data["crc32"]), int(data["chunk_bytes"]))


# --- writing ---------------------------------------------------------------------------------------

@dataclass
class _ChunkSums:
    """CRC-32 of each CHUNK_BYTES of a stream, fed in pieces of any size."""

    chunk_bytes: int = CHUNK_BYTES
    sums: list[int] = field(default_factory=list)
    current: int = 0
    filled: int = 0

    def feed(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_bytes - self.filled)
            self.current = zlib.crc32(data[:take], self.current)  # releases the GIL on large buffers
            self.filled += take
            data = data[take:]
            if self.filled == self.chunk_bytes:
                self.sums.append(self.current)
                self.current, self.filled = 0, 0

    def finish(self) -> tuple[int, ...]:
        return tuple(self.sums + ([self.current] if self.filled else []))


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header for `specs` stored back to back in that order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        header[spec.key] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous. Read through a ctypes array over its memory,
    which holds the tensor until the view is let go of, rather than through numpy: a storage numpy has seen can no
    longer be resized, and stage 3 releases a gathered unit by resizing its storage to nothing, so a parameter could
    not be written from its own memory."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    window = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    window.tensor = flat  # the memory's owner, alive as long as the array (and the memoryview over it)
    return memoryview(window).cast("B")


def write_file(path: Path, specs: Sequence[TensorSpec], sources: Iterable[Sequence[torch.Tensor]],
               metadata: dict[str, str] | None = None,
               after_tensor: Callable[[int], None] | None = None) -> FileRecord:
    """Write a safetensors file at `path` (the caller renames it into place), streaming each tensor from
    its sources (CPU tensors whose elements, back to back, are the tensor's), then flush and fsync.
    Returns the file's size and chunk checksums (named by `path`'s final name, without a .tmp suffix).
    after_tensor(n): called, the file flushed, once n tensors are written (See [Note: a save killed on purpose]
    in faults.py)."""
    sums = _ChunkSums()
    written = 0
    with open(path, "wb") as file:
        written += _write(file, memoryview(header_bytes(specs, metadata)), sums)
        for count, (spec, parts) in enumerate(zip(specs, sources, strict=True), start=1):
            numel = 0
            for part in parts:  # may be a generator that reads each part just in time (consolidation)
                numel += part.numel()
                if part.dtype != spec.dtype:
                    raise RuntimeError(f"tensor {spec.key!r} is {spec.dtype} in the header but a source is "
                                       f"{part.dtype} (an internal bug)")
                written += _write(file, tensor_bytes_view(part.cpu()), sums)
                del part  # before the generator makes the next one
            if numel != spec.numel:
                raise RuntimeError(f"tensor {spec.key!r} has {spec.numel} elements but its sources hold {numel} "
                                   "(an internal bug)")
            if after_tensor is not None:
                file.flush()
                after_tensor(count)
        file.flush()
        os.fsync(file.fileno())
    return FileRecord(path.name.removesuffix(".tmp"), written, sums.finish())


def _write(file: BinaryIO, data: memoryview, sums: _ChunkSums) -> int:
    file.write(data)
    sums.feed(data)
    return len(data)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- reading ---------------------------------------------------------------------------------------

class CheckedReader:
    """Reads byte ranges of one file, each chunk checked against the manifest's CRC-32 once."""

    def __init__(self, path: Path, record: FileRecord) -> None:
        self.path, self.record = path, record
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointFileError(f"{path}: missing") from None
        size = os.fstat(self.fd).st_size
        if size != record.bytes:
            os.close(self.fd)
            what = "truncated" if size < record.bytes else "longer than it should be"
            raise CheckpointFileError(f"{path}: {what}: {size} bytes, the manifest says {record.bytes}")
        self.size = size
        self.cache: OrderedDict[int, bytes] = OrderedDict()
        self.tensors, self.data_start = self._read_header()

    def close(self) -> None:
        os.close(self.fd)

    def read(self, begin: int, end: int) -> bytes:
        """Bytes [begin, end) of the file."""
        if end > self.size:
            raise CheckpointFileError(f"{self.path}: truncated: bytes {begin}-{end} asked for, "
                                      f"the file has {self.size}")
        chunk = self.record.chunk_bytes
        pieces = []
        for index in range(begin // chunk, (end - 1) // chunk + 1 if end > begin else begin // chunk):
            data = self._chunk(index)
            start = index * chunk
            pieces.append(data[max(begin - start, 0):min(end - start, len(data))])
        return b"".join(pieces)

    def _chunk(self, index: int) -> bytes:
        if index in self.cache:
            self.cache.move_to_end(index)
            return self.cache[index]
        chunk = self.record.chunk_bytes
        data = os.pread(self.fd, min(chunk, self.size - index * chunk), index * chunk)
        if index >= len(self.record.crc32) or zlib.crc32(data) != self.record.crc32[index]:
            raise CheckpointFileError(f"{self.path}: corrupted: bytes {index * chunk}-{index * chunk + len(data)} "
                                      "fail their checksum")
        self.cache[index] = data
        if len(self.cache) > CACHED_CHUNKS:
            self.cache.popitem(last=False)
        return data

    def _read_header(self) -> tuple[dict[str, tuple[TensorSpec, int]], int]:
        if self.size < 8:
            raise CheckpointFileError(f"{self.path}: truncated: {self.size} bytes, no safetensors header")
        (length,) = struct.unpack("<Q", self.read(0, 8))
        if 8 + length > self.size:
            raise CheckpointFileError(f"{self.path}: truncated: the header says {length} bytes, the file has "
                                      f"{self.size}")
        try:
            header = json.loads(self.read(8, 8 + length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointFileError(f"{self.path}: corrupted: the safetensors header is not JSON") from None
        header.pop("__metadata__", None)
        tensors = {key: (TensorSpec(key, DTYPES[entry["dtype"]], tuple(entry["shape"])), entry["data_offsets"][0])
                   for key, entry in header.items()}
        return tensors, 8 + length

    def spec(self, key: str) -> TensorSpec:
        if key not in self.tensors:
            raise CheckpointFileError(f"{self.path}: has no tensor {key!r} (the manifest says it should)")
        return self.tensors[key][0]

    def read_elements(self, key: str, begin: int, end: int) -> torch.Tensor:
        """Elements [begin, end) of tensor `key`, flattened, as a new 1-D CPU tensor of its dtype."""
        out = torch.empty(end - begin if end > begin else 0, dtype=self.spec(key).dtype)
        self.read_into(key, begin, out)
        return out

    def read_into(self, key: str, begin: int, out: torch.Tensor) -> None:
        """Elements [begin, begin + out.numel()) of tensor `key` into `out` (contiguous, CPU, its dtype),
        chunk by chunk: no copy of the range is ever held besides `out`."""
        spec, offset = self.spec(key), self.tensors[key][1]
        end = begin + out.numel()
        if not 0 <= begin <= end <= spec.numel or out.dtype != spec.dtype or not out.is_contiguous():
            raise CheckpointFileError(f"{self.path}: tensor {key!r} ({spec.dtype}, {spec.numel} elements) cannot fill "
                                      f"[{begin}, {end}) of a {out.dtype} tensor")
        if end == begin:
            return
        size = spec.dtype.itemsize
        first, last = self.data_start + offset + begin * size, self.data_start + offset + end * size
        if last > self.size:
            raise CheckpointFileError(f"{self.path}: truncated: bytes {first}-{last} asked for, "
                                      f"the file has {self.size}")
        target = out.view(-1).view(torch.uint8).numpy()
        chunk, position = self.record.chunk_bytes, first
        while position < last:
            index = position // chunk
            data = self._chunk(index)
            start = position - index * chunk
            take = min(len(data) - start, last - position)
            target[position - first:position - first + take] = numpy.frombuffer(data, numpy.uint8, take, start)
            position += take

    def read_tensor(self, key: str) -> torch.Tensor:
        spec = self.spec(key)
        return self.read_elements(key, 0, spec.numel).reshape(spec.shape)


class Readers:
    """One CheckedReader per file of a checkpoint directory, opened on first use."""

    def __init__(self, directory: Path, records: dict[str, FileRecord]) -> None:
        self.directory, self.records = directory, records
        self.open: dict[str, CheckedReader] = {}

    def __call__(self, name: str) -> CheckedReader:
        if name not in self.open:
            if name not in self.records:
                raise CheckpointFileError(f"{self.directory / 'manifest.json'}: lists no file {name!r}")
            self.open[name] = CheckedReader(self.directory / name, self.records[name])
        return self.open[name]

    def close(self) -> None:
        for reader in self.open.values():
            reader.close()
        self.open.clear()
