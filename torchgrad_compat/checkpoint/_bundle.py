"""TensorFlow's tensor bundle (the format of ``tf.train.Saver`` and ``tf.train.Checkpoint``), without TF.

A checkpoint ``<prefix>`` is two kinds of file:

- ``<prefix>.index``: a LevelDB-style sorted table (TF's ``tensorflow/core/lib/io/table``).
  Its keys are the tensor names; the value under ``""`` is a ``BundleHeaderProto``
  (number of shards, endianness, version), every other value a ``BundleEntryProto``
  (dtype, shape, shard, offset, size, masked CRC32C of the bytes);
- ``<prefix>.data-NNNNN-of-MMMMM``: the tensors' raw little-endian bytes, back to back.

Only the few protobuf fields those two messages use are decoded, by hand. Every
block of the table and every tensor read is checked against its CRC32C.
"""

from __future__ import annotations

import math
import os
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["BundleEntry", "BundleReader", "CorruptCheckpointError", "write_bundle"]

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48  # two block handles padded to 40 bytes, then the 8-byte magic
_BLOCK_TRAILER_SIZE = 5  # compression type byte + masked CRC32C
_MASK_DELTA = 0xA282EAD8
_CHUNK = 4 << 20  # bytes read at a time when a tensor's CRC32C is checked without keeping it
_MAX_PREAD = 1 << 30  # larger tensors are read in _CHUNK pieces (Linux returns at most ~2 GiB a call)
# TF's DataType enum -> (its name, torch dtype). Strings, resources, variants and quantized
# types have no torch dtype; an enum not listed here reads as "dtype_enum_<N>", also without one.
_DTYPES: dict[int, tuple[str, torch.dtype | None]] = {
    1: ("float32", torch.float32),
    2: ("float64", torch.float64),
    3: ("int32", torch.int32),
    4: ("uint8", torch.uint8),
    5: ("int16", torch.int16),
    6: ("int8", torch.int8),
    7: ("string", None),
    8: ("complex64", torch.complex64),
    9: ("int64", torch.int64),
    10: ("bool", torch.bool),
    14: ("bfloat16", torch.bfloat16),
    17: ("uint16", torch.uint16),
    18: ("complex128", torch.complex128),
    19: ("float16", torch.float16),
    22: ("uint32", torch.uint32),
    23: ("uint64", torch.uint64),
    # Listed by name, never loaded: no torch dtype holds them.
    11: ("qint8", None),
    12: ("quint8", None),
    13: ("qint32", None),
    15: ("qint16", None),
    16: ("quint16", None),
    20: ("resource", None),
    21: ("variant", None),
}
_DTYPE_ENUM = {torch_dtype: enum for enum, (_, torch_dtype) in _DTYPES.items() if torch_dtype is not None}


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated, malformed or fails its CRC32C check.

    Attributes:
        problems: from ``load_tf_checkpoint``, every tensor that cannot be read,
            name -> why; empty when the index itself is unreadable.
    """

    def __init__(self, message: str, problems: dict[str, str] | None = None):
        super().__init__(message)
        self.problems = dict(problems or {})


def _crc32c_module():
    # Imported here, not with the package: only reading or writing a checkpoint needs it
    # (an environment installed with --no-deps still imports torchgrad_compat).
    try:
        import google_crc32c
    except ImportError as error:
        raise ImportError(
            "reading or writing TF checkpoints needs google-crc32c (a dependency of torchgrad_compat): "
            "pip install google-crc32c"
        ) from error
    return google_crc32c


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _masked_crc(data: bytes | memoryview) -> int:
    return _mask(_crc32c_module().value(data))


# ---------------------------------------------------------------------- varints and protobuf
def _varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise CorruptCheckpointError(f"{where}: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _proto_fields(buf: bytes, where: str) -> dict[int, list[int | bytes]]:
    """A protobuf message's fields, by number; varint and fixed values as ints, the others as bytes."""
    fields: dict[int, list[int | bytes]] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos, where)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos, where)
            value, pos = buf[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise CorruptCheckpointError(f"{where}: unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise CorruptCheckpointError(f"{where}: truncated protobuf field {number}")
        fields.setdefault(number, []).append(value)
    return fields


def _field(fields: dict[int, list[int | bytes]], number: int, default: int | bytes = 0) -> int | bytes:
    values = fields.get(number)
    return values[-1] if values else default


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _encode_varint(number << 3) + _encode_varint(value) if value else b""


# ---------------------------------------------------------------------- the table
def _read_block(data: bytes, offset: int, size: int, where: str) -> bytes:
    end = offset + size + _BLOCK_TRAILER_SIZE
    if offset < 0 or end > len(data):
        raise CorruptCheckpointError(f"{where}: block at {offset} (+{size}) runs past the end of the file")
    contents = data[offset : offset + size]
    kind = data[offset + size]
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    if _masked_crc(data[offset : offset + size + 1]) != stored:
        raise CorruptCheckpointError(f"{where}: CRC32C mismatch in the table block at offset {offset}")
    if kind != 0:
        raise CorruptCheckpointError(
            f"{where}: table block at offset {offset} is compressed (type {kind}); "
            "only uncompressed tables (what TensorFlow writes) are read"
        )
    return contents


def _block_entries(block: bytes, where: str) -> list[tuple[bytes, bytes]]:
    if len(block) < 4:
        raise CorruptCheckpointError(f"{where}: table block too short")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * num_restarts
    if end < 0:
        raise CorruptCheckpointError(f"{where}: bad restart count {num_restarts} in a table block")
    entries = []
    key = b""
    pos = 0
    while pos < end:
        shared, pos = _varint(block, pos, where)
        non_shared, pos = _varint(block, pos, where)
        value_length, pos = _varint(block, pos, where)
        if shared > len(key) or pos + non_shared + value_length > end:
            raise CorruptCheckpointError(f"{where}: malformed table block entry")
        key = key[:shared] + block[pos : pos + non_shared]
        pos += non_shared
        entries.append((key, block[pos : pos + value_length]))
        pos += value_length
    return entries


def _read_table(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a LevelDB-style table, in order."""
    if len(data) < _FOOTER_SIZE:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes, too short for a table")
    footer = data[-_FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, 40)
    if magic != _TABLE_MAGIC:
        raise CorruptCheckpointError(f"{where}: not a TensorFlow checkpoint index (bad magic number)")
    pos = 0
    _meta_offset, pos = _varint(footer, pos, where)
    _meta_size, pos = _varint(footer, pos, where)
    index_offset, pos = _varint(footer, pos, where)
    index_size, pos = _varint(footer, pos, where)
    entries = []
    for _, handle in _block_entries(_read_block(data, index_offset, index_size, where), where):
        offset, hpos = _varint(handle, 0, where)
        size, _ = _varint(handle, hpos, where)
        entries.extend(_block_entries(_read_block(data, offset, size, where), where))
    return entries


def _build_block(entries: list[tuple[bytes, bytes]]) -> bytes:
    # A restart point at every entry (no key sharing): larger than TF's own
    # tables, and just as valid for its reader.
    body = bytearray()
    restarts = []
    for key, value in entries:
        restarts.append(len(body))
        body += _encode_varint(0) + _encode_varint(len(key)) + _encode_varint(len(value)) + key + value
    if not restarts:
        restarts = [0]
    body += b"".join(struct.pack("<I", r) for r in restarts) + struct.pack("<I", len(restarts))
    return bytes(body)


def _append_block(out: bytearray, block: bytes) -> bytes:
    """Append a block and its trailer; return its encoded handle."""
    handle = _encode_varint(len(out)) + _encode_varint(len(block))
    out += block + b"\x00" + struct.pack("<I", _masked_crc(block + b"\x00"))
    return handle


def _build_table(entries: list[tuple[bytes, bytes]]) -> bytes:
    out = bytearray()
    data_handle = _append_block(out, _build_block(entries))
    meta_handle = _append_block(out, _build_block([]))
    index_handle = _append_block(out, _build_block([(entries[-1][0], data_handle)]))
    footer = (meta_handle + index_handle).ljust(40, b"\x00") + struct.pack("<Q", _TABLE_MAGIC)
    return bytes(out + footer)


# ---------------------------------------------------------------------- the bundle
@dataclass(frozen=True)
class BundleEntry:
    """Where one tensor lies: its TF dtype name, shape, shard, byte range and masked CRC32C."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    crc32c: int
    torch_dtype: torch.dtype | None
    # A partitioned variable: its pieces, each ((start, length) per dim), stored as entries of their own.
    slices: tuple[tuple[tuple[int, int], ...], ...] = ()


def _parse_entry(name: str, value: bytes, where: str) -> BundleEntry:
    fields = _proto_fields(value, f"{where}, entry {name!r}")
    enum = int(_field(fields, 1))
    shape_fields = _proto_fields(bytes(_field(fields, 2, b"")), f"{where}, shape of {name!r}")
    dims = tuple(
        int(_field(_proto_fields(bytes(d), f"{where}, shape of {name!r}"), 1))
        for d in shape_fields.get(2, [])
    )
    dtype, torch_dtype = _DTYPES.get(enum, (f"dtype_enum_{enum}", None))
    slices = tuple(
        _parse_slice(bytes(proto), dims, f"{where}, slice of {name!r}") for proto in fields.get(7, [])
    )
    return BundleEntry(
        name=name,
        dtype=dtype,
        shape=dims,
        shard=int(_field(fields, 3)),
        offset=int(_field(fields, 4)),
        size=int(_field(fields, 5)),
        crc32c=int(_field(fields, 6)),
        torch_dtype=torch_dtype,
        slices=slices,
    )


def _parse_slice(proto: bytes, dims: tuple[int, ...], where: str) -> tuple[tuple[int, int], ...]:
    """A TensorSliceProto as (start, length) per dim; an extent without a length is the whole dim."""
    extents = _proto_fields(proto, where).get(1, [])
    if len(extents) != len(dims):
        raise CorruptCheckpointError(f"{where}: {len(extents)} extents for a {len(dims)}-D tensor")
    out = []
    for extent, dim in zip(extents, dims, strict=True):
        fields = _proto_fields(bytes(extent), where)
        start = int(_field(fields, 1))
        out.append((start, int(_field(fields, 2)) if 2 in fields else dim - start))
    return tuple(out)


# ---------------------------------------------------------------------- slice keys (OrderedCode)
# A piece of a partitioned variable is stored under a binary key: TF's OrderedCode
# encoding of (0, name, rank, start_0, length_0, ...), see tensor_slice_util / ordered_code.cc.
def _ordered_unsigned(key: bytes, pos: int) -> tuple[int, int]:
    length = key[pos]
    return int.from_bytes(key[pos + 1 : pos + 1 + length], "big"), pos + 1 + length


def _ordered_string(key: bytes, pos: int) -> tuple[bytes, int]:
    out = bytearray()
    while pos + 1 < len(key):
        byte, following = key[pos], key[pos + 1]
        if byte == 0x00 and following == 0x01:
            return bytes(out), pos + 2
        if byte in (0x00, 0xFF):  # escaped 0x00 (00 ff) or 0xff (ff 00)
            out.append(byte)
            pos += 2
        else:
            out.append(byte)
            pos += 1
    raise ValueError("unterminated string")


def _leading_ones(byte: int) -> int:
    count = 0
    while count < 8 and byte & (0x80 >> count):
        count += 1
    return count


def _ordered_signed(key: bytes, pos: int) -> tuple[int, int]:
    # The first bits give the length in bytes (ones for a positive value, zeros
    # for a negative one); they are XORed onto the big-endian two's complement.
    flip = 0x00 if key[pos] & 0x80 else 0xFF
    length = _leading_ones(key[pos] ^ flip)
    if length == 8:
        length += _leading_ones(key[pos + 1] ^ flip)
    raw = bytearray(key[pos : pos + length])
    if len(raw) != length:
        raise ValueError("truncated number")
    header = ((0xFFFF << (16 - length)) & 0xFFFF).to_bytes(2, "big")
    raw[0] ^= header[0]
    if length > 1:
        raw[1] ^= header[1]
    return int.from_bytes(raw, "big", signed=True), pos + length


def _decode_slice_key(key: bytes, where: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    try:
        zero, pos = _ordered_unsigned(key, 0)
        name, pos = _ordered_string(key, pos)
        rank, pos = _ordered_unsigned(key, pos)
        extents = []
        for _ in range(rank):
            start, pos = _ordered_signed(key, pos)
            length, pos = _ordered_signed(key, pos)
            extents.append((start, length))
        if zero != 0 or pos != len(key):
            raise ValueError("trailing bytes")
        return name.decode("utf-8"), tuple(extents)
    except (IndexError, ValueError) as error:
        raise CorruptCheckpointError(f"{where}: malformed slice key {key!r} ({error})") from None


class BundleReader:
    """The entries of a checkpoint's index, and its tensors read on demand (CRC-checked)."""

    def __init__(self, prefix: str | os.PathLike[str]):
        self._fds: dict[int, int] = {}
        self.prefix = str(prefix)
        index = Path(f"{self.prefix}.index")
        where = str(index)
        data = index.read_bytes()
        table = _read_table(data, where)
        if not table or table[0][0] != b"":
            raise CorruptCheckpointError(f"{where}: the bundle header (key '') is missing")
        header = _proto_fields(table[0][1], f"{where}, header")
        self.num_shards = int(_field(header, 1, 1))
        if int(_field(header, 2)) != 0:
            raise CorruptCheckpointError(f"{where}: big-endian checkpoints are not supported")
        self.entries: dict[str, BundleEntry] = {}
        self._pieces: dict[tuple[str, tuple[tuple[int, int], ...]], BundleEntry] = {}
        for key, value in table[1:]:
            if key.startswith(b"\x00"):
                name, extents = _decode_slice_key(key, where)
                self._pieces[name, extents] = _parse_entry(f"{name} {list(extents)}", value, where)
            else:
                name = key.decode("utf-8")
                self.entries[name] = _parse_entry(name, value, where)
        for entry in [*self.entries.values(), *self._pieces.values()]:
            if not 0 <= entry.shard < self.num_shards:
                raise CorruptCheckpointError(f"{where}: entry {entry.name!r} names shard {entry.shard}")

    def data_file(self, shard: int) -> Path:
        return Path(f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}")

    def read(self, name: str) -> Tensor:
        """The tensor ``name`` as a CPU tensor, after checking its size and CRC32C.

        The tensor views the bytes read from the file (no second copy) and is
        read-only: copy it into a tensor of your own, do not modify it. A
        partitioned variable is assembled from its pieces.
        """
        entry = self._loadable(name)
        if entry.slices:
            return self._assemble(entry)
        return self._read_entry(entry)

    def verify(self, name: str) -> None:
        """Check that tensor ``name`` can be read: its size, its pieces, its bytes' CRC32C.

        Streams the bytes through the checksum a few MB at a time and keeps
        none of them, so checking a checkpoint costs no memory for its data.

        Raises:
            TypeError: the tensor's dtype has no torch dtype.
            CorruptCheckpointError: what ``read`` would raise.
        """
        entry = self._loadable(name)
        for piece in [p for _, p in self._pieces_of(entry)] if entry.slices else [entry]:
            self._check_size(piece)
            self._stream_crc(piece)

    def _loadable(self, name: str) -> BundleEntry:
        entry = self.entries[name]
        if entry.torch_dtype is None:
            raise TypeError(f"checkpoint tensor {name!r} has dtype {entry.dtype}, which has no torch dtype")
        return entry

    def _pieces_of(self, entry: BundleEntry) -> list[tuple[tuple[tuple[int, int], ...], BundleEntry]]:
        """A partitioned variable's pieces as (extents, entry), checked to exist and cover it."""
        pieces = []
        covered = 0
        for extents in entry.slices:
            # A piece's key writes a whole dim as (0, -1) where its slice leaves the length out.
            whole = tuple(
                (0, -1) if (s, n) == (0, d) else (s, n)
                for (s, n), d in zip(extents, entry.shape, strict=True)
            )
            piece = self._pieces.get((entry.name, extents)) or self._pieces.get((entry.name, whole))
            if piece is None:
                raise CorruptCheckpointError(
                    f"{self.prefix}: piece {list(extents)} of {entry.name!r} is missing"
                )
            if piece.shape != tuple(n for _, n in extents):
                raise CorruptCheckpointError(
                    f"{self.prefix}: piece {list(extents)} of {entry.name!r} has shape {list(piece.shape)}"
                )
            if any(s < 0 or s + n > d for (s, n), d in zip(extents, entry.shape, strict=True)):
                raise CorruptCheckpointError(
                    f"{self.prefix}: piece {list(extents)} of {entry.name!r} lies outside its shape "
                    f"{list(entry.shape)}"
                )
            pieces.append((extents, piece))
            covered += math.prod(piece.shape)
        # In bounds, disjoint and as many elements as the variable: every element once. (A count
        # alone passes a piece given twice for one left out, whose rows would stay uninitialised.)
        for i, (a, _) in enumerate(pieces):
            for b, _ in pieces[i + 1 :]:
                if all(sa < sb + nb and sb < sa + na for (sa, na), (sb, nb) in zip(a, b, strict=True)):
                    raise CorruptCheckpointError(
                        f"{self.prefix}: pieces {list(a)} and {list(b)} of {entry.name!r} overlap"
                    )
        if covered != math.prod(entry.shape):
            raise CorruptCheckpointError(f"{self.prefix}: the pieces of {entry.name!r} do not cover it")
        return pieces

    def _assemble(self, entry: BundleEntry) -> Tensor:
        out = torch.empty(entry.shape, dtype=entry.torch_dtype)
        for extents, piece in self._pieces_of(entry):
            out[tuple(slice(s, s + n) for s, n in extents)] = self._read_entry(piece)
        return out

    def _check_size(self, entry: BundleEntry) -> None:
        assert entry.torch_dtype is not None
        expected = entry.torch_dtype.itemsize * math.prod(entry.shape)
        if entry.size != expected:
            raise CorruptCheckpointError(
                f"{self.prefix}: entry {entry.name!r} holds {entry.size} bytes; shape {list(entry.shape)} of "
                f"{entry.dtype} needs {expected}"
            )

    def _data_fd(self, entry: BundleEntry) -> int:
        """The open data file that holds ``entry``, checked to be long enough.

        Each shard is opened once and kept open until :meth:`close`: the
        checks of a load and its copies then read the same file, even if a new
        checkpoint is renamed over the path in between.
        """
        path = self.data_file(entry.shard)
        fd = self._fds.get(entry.shard)
        if fd is None:
            try:
                fd = self._fds[entry.shard] = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{path}: missing; tensor {entry.name!r} is stored in it"
                ) from None
        if os.fstat(fd).st_size < entry.offset + entry.size:
            raise CorruptCheckpointError(f"{path}: truncated; tensor {entry.name!r} runs past its end")
        return fd

    def close(self) -> None:
        """Close the data files (reading again reopens them)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fds", None):
            self.close()

    def _chunks(self, entry: BundleEntry) -> Iterator[bytes]:
        """The entry's bytes, a few MB at a time."""
        fd = self._data_fd(entry)
        pos = 0
        while pos < entry.size:
            chunk = os.pread(fd, min(entry.size - pos, _CHUNK), entry.offset + pos)
            if not chunk:
                path = self.data_file(entry.shard)
                raise CorruptCheckpointError(f"{path}: truncated; tensor {entry.name!r} runs past its end")
            pos += len(chunk)
            yield chunk

    def _stream_crc(self, entry: BundleEntry) -> None:
        crc32c = _crc32c_module()
        crc = 0
        for chunk in self._chunks(entry):
            crc = crc32c.extend(crc, chunk)
        if _mask(crc) != entry.crc32c:
            path = self.data_file(entry.shard)
            raise CorruptCheckpointError(
                f"{path}: CRC32C mismatch in tensor {entry.name!r}; the file is corrupt"
            )

    def _read_entry(self, entry: BundleEntry) -> Tensor:
        assert entry.torch_dtype is not None
        self._check_size(entry)
        path = self.data_file(entry.shard)
        fd = self._data_fd(entry)
        if entry.size <= _MAX_PREAD:
            buffer = os.pread(fd, entry.size, entry.offset)
            crc = _masked_crc(buffer) if len(buffer) == entry.size else None
        else:  # one pread returns at most ~2 GiB: gather the pieces, checksum them as they come
            pieces = bytearray()
            crc32c, value = _crc32c_module(), 0
            for chunk in self._chunks(entry):
                pieces += chunk
                value = crc32c.extend(value, chunk)
            buffer, crc = pieces, _mask(value)
        if len(buffer) != entry.size:
            raise CorruptCheckpointError(f"{path}: truncated; tensor {entry.name!r} runs past its end")
        if crc != entry.crc32c:
            raise CorruptCheckpointError(
                f"{path}: CRC32C mismatch in tensor {entry.name!r}; the file is corrupt"
            )
        if not buffer:
            return torch.empty(entry.shape, dtype=entry.torch_dtype)
        with warnings.catch_warnings():
            # torch warns that ``bytes`` are not writable; the tensor is only ever copied from.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buffer, dtype=entry.torch_dtype).reshape(entry.shape)


def write_bundle(prefix: str | os.PathLike[str], tensors: dict[str, Tensor]) -> None:
    """Write ``tensors`` (name -> tensor) as a one-shard bundle ``<prefix>.index`` + ``.data-00000-of-00001``.

    Both files are written beside their final names and renamed into place,
    data first, so a new checkpoint's index never appears before its data; a
    failed write leaves nothing behind.
    """
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_ENUM:
            raise TypeError(f"cannot write tensor {name!r} of dtype {tensor.dtype} to a TF checkpoint")
    prefix = str(prefix)
    data_path = Path(f"{prefix}.data-00000-of-00001")
    index_path = Path(f"{prefix}.index")
    data_tmp = data_path.with_name(data_path.name + ".tmp")
    index_tmp = index_path.with_name(index_path.name + ".tmp")
    try:
        entries = _write_data(data_tmp, tensors)
        # BundleHeaderProto: num_shards = 1, endianness LITTLE (0, omitted), version { producer: 1 }.
        header = _varint_field(1, 1) + _length_delimited(3, _varint_field(1, 1))
        index_tmp.write_bytes(_build_table([(b"", header), *entries]))
        os.replace(data_tmp, data_path)
        os.replace(index_tmp, index_path)
    except BaseException:
        data_tmp.unlink(missing_ok=True)
        index_tmp.unlink(missing_ok=True)
        raise


def _write_data(path: Path, tensors: dict[str, Tensor]) -> list[tuple[bytes, bytes]]:
    """Write the tensors' bytes in key order; return their (key, BundleEntryProto) pairs."""
    entries: list[tuple[bytes, bytes]] = []
    offset = 0
    with open(path, "wb") as f:
        for name in sorted(tensors, key=lambda n: n.encode("utf-8")):
            tensor = tensors[name].detach().to("cpu").contiguous()
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
            f.write(raw)
            shape = b"".join(_length_delimited(2, _varint_field(1, d)) for d in tensor.shape)
            entry = (
                _varint_field(1, _DTYPE_ENUM[tensor.dtype])
                + _length_delimited(2, shape)
                + _varint_field(4, offset)
                + _varint_field(5, len(raw))
                + _encode_varint(6 << 3 | 5)
                + struct.pack("<I", _masked_crc(raw))
            )
            entries.append((name.encode("utf-8"), entry))
            offset += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return entries
