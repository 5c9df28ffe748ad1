"""The TF checkpoint families of ``fault_cases.py`` (run that script; this module only builds cases).

Every crafted file starts from a checkpoint the package saved, rewritten with
the package's own table and protobuf encoders (which write whatever they are
given): index entries with fields of the wrong wire type or out of range, keys
twice or out of order, block handles repeated or past the end, FIFOs and
directories at a file's path, bad state files; saves beside planted symlinks,
with a full disk, of names and prefixes that could not be read back.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import torchgrad_compat.optim as optim
from torchgrad_compat.checkpoint import _table as table
from torchgrad_compat.checkpoint import load_tf_checkpoint, save_tf_checkpoint
from torchgrad_compat.checkpoint._bundle import BundleReader, write_bundle

_SCRATCH: list[Path] = []  # where the cases craft their files (checkpoint_cases sets it)
_PREFIX = "model.ckpt-1"
_INDEX, _DATA = f"{_PREFIX}.index", f"{_PREFIX}.data-00000-of-00001"


def _saved() -> tuple[Path, Path, list[Tensor], torch.optim.Optimizer]:
    """A fresh checkpoint the package saved (``w`` [3], ``b`` [2], Adam), and a stepped model to load into."""
    folder = Path(tempfile.mkdtemp(dir=_SCRATCH[0] if _SCRATCH else None))
    w, b = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0])), torch.nn.Parameter(torch.tensor([0.5, 0.25]))
    adam = optim.AdamOptimizer([w, b], learning_rate=0.1)
    w.grad, b.grad = torch.ones(3), torch.ones(2)
    adam.step()
    save_tf_checkpoint(folder / _PREFIX, {"w": w, "b": b}, adam, global_step=1)
    return folder, folder / _PREFIX, [w, b], adam


def _entry(
    dtype: int | bytes = 1, shape: int | bytes = b"", offset: int = 0, size: int = 0, crc: Any = 0
) -> bytes:
    """A BundleEntryProto; an int given for a message is written as a varint, bytes for an int as bytes."""

    def field(number: int, value: int | bytes) -> bytes:
        if isinstance(value, bytes):
            return table.length_delimited(number, value)
        return table.encode_varint(number << 3) + table.encode_varint(value)

    crc_field = field(6, crc) if isinstance(crc, bytes) else table.fixed32_field(6, crc)
    return field(1, dtype) + field(2, shape) + field(4, offset) + field(5, size) + crc_field


def _shape(*dims: int) -> bytes:
    return b"".join(table.length_delimited(2, table.varint_field(1, d)) for d in dims)


def _reindex(prefix: Path, edit: Callable[[list[tuple[bytes, bytes]]], list[tuple[bytes, bytes]]]) -> None:
    with open(f"{prefix}.index", "rb") as index:
        entries = table.read_table(index, "fault_cases")
    Path(f"{prefix}.index").write_bytes(table.build_table(edit(entries)))


def _replace_entry(prefix: Path, name: bytes, make: Callable[[Any], bytes]) -> None:
    value = make(BundleReader(prefix).entries.get(name.decode("utf-8", "replace")))
    _reindex(prefix, lambda entries: sorted({**dict(entries), name: value}.items()))


def _w(make: Callable[[Any], bytes]) -> Callable[[Path], None]:
    return lambda prefix: _replace_entry(prefix, b"w", make)


def _repeated_handles(prefix: Path) -> None:
    """An index block that names one 2000-entry data block 200 times."""
    with open(f"{prefix}.index", "rb") as index:
        entries = table.read_table(index, "fault_cases")
    out = bytearray()
    many = [entries[0]] + [(b"k%05d" % i, dict(entries)[b"w"]) for i in range(2000)]
    data = table.append_block(out, table.build_block(many))
    meta = table.append_block(out, table.build_block([]))
    index = table.append_block(out, table.build_block([(b"k01999" + b"~" * i, data) for i in range(200)]))
    footer = (meta + index).ljust(40, b"\x00") + table.TABLE_MAGIC.to_bytes(8, "little")
    Path(f"{prefix}.index").write_bytes(bytes(out) + footer)


def _ever_longer_keys(prefix: Path) -> None:
    """One data block of 20,000 keys, each sharing all of the one before plus a byte: 100 KB that
    decode to 200 MB of keys."""
    with open(f"{prefix}.index", "rb") as index:
        header = table.read_table(index, "fault_cases")[0][1]
    body = bytearray(table.encode_varint(0) * 2 + table.encode_varint(len(header)) + header)
    for i in range(20000):
        body += table.encode_varint(i) + b"\x01\x00a"
    out = bytearray()
    data = table.append_block(out, bytes(body) + (0).to_bytes(4, "little") + (1).to_bytes(4, "little"))
    meta = table.append_block(out, table.build_block([]))
    index = table.append_block(out, table.build_block([(b"a" * 20000, data)]))
    footer = (meta + index).ljust(40, b"\x00") + table.TABLE_MAGIC.to_bytes(8, "little")
    Path(f"{prefix}.index").write_bytes(bytes(out) + footer)


def _patch(path_of: Callable[[Path], Path], offset: int, data: bytes) -> Callable[[Path], None]:
    def patch(prefix: Path) -> None:
        path = path_of(prefix)
        raw = bytearray(path.read_bytes())
        raw[offset : offset + len(data) or None] = data
        path.write_bytes(bytes(raw))

    return patch


def _sparse_index(prefix: Path) -> None:
    """The index as a 1 GiB file: its blocks, a hole, its footer; and tensor ``w``'s bytes flipped."""
    raw = Path(f"{prefix}.index").read_bytes()
    with open(f"{prefix}.index", "wb") as index:
        index.write(raw[:-48])
        index.seek((1 << 30) - 48)
        index.write(raw[-48:])
    _patch(lambda p: Path(f"{p}.data-00000-of-00001"), BundleReader(prefix).entries["w"].offset, b"\xff")(
        prefix
    )


def _replace_path(suffix: str, kind: str) -> Callable[[Path], None]:
    def replace(prefix: Path) -> None:
        path = Path(f"{prefix}{suffix}")
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.mkdir()

    return replace


def _pieces_overlapping(prefix: Path) -> None:
    """``v`` [4000] in 3999 pieces as TF keys them, all of one element but the last, which overlaps
    the one before and covers as many elements as the one left out (a count alone passes it)."""

    def signed(value: int) -> bytes:  # OrderedCode's signed number, for |value| < 2**13
        length = 1 if -64 <= value < 64 else 2
        raw = bytearray(value.to_bytes(length, "big", signed=True))
        raw[0] ^= ((0xFFFF << (16 - length)) & 0xFFFF) >> 8
        return bytes(raw)

    tensors = {f"p{i:05d}": torch.tensor([float(i)]) for i in range(3998)}
    write_bundle(str(prefix), {**tensors, "q": torch.tensor([3997.0, 3998.0])})
    reader = BundleReader(prefix)
    extents = [(i, 1) for i in range(3998)] + [(3997, 2)]  # 4000 elements, element 3999 left out
    entries = [(b"", table.varint_field(1, 1))]
    for start, length in extents:
        key = b"\x00v\x00\x01\x01\x01" + signed(start) + signed(length)
        e = reader.entries[f"p{start:05d}" if length == 1 else "q"]
        entries.append((key, _entry(1, _shape(length), e.offset, e.size, e.crc32c)))
    slices = b"".join(
        table.length_delimited(
            7,
            table.length_delimited(
                1, table.varint_field(1, s) + table.encode_varint(2 << 3) + table.encode_varint(n)
            ),
        )
        for s, n in extents
    )
    entries.append((b"v", _entry(1, _shape(4000)) + slices))
    Path(f"{prefix}.index").write_bytes(table.build_table(sorted(entries)))


_READER_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "shape as a varint of 2**40": (
        _w(lambda e: _entry(1, 2**40, e.offset, e.size, e.crc32c)),
        ("'w'", "shape"),
    ),
    "shape as a varint of 2**24": (
        _w(lambda e: _entry(1, 2**24, e.offset, e.size, e.crc32c)),
        ("'w'", "shape"),
    ),
    "shape as a varint of 1000": (
        _w(lambda e: _entry(1, 1000, e.offset, e.size, e.crc32c)),
        ("'w'", "shape"),
    ),
    "a dim as a varint": (
        _w(lambda e: _entry(1, table.varint_field(2, 3), e.offset, e.size, e.crc32c)),
        ("'w'", "dim"),
    ),
    "a slice as a varint": (
        _w(lambda e: _entry(1, _shape(3), e.offset, e.size, e.crc32c) + table.varint_field(7, 1)),
        ("'w'", "slices"),
    ),
    "dtype as the bytes b'9'": (
        _w(lambda e: _entry(b"9", _shape(3), e.offset, e.size, e.crc32c)),
        ("'w'", "dtype"),
    ),
    "dtype as the bytes b'abc'": (
        _w(lambda e: _entry(b"abc", _shape(3), e.offset, e.size, e.crc32c)),
        ("'w'", "dtype"),
    ),
    "crc32c as bytes": (_w(lambda e: _entry(1, _shape(3), e.offset, e.size, b"abcd")), ("'w'", "crc32c")),
    "a declared length of 2**40": (
        _w(lambda e: table.varint_field(1, 1) + table.encode_varint(2 << 3 | 2) + table.encode_varint(2**40)),
        ("'w'", "declares"),
    ),
    "a field given twice": (
        _w(lambda e: _entry(1, _shape(3), e.offset, e.size, e.crc32c) + table.varint_field(5, 12)),
        ("'w'", "'size'"),
    ),
    "wire type 3 (a group)": (
        _w(lambda e: _entry(1, _shape(3), e.offset, e.size, e.crc32c) + b"\x4b"),
        ("'w'", "wire type 3"),
    ),
    "a dim of 2**64 - 1 (-1)": (
        _w(lambda e: _entry(1, _shape(2**64 - 1), e.offset, e.size, e.crc32c)),
        ("'w'", "-1"),
    ),
    "shape [2**62, 2**62, 0]": (
        _w(lambda e: _entry(1, _shape(2**62, 2**62, 0), e.offset, e.size, e.crc32c)),
        ("'w'", "int64"),
    ),
    "offset of 2**64 - 1 (-1)": (
        _w(lambda e: _entry(1, _shape(3), 2**64 - 1, e.size, e.crc32c)),
        ("'w'", "offset"),
    ),
    "size of 2**63": (_w(lambda e: _entry(1, _shape(3), e.offset, 2**63, e.crc32c)), ("'w'", "size")),
    "shard 5 of 1": (
        _w(lambda e: _entry(1, _shape(3), e.offset, e.size, e.crc32c) + table.varint_field(3, 5)),
        ("'w'", "shard"),
    ),
    "key 'w' twice (both CRC-valid)": (
        lambda p: _reindex(p, lambda es: sorted([*es, (b"w", dict(es)[b"b"])])),
        ("index", "b'w'"),
    ),
    "keys out of order": (
        lambda p: _reindex(p, lambda es: [es[0], es[2], es[1], *es[3:]]),
        ("index", "out of order"),
    ),
    "one 2000-entry block named 200 times": (_repeated_handles, ("index", "overlap")),
    "20,000 keys, each sharing all of the one before": (_ever_longer_keys, ("index", "16 times")),
    "a block handle past the end": (
        _patch(lambda p: Path(f"{p}.index"), -48, bytes([0, 0]) + table.encode_varint(10**6) + bytes([10])),
        ("index", "runs past"),
    ),
    "bad magic number": (_patch(lambda p: Path(f"{p}.index"), -1, b"\x00"), ("index", "magic")),
    "index cut to 40 bytes": (
        lambda p: Path(f"{p}.index").write_bytes(Path(f"{p}.index").read_bytes()[:40]),
        ("index", "too short"),
    ),
    "a key that is not UTF-8": (
        lambda p: _replace_entry(p, b"w\xff", lambda e: _entry(1, _shape(0))),
        ("index", "not UTF-8"),
    ),
    "two entries sharing bytes": (
        lambda p: _replace_entry(
            p, b"w", lambda e: _entry(1, _shape(2), BundleReader(p).entries["b"].offset, 8, 0)
        ),
        ("index", "share bytes"),
    ),
    "a FIFO at the data file": (_replace_path(".data-00000-of-00001", "fifo"), (_DATA, "FIFO")),
    "a directory at the data file": (_replace_path(".data-00000-of-00001", "dir"), (_DATA, "directory")),
    "a FIFO at the index": (_replace_path(".index", "fifo"), (_INDEX, "FIFO")),
    "a directory at the index": (_replace_path(".index", "dir"), (_INDEX, "directory")),
    "a 1 GiB sparse index, a tensor's bytes flipped": (_sparse_index, (_DATA, "'w'")),
    "3999 pieces, the last two overlapping": (_pieces_overlapping, ("'v'", "overlap")),
}
_STATE_CASES: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "invalid escape \\x": (b'model_checkpoint_path: "model.ckpt-1\\x"\n', ("line 1", "escape")),
    "invalid escape \\q": (b'model_checkpoint_path: "model.ckpt-1\\q"\n', ("line 1", "escape")),
    "not UTF-8": (b'model_checkpoint_path: "mod\xe8le"\n', ("UTF-8",)),
    "a path that is not UTF-8 (octal)": (b'model_checkpoint_path: "mod\\350le"\n', ("line 1", "UTF-8")),
    "an unknown field": (b'model_checkpoint_path: "a"\nnot_a_field: "b"\n', ("line 2", "not_a_field")),
    "an unterminated string": (b'model_checkpoint_path: "model.ckpt-1\n', ("line 1", "quoted string")),
    "a FIFO": (b"", ("checkpoint", "FIFO")),
}


def _state(contents: bytes) -> Callable[[Path], None]:
    def write(prefix: Path) -> None:
        state = prefix.parent / "checkpoint"
        state.unlink()
        state.write_bytes(contents) if contents else os.mkfifo(state)

    return write


def checkpoint_cases(case: Callable[..., Any], scratch: Path) -> list[Any]:
    """The checkpoint cases, made by ``case`` (fault_cases' Case), crafting their files under ``scratch``."""
    _SCRATCH[:] = [scratch]
    return _checkpoint_reader_cases(case) + _checkpoint_writer_cases(case)


def _checkpoint_reader_cases(Case: Callable[..., Any]) -> list[Any]:
    cases = []
    crafted = {
        **_READER_CASES,
        **{f"state file: {k}": (_state(v), ("checkpoint", *words)) for k, (v, words) in _STATE_CASES.items()},
    }
    for label, (craft, names) in crafted.items():

        def build(craft=craft, label=label):
            folder, prefix, params, adam = _saved()
            craft(prefix)
            target = folder if label.startswith("state file") else prefix
            var_map = {"v": torch.zeros(4000)} if "pieces" in label else {"w": params[0], "b": params[1]}
            return (folder, params, adam, var_map), lambda: load_tf_checkpoint(target, var_map, adam)

        section = "checkpoint state file" if label.startswith("state file") else "checkpoint reader"
        cases.append(Case(section, label, build, names, any_name=False, traced=True))
    return cases


def _planted_symlink(name: str):
    def build():
        folder = _saved()[0]
        victim = folder.parent / f"{folder.name}-victim"
        victim.mkdir()
        (victim / "precious").write_bytes(b"precious")
        (folder / name.replace("PREFIX", "model.ckpt-2")).symlink_to(victim / "precious")
        return victim, lambda: save_tf_checkpoint(folder / "model.ckpt-2", {"w": torch.ones(1000)})

    return build


def _full_disk():
    folder = _saved()[0]
    paths = "".join(f'all_model_checkpoint_paths: "old/model.ckpt-{i:08d}"\n' for i in range(3000))
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "{_PREFIX}"\n{paths}')

    def save():
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))
        try:
            save_tf_checkpoint(folder / "model.ckpt-2", {"w": torch.ones(3)}, global_step=2)
        except OSError as error:
            assert error.errno == errno.EFBIG
            raise
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, previous)

    return folder, save


def _save_case(
    path: str, var_map: Callable[[], dict[str, Any]], setup=None, cwd: bool = False, **kwargs: Any
):
    def build():
        folder, prefix, _, _ = _saved()
        if setup is not None:
            setup(folder, prefix)

        def save():
            here = os.getcwd()
            os.chdir(folder if cwd else here)
            try:
                save_tf_checkpoint(path if cwd else folder / path if path else path, var_map(), **kwargs)
            finally:
                os.chdir(here)

        return folder, save

    return build


def _append_entry(value: bytes):
    return lambda folder, prefix: _replace_entry(prefix, b"big", lambda e: value)


def _checkpoint_writer_cases(Case: Callable[..., Any]) -> list[Any]:
    big_slice = table.length_delimited(7, table.length_delimited(1, table.varint_field(2, 2**40)))
    ones = lambda: {"w2": torch.ones(2)}  # noqa: E731
    cases = [
        Case(
            "checkpoint writer",
            f"a symlink planted at {name}",
            _planted_symlink(name),
            (),
            unharmed_if_no_error=True,
        )
        for name in ("PREFIX.data-00000-of-00001.tmp", "PREFIX.index.tmp", "checkpoint.tmp")
    ]
    cases.append(
        Case("checkpoint writer", "the disk fills writing the state file", _full_disk, ("checkpoint",))
    )
    save_cases = {
        "a state file that is not UTF-8": (
            _save_case(
                "model.ckpt-2",
                ones,
                lambda f, p: (f / "checkpoint").write_bytes(b'model_checkpoint_path: "\xe8"'),
            ),
            ("checkpoint", "UTF-8"),
        ),
        "a tensor named '\\x00w'": (
            _save_case("model.ckpt-2", lambda: {"\x00w": torch.ones(2)}),
            ("'\\x00w'",),
        ),
        "a tensor named 'w\\udc80'": (
            _save_case("model.ckpt-2", lambda: {"w\udc80": torch.ones(2)}),
            ("'w\\udc80'",),
        ),
        "a tensor named _CHECKPOINTABLE_OBJECT_GRAPH": (
            _save_case("model.ckpt-2", lambda: {"_CHECKPOINTABLE_OBJECT_GRAPH": torch.ones(2)}),
            ("_CHECKPOINTABLE_OBJECT_GRAPH",),
        ),
        "prefix ''": (_save_case("", ones, cwd=True), ("path ''",)),
        "prefix 'model.ckpt.data-00000-of-00001'": (
            _save_case("model.ckpt.data-00000-of-00001", ones),
            ("data-00000-of-00001",),
        ),
        "prefix 'model.ckpt.index'": (_save_case("model.ckpt.index", ones), ("model.ckpt.index",)),
        "prefix with a NUL": (_save_case("model\x00ckpt", ones), ("path", "NUL")),
        "a directory at <prefix>.index": (
            _save_case("model.ckpt-2", ones, lambda f, p: (f / "model.ckpt-2.index").mkdir()),
            ("model.ckpt-2.index",),
        ),
        "append to a partitioned [2**40] variable": (
            _save_case(_PREFIX, ones, _append_entry(_entry(1, _shape(2**40)) + big_slice), append=True),
            ("'big'",),
        ),
        "append to a shape [0, 2**64 - 1]": (
            _save_case(_PREFIX, ones, _append_entry(_entry(1, _shape(0, 2**64 - 1))), append=True),
            ("'big'",),
        ),
        "append a name already held": (
            _save_case(_PREFIX, lambda: {"w": torch.ones(3)}, append=True),
            ("'w'",),
        ),
        "a meta tensor": (_save_case("model.ckpt-2", lambda: {"w": torch.ones(3, device="meta")}), ("'w'",)),
        "a sparse tensor": (_save_case("model.ckpt-2", lambda: {"w": torch.ones(3).to_sparse()}), ("'w'",)),
        "global_step=2**63": (_save_case("model.ckpt-2", ones, global_step=2**63), ("global_step",)),
        "global_step=tensor(-1)": (
            _save_case("model.ckpt-2", ones, global_step=torch.tensor(-1)),
            ("global_step",),
        ),
        "global_step=tensor(2**63, uint64)": (
            _save_case("model.ckpt-2", ones, global_step=torch.tensor(2**63, dtype=torch.uint64)),
            ("global_step",),
        ),
    }
    for label, (build, names) in save_cases.items():
        cases.append(Case("checkpoint writer", label, build, names, traced=True))
    return cases
