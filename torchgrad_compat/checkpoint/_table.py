"""The two encodings under a checkpoint's index: protobuf messages and a LevelDB-style sorted table.

Both come from files other people write, so nothing is taken on trust: a
field's wire type must be the one its schema gives, a length is checked
against the bytes that remain before anything is sliced, the table's blocks
are read one at a time (``seek``/``read`` of sizes checked against the file's
size, never the whole file), each block handle must lie inside the file and
apart from the others, and the keys must be strictly increasing, as in every
table TensorFlow writes.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

from ._errors import CorruptCheckpointError

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48  # two block handles padded to 40 bytes, then the 8-byte magic
BLOCK_TRAILER_SIZE = 5  # compression type byte + masked CRC32C
_MASK_DELTA = 0xA282EAD8
_RESTART_INTERVAL = 16  # LevelDB's and TF's table builders restart key sharing every 16 keys
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_WIRE_NAMES = {
    _VARINT: "varint",
    _FIXED64: "fixed64",
    _LENGTH_DELIMITED: "length-delimited",
    _FIXED32: "fixed32",
}
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# The fields of the messages read here: number -> (name, wire type, repeated). Fields not
# listed are skipped, as every protobuf parser does; a listed one of another wire type is an error.
Schema = dict[int, tuple[str, int, bool]]
BUNDLE_HEADER: Schema = {
    1: ("num_shards", _VARINT, False),
    2: ("endianness", _VARINT, False),
    3: ("version", _LENGTH_DELIMITED, False),
}
BUNDLE_ENTRY: Schema = {
    1: ("dtype", _VARINT, False),
    2: ("shape", _LENGTH_DELIMITED, False),
    3: ("shard_id", _VARINT, False),
    4: ("offset", _VARINT, False),
    5: ("size", _VARINT, False),
    6: ("crc32c", _FIXED32, False),
    7: ("slices", _LENGTH_DELIMITED, True),
}
TENSOR_SHAPE: Schema = {2: ("dim", _LENGTH_DELIMITED, True), 3: ("unknown_rank", _VARINT, False)}
TENSOR_SHAPE_DIM: Schema = {1: ("size", _VARINT, False), 2: ("name", _LENGTH_DELIMITED, False)}
TENSOR_SLICE: Schema = {1: ("extent", _LENGTH_DELIMITED, True)}
TENSOR_SLICE_EXTENT: Schema = {1: ("start", _VARINT, False), 2: ("length", _VARINT, False)}


def crc32c_module():
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


def mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc(data: bytes | memoryview) -> int:
    return mask(crc32c_module().value(data))


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
            if result >> 64:
                raise CorruptCheckpointError(f"{where}: varint wider than 64 bits")
            return result, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def proto_fields(buf: bytes, schema: Schema, where: str) -> dict[str, list[int | bytes]]:
    """The ``schema`` fields of a protobuf message, by name: varint and fixed values as ints,
    length-delimited ones as bytes.

    Raises CorruptCheckpointError naming the field when its wire type is not the schema's,
    a singular field is given twice, or a length runs past the message.
    """
    fields: dict[str, list[int | bytes]] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == _VARINT:
            value, pos = _varint(buf, pos, where)
        elif wire in (_FIXED64, _FIXED32):
            width = 8 if wire == _FIXED64 else 4
            if pos + width > len(buf):
                raise CorruptCheckpointError(f"{where}: field {number} runs past the end of the message")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        elif wire == _LENGTH_DELIMITED:
            length, pos = _varint(buf, pos, where)
            if length > len(buf) - pos:
                label = repr(schema[number][0]) if number in schema else number
                raise CorruptCheckpointError(
                    f"{where}: field {label} declares {length} bytes, {len(buf) - pos} remain in the message"
                )
            value, pos = buf[pos : pos + length], pos + length
        else:
            raise CorruptCheckpointError(f"{where}: unsupported protobuf wire type {wire} (field {number})")
        if number not in schema:
            continue
        name, expected, repeated = schema[number]
        if wire != expected:
            raise CorruptCheckpointError(
                f"{where}: field {name!r} is {_WIRE_NAMES[wire]}, its type is {_WIRE_NAMES[expected]}"
            )
        if name in fields and not repeated:
            raise CorruptCheckpointError(f"{where}: field {name!r} is given twice")
        fields.setdefault(name, []).append(value)
    return fields


def integer(
    fields: dict[str, list[int | bytes]], name: str, where: str, maximum: int, default: int = 0
) -> int:
    """The singular integer field ``name``, checked to lie in ``[0, maximum]``.

    (A negative int64 or int32 is a varint of 2**63 or more.)
    """
    value = int(fields.get(name, [default])[0])
    if value > maximum:
        shown = value - 2**64 if value >= 2**63 else value
        raise CorruptCheckpointError(f"{where}: field {name!r} is {shown}, out of range [0, {maximum}]")
    return value


def message(fields: dict[str, list[int | bytes]], name: str) -> bytes:
    """The singular message field ``name`` (empty when absent)."""
    return bytes(fields.get(name, [b""])[0])


def length_delimited(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | _LENGTH_DELIMITED) + encode_varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    return encode_varint(number << 3) + encode_varint(value) if value else b""


def fixed32_field(number: int, value: int) -> bytes:
    return encode_varint(number << 3 | _FIXED32) + struct.pack("<I", value)


# ---------------------------------------------------------------------- the table
def _read_at(file: BinaryIO, offset: int, size: int, where: str) -> bytes:
    file.seek(offset)
    data = file.read(size)
    if len(data) != size:
        raise CorruptCheckpointError(f"{where}: truncated; {size} bytes at offset {offset} could not be read")
    return data


def _read_block(file: BinaryIO, handle: tuple[int, int], where: str) -> bytes:
    """A block's contents, CRC-checked; its handle has been checked to lie inside the file."""
    offset, size = handle
    stored = _read_at(file, offset, size + BLOCK_TRAILER_SIZE, where)
    contents, kind = stored[:size], stored[size]
    if masked_crc(stored[: size + 1]) != struct.unpack_from("<I", stored, size + 1)[0]:
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
    key_bytes = 0
    while pos < end:
        shared, pos = _varint(block, pos, where)
        non_shared, pos = _varint(block, pos, where)
        value_length, pos = _varint(block, pos, where)
        if shared > len(key) or non_shared + value_length > end - pos:
            raise CorruptCheckpointError(f"{where}: malformed table block entry")
        # Each key may share all of the one before: unchecked, a block of n one-byte suffixes
        # decodes to n**2 / 2 bytes (31 GB from 1 MB). TF restarts the sharing every
        # _RESTART_INTERVAL keys, so its keys decode to at most that many times the block.
        key_bytes += shared + non_shared
        if key_bytes > _RESTART_INTERVAL * len(block):
            raise CorruptCheckpointError(
                f"{where}: the keys of a {len(block)}-byte table block decode to more than "
                f"{_RESTART_INTERVAL} times its size"
            )
        key = key[:shared] + block[pos : pos + non_shared]
        pos += non_shared
        entries.append((key, block[pos : pos + value_length]))
        pos += value_length
    return entries


def _handle(encoded: bytes, where: str) -> tuple[int, int]:
    offset, pos = _varint(encoded, 0, where)
    size, _ = _varint(encoded, pos, where)
    return offset, size


def read_table(file: BinaryIO, where: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a LevelDB-style table, in order.

    Only the footer and the blocks it names are read. ``file`` is a seekable
    binary file (``where`` names it in errors).
    """
    file_size = file.seek(0, 2)
    if file_size < FOOTER_SIZE:
        raise CorruptCheckpointError(f"{where}: {file_size} bytes, too short for a table")
    end_of_blocks = file_size - FOOTER_SIZE
    footer = _read_at(file, end_of_blocks, FOOTER_SIZE, where)
    (magic,) = struct.unpack_from("<Q", footer, 40)
    if magic != TABLE_MAGIC:
        raise CorruptCheckpointError(f"{where}: not a TensorFlow checkpoint index (bad magic number)")
    _, pos = _varint(footer, 0, where)  # the meta index block: empty in a bundle, never read
    _, pos = _varint(footer, pos, where)
    index_offset, pos = _varint(footer, pos, where)
    index_size, _ = _varint(footer, pos, where)
    handles = [(index_offset, index_size)]
    separators = []
    _check_handles(handles, end_of_blocks, where)
    for separator, encoded in _block_entries(_read_block(file, handles[0], where), where):
        separators.append(separator)
        handles.append(_handle(encoded, where))
    # Before any data block is read: each lies inside the file and apart from every other, so
    # no block is parsed twice and the blocks read add up to at most the file.
    _check_handles(handles, end_of_blocks, where)
    entries: list[tuple[bytes, bytes]] = []
    for i, (separator, handle) in enumerate(zip(separators, handles[1:], strict=True)):
        if i and separator <= separators[i - 1]:
            raise CorruptCheckpointError(f"{where}: the table's index keys are not increasing")
        block = _block_entries(_read_block(file, handle, where), where)
        for key, value in block:
            if entries and key <= entries[-1][0]:
                kind = "twice" if key == entries[-1][0] else f"after {entries[-1][0]!r}, out of order"
                raise CorruptCheckpointError(f"{where}: key {key!r} appears {kind}; table keys are sorted")
            if key > separator:
                raise CorruptCheckpointError(
                    f"{where}: key {key!r} lies past its block's index key {separator!r}"
                )
            if i and key <= separators[i - 1]:
                raise CorruptCheckpointError(
                    f"{where}: key {key!r} lies before its block's index key {separators[i - 1]!r}"
                )
            entries.append((key, value))
    return entries


def _check_handles(handles: list[tuple[int, int]], end_of_blocks: int, where: str) -> None:
    previous_end, previous = 0, None
    for offset, size in sorted(handles):
        end = offset + size + BLOCK_TRAILER_SIZE
        if end > end_of_blocks:
            raise CorruptCheckpointError(
                f"{where}: block at {offset} (+{size}) runs past the blocks' end at {end_of_blocks}"
            )
        if previous is not None and offset < previous_end:
            raise CorruptCheckpointError(
                f"{where}: table blocks at {previous[0]} (+{previous[1]}) and {offset} (+{size}) overlap"
            )
        previous_end, previous = end, (offset, size)


def build_block(entries: list[tuple[bytes, bytes]]) -> bytes:
    # A restart point at every entry (no key sharing): larger than TF's own
    # tables, and just as valid for its reader.
    body = bytearray()
    restarts = []
    for key, value in entries:
        restarts.append(len(body))
        body += encode_varint(0) + encode_varint(len(key)) + encode_varint(len(value)) + key + value
    if not restarts:
        restarts = [0]
    body += b"".join(struct.pack("<I", r) for r in restarts) + struct.pack("<I", len(restarts))
    return bytes(body)


def append_block(out: bytearray, block: bytes) -> bytes:
    """Append a block and its trailer; return its encoded handle."""
    handle = encode_varint(len(out)) + encode_varint(len(block))
    out += block + b"\x00" + struct.pack("<I", masked_crc(block + b"\x00"))
    return handle


def build_table(entries: list[tuple[bytes, bytes]]) -> bytes:
    out = bytearray()
    data_handle = append_block(out, build_block(entries))
    meta_handle = append_block(out, build_block([]))
    index_handle = append_block(out, build_block([(entries[-1][0], data_handle)]))
    footer = (meta_handle + index_handle).ljust(40, b"\x00") + struct.pack("<Q", TABLE_MAGIC)
    return bytes(out + footer)
