"""TensorFlow's tensor bundle (the format of ``tf.train.Saver`` and ``tf.train.Checkpoint``), without TF.

A checkpoint ``<prefix>`` is two kinds of file:

- ``<prefix>.index``: a LevelDB-style sorted table (TF's ``tensorflow/core/lib/io/table``).
  Its keys are the tensor names; the value under ``""`` is a ``BundleHeaderProto``
  (number of shards, endianness, version), every other value a ``BundleEntryProto``
  (dtype, shape, shard, offset, size, masked CRC32C of the bytes);
- ``<prefix>.data-NNNNN-of-MMMMM``: the tensors' raw little-endian bytes, back to back.

Only the few protobuf fields those two messages use are decoded, by hand. Every
block of the table and every tensor read is checked against its CRC32C.

The index is read as :mod:`._table` reads any table (nothing from a declared
length is trusted). Beyond that, each entry's fields must be in range (a
shape's dims and its element count within int64, a shard the header counts),
every tensor's bytes must lie apart from every other's (so reading them all
costs at most the data files' size), and only regular files are opened (a FIFO
planted at a checkpoint's path is refused, not read forever).

Writing never touches a file in place: every file is written under a fresh
temporary name (``O_EXCL | O_NOFOLLOW``: a symlink planted there is never
followed) in the checkpoint's directory, synced, and only then renamed over its
final name.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import secrets
import stat
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ._errors import CorruptCheckpointError
from ._table import (
    BUNDLE_ENTRY,
    BUNDLE_HEADER,
    INT32_MAX,
    INT64_MAX,
    TENSOR_SHAPE,
    TENSOR_SHAPE_DIM,
    TENSOR_SLICE,
    TENSOR_SLICE_EXTENT,
    build_table,
    crc32c_module,
    fixed32_field,
    integer,
    length_delimited,
    mask,
    masked_crc,
    message,
    proto_fields,
    read_table,
    varint_field,
)

__all__ = ["BundleEntry", "BundleReader", "CorruptCheckpointError", "write_bundle"]

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
    """A ``BundleEntryProto``; ``where`` names the index file and the entry."""
    fields = proto_fields(value, BUNDLE_ENTRY, where)
    enum = integer(fields, "dtype", where, INT32_MAX)
    shape = proto_fields(message(fields, "shape"), TENSOR_SHAPE, f"{where}, shape")
    if integer(shape, "unknown_rank", where, 1):
        raise CorruptCheckpointError(f"{where}: the shape has an unknown rank")
    dims = tuple(
        integer(
            proto_fields(bytes(d), TENSOR_SHAPE_DIM, f"{where}, shape"), "size", f"{where}, shape", INT64_MAX
        )
        for d in shape.get("dim", [])
    )
    # torch (as TF) counts a tensor's elements in an int64, zero-sized dims aside.
    if math.prod(d for d in dims if d) > INT64_MAX:
        raise CorruptCheckpointError(f"{where}: shape {list(dims)} has more elements than an int64 counts")
    dtype, torch_dtype = _DTYPES.get(enum, (f"dtype_enum_{enum}", None))
    slices = tuple(_parse_slice(bytes(proto), dims, f"{where}, slice") for proto in fields.get("slices", []))
    return BundleEntry(
        name=name,
        dtype=dtype,
        shape=dims,
        shard=integer(fields, "shard_id", where, INT32_MAX),
        offset=integer(fields, "offset", where, INT64_MAX),
        size=integer(fields, "size", where, INT64_MAX),
        crc32c=int(fields.get("crc32c", [0])[0]),
        torch_dtype=torch_dtype,
        slices=slices,
    )


def _parse_slice(proto: bytes, dims: tuple[int, ...], where: str) -> tuple[tuple[int, int], ...]:
    """A TensorSliceProto as (start, length) per dim; an extent without a length is the whole dim."""
    extents = proto_fields(proto, TENSOR_SLICE, where).get("extent", [])
    if len(extents) != len(dims):
        raise CorruptCheckpointError(f"{where}: {len(extents)} extents for a {len(dims)}-D tensor")
    out = []
    for extent, dim in zip(extents, dims, strict=True):
        fields = proto_fields(bytes(extent), TENSOR_SLICE_EXTENT, where)
        start = integer(fields, "start", where, INT64_MAX)
        out.append(
            (start, integer(fields, "length", where, INT64_MAX) if "length" in fields else dim - start)
        )
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


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file.

    Opened without blocking, then checked: a FIFO planted at a checkpoint's path
    would otherwise block the open until a writer came, and a directory fail
    only at the first read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a file"
            raise CorruptCheckpointError(f"{os.fspath(path)}: the {what} is {kind}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


class BundleReader:
    """The entries of a checkpoint's index, and its tensors read on demand (CRC-checked)."""

    def __init__(self, prefix: str | os.PathLike[str]):
        self._fds: dict[int, int] = {}
        self.prefix = str(prefix)
        where = f"{self.prefix}.index"
        with os.fdopen(open_regular(where, "checkpoint index"), "rb") as index:
            table = read_table(index, where)
        if not table or table[0][0] != b"":
            raise CorruptCheckpointError(f"{where}: the bundle header (key '') is missing")
        header = proto_fields(table[0][1], BUNDLE_HEADER, f"{where}, header")
        self.num_shards = integer(header, "num_shards", f"{where}, header", INT32_MAX, default=1)
        if integer(header, "endianness", f"{where}, header", INT32_MAX) != 0:
            raise CorruptCheckpointError(f"{where}: big-endian checkpoints are not supported")
        self.entries: dict[str, BundleEntry] = {}
        self._pieces: dict[tuple[str, tuple[tuple[int, int], ...]], BundleEntry] = {}
        for key, value in table[1:]:
            if key.startswith(b"\x00"):
                name, extents = _decode_slice_key(key, where)
                if (name, extents) in self._pieces:
                    raise CorruptCheckpointError(f"{where}: piece {list(extents)} of {name!r} appears twice")
                label = f"{name} {list(extents)}"
                self._pieces[name, extents] = _parse_entry(label, value, f"{where}, entry {label!r}")
            else:
                try:
                    name = key.decode("utf-8")
                except UnicodeDecodeError:
                    raise CorruptCheckpointError(f"{where}: entry name {key!r} is not UTF-8") from None
                self.entries[name] = _parse_entry(name, value, f"{where}, entry {name!r}")
        self._check_byte_ranges(where)

    def _check_byte_ranges(self, where: str) -> None:
        """Every entry in a shard the header counts, its bytes apart from every other entry's.

        TF writes each tensor once, so reading every tensor of a checkpoint never
        holds more than its data files, whatever its index says.
        """
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for entry in [*self.entries.values(), *self._pieces.values()]:
            if not 0 <= entry.shard < self.num_shards:
                raise CorruptCheckpointError(f"{where}: entry {entry.name!r} names shard {entry.shard}")
            if entry.size:
                spans.setdefault(entry.shard, []).append(
                    (entry.offset, entry.offset + entry.size, entry.name)
                )
        for shard, ranges in spans.items():
            ranges.sort()
            for (_, end, a), (start, _, b) in itertools.pairwise(ranges):
                if start < end:
                    raise CorruptCheckpointError(
                        f"{where}: entries {a!r} and {b!r} share bytes of {self.data_file(shard).name}"
                    )

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
        none of them, so checking a checkpoint costs no memory for its data
        (a partitioned variable's check holds one flag per element a moment).

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
        """A partitioned variable's pieces as (extents, entry), checked to exist, to lie in the
        data files and to cover it, each element once."""
        pieces = []
        held = 0
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
            if piece.dtype != entry.dtype:
                raise CorruptCheckpointError(
                    f"{self.prefix}: piece {list(extents)} of {entry.name!r} is {piece.dtype}, "
                    f"the variable {entry.dtype}"
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
            self._check_size(piece)
            self._data_fd(piece)  # its bytes are in the file: the pieces hold at most the files
            pieces.append((extents, piece))
            held += math.prod(piece.shape)
        # In bounds, as many elements as the variable and none left out: every element once. (A
        # count alone passes a piece given twice for one left out, whose rows would stay
        # uninitialised.) One flag per element, at most the pieces' bytes: exact in any number
        # of dims, and linear where comparing pieces pairwise took 71 s for 4000 of them.
        if held != math.prod(entry.shape):
            raise CorruptCheckpointError(f"{self.prefix}: the pieces of {entry.name!r} do not cover it")
        if held:
            covered = torch.zeros(entry.shape, dtype=torch.bool)
            for extents, _ in pieces:
                covered[tuple(slice(s, s + n) for s, n in extents)] = True
            if not covered.all():
                missing = (~covered).nonzero()[0].tolist()
                raise CorruptCheckpointError(
                    f"{self.prefix}: pieces of {entry.name!r} overlap: they hold as many elements as "
                    f"it, yet none holds element {missing}"
                )
        return pieces

    def _assemble(self, entry: BundleEntry) -> Tensor:
        pieces = self._pieces_of(entry)  # (checked against the files before the whole is allocated)
        out = torch.empty(entry.shape, dtype=entry.torch_dtype)
        for extents, piece in pieces:
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
        fd = self._fds.get(entry.shard)
        if fd is None:
            path = self.data_file(entry.shard)
            try:
                fd = self._fds[entry.shard] = open_regular(path, "checkpoint data file")
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{path}: missing; tensor {entry.name!r} is stored in it"
                ) from None
        if os.fstat(fd).st_size < entry.offset + entry.size:
            path = self.data_file(entry.shard)
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
        crc32c = crc32c_module()
        crc = 0
        for chunk in self._chunks(entry):
            crc = crc32c.extend(crc, chunk)
        if mask(crc) != entry.crc32c:
            path = self.data_file(entry.shard)
            raise CorruptCheckpointError(
                f"{path}: CRC32C mismatch in tensor {entry.name!r}; the file is corrupt"
            )

    def _read_entry(self, entry: BundleEntry) -> Tensor:
        assert entry.torch_dtype is not None
        self._check_size(entry)
        fd = self._data_fd(entry)
        if entry.size <= _MAX_PREAD:
            buffer = os.pread(fd, entry.size, entry.offset)
            crc = masked_crc(buffer) if len(buffer) == entry.size else None
        else:  # one pread returns at most ~2 GiB: gather the pieces, checksum them as they come
            pieces = bytearray()
            crc32c, value = crc32c_module(), 0
            for chunk in self._chunks(entry):
                pieces += chunk
                value = crc32c.extend(value, chunk)
            buffer, crc = pieces, mask(value)
        if len(buffer) != entry.size:
            path = self.data_file(entry.shard)
            raise CorruptCheckpointError(f"{path}: truncated; tensor {entry.name!r} runs past its end")
        if crc != entry.crc32c:
            path = self.data_file(entry.shard)
            raise CorruptCheckpointError(
                f"{path}: CRC32C mismatch in tensor {entry.name!r}; the file is corrupt"
            )
        if not buffer:
            return torch.empty(entry.shape, dtype=entry.torch_dtype)
        with warnings.catch_warnings():
            # torch warns that ``bytes`` are not writable; the tensor is only ever copied from.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buffer, dtype=entry.torch_dtype).reshape(entry.shape)


def check_writable(name: str, tensor: Tensor) -> None:
    """Refuse, naming it, a tensor a TF checkpoint cannot hold or this package could not read back."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a TF checkpoint names each tensor with a non-empty str, got {name!r}")
    if "\x00" in name:
        raise ValueError(f"cannot write tensor {name!r}: a TF name holds no NUL character")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"cannot write tensor {name!r}: its name is not valid Unicode") from None
    if not isinstance(tensor, Tensor):
        raise TypeError(f"cannot write tensor {name!r}: it is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.is_meta:
        raise ValueError(f"cannot write tensor {name!r}: it is on the meta device, which holds no values")
    if tensor.layout != torch.strided or tensor.is_nested:
        layout = "nested" if tensor.is_nested else str(tensor.layout)
        raise ValueError(
            f"cannot write tensor {name!r}: its layout is {layout}; a TF checkpoint holds dense "
            "tensors (save tensor.to_dense())"
        )
    if tensor.dtype not in _DTYPE_ENUM:
        raise TypeError(f"cannot write tensor {name!r} of dtype {tensor.dtype} to a TF checkpoint")


def write_bundle(
    prefix: str | os.PathLike[str], tensors: dict[str, Tensor], also: Mapping[Path, bytes] | None = None
) -> None:
    """Write ``tensors`` (name -> tensor) as a one-shard bundle ``<prefix>.index`` + ``.data-00000-of-00001``.

    ``also``: more files (path -> contents) to put in place with it, after its
    index (the directory's ``checkpoint`` state file).

    Every file is written and synced under a fresh temporary name beside its
    final one first; then they are renamed into place, data first, so a new
    checkpoint's index never appears before its data. A failure before the
    renames leaves nothing behind; one during them removes again the files it
    had put where there were none (a file it replaced stays replaced).
    """
    for name, tensor in tensors.items():
        check_writable(name, tensor)
    prefix = str(prefix)
    data_path = Path(f"{prefix}.data-00000-of-00001")
    index_path = Path(f"{prefix}.index")
    existed = {path: _replaceable(path) for path in [data_path, index_path, *(also or {})]}
    temporaries: dict[Path, Path] = {}
    renamed: list[Path] = []
    try:
        fd, temporaries[data_path] = _create_temporary(data_path)
        entries = _write_data(fd, data_path, tensors)
        # BundleHeaderProto: num_shards = 1, endianness LITTLE (0, omitted), version { producer: 1 }.
        header = varint_field(1, 1) + length_delimited(3, varint_field(1, 1))
        _write_file(index_path, build_table([(b"", header), *entries]), temporaries)
        for path, contents in (also or {}).items():
            _write_file(path, contents, temporaries)
        for final, temporary in temporaries.items():
            os.replace(temporary, final)
            renamed.append(final)
    except BaseException:
        for final, temporary in temporaries.items():
            if final not in renamed:
                temporary.unlink(missing_ok=True)
        for final in renamed:
            if not existed[final]:
                final.unlink(missing_ok=True)
        raise


def _replaceable(path: Path) -> bool:
    """Whether ``path`` exists (a file or a symlink, which a rename replaces); anything else is refused."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise ValueError(f"{path} exists and is not a file: a checkpoint cannot be written over it")
    return True


def _create_temporary(final: Path) -> tuple[int, Path]:
    """A new file beside ``final``, open for writing: created, never opened through a planted symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        temporary = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {final}")


def _write_file(final: Path, contents: bytes, temporaries: dict[Path, Path]) -> None:
    fd, temporaries[final] = _create_temporary(final)
    with _naming(final), os.fdopen(fd, "wb") as f:
        f.write(contents)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _naming(final: Path) -> Iterator[None]:
    """Name ``final`` in an OSError of writing it (a full disk's names no file)."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = str(final)
        raise


def _write_data(fd: int, path: Path, tensors: dict[str, Tensor]) -> list[tuple[bytes, bytes]]:
    """Write the tensors' bytes in key order to ``fd`` (the file ``path`` will be); return their
    (key, BundleEntryProto) pairs."""
    entries: list[tuple[bytes, bytes]] = []
    offset = 0
    with _naming(path), os.fdopen(fd, "wb") as f:
        for name in sorted(tensors, key=lambda n: n.encode("utf-8")):
            tensor = tensors[name].detach().to("cpu").contiguous()
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
            f.write(raw)
            shape = b"".join(length_delimited(2, varint_field(1, d)) for d in tensor.shape)
            entry = (
                varint_field(1, _DTYPE_ENUM[tensor.dtype])
                + length_delimited(2, shape)
                + varint_field(4, offset)
                + varint_field(5, len(raw))
                + fixed32_field(6, masked_crc(raw))
            )
            entries.append((name.encode("utf-8"), entry))
            offset += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return entries
