"""TF checkpoints from other people, and directories other people share: hostile bytes and neighbours.

Every crafted file starts from a checkpoint the package saved itself; its index
is rewritten by the small table and protobuf encoder below (independent of the
package's own, so that it can craft what that one never writes). A load must
end in a named error (``CorruptCheckpointError`` naming the file and the entry,
or ``ValueError`` for the caller's mistake) at once, with memory bounded by the
files, and the model and optimizer unchanged.
A save must never write through a planted path, must refuse what it could not
read back, and when it fails must leave nothing new in the directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _deadlines import scaled

import torchgrad_compat.optim as tgo
from torchgrad_compat.checkpoint import (
    CorruptCheckpointError,
    load_tf_checkpoint,
    save_tf_checkpoint,
)
from torchgrad_compat.checkpoint._bundle import BundleEntry, BundleReader, write_bundle

DATA = ".data-00000-of-00001"
FOOTER_SIZE = 48
TABLE_MAGIC = 0xDB4775248B80FB57
DTYPE_ENUM = {"float32": 1, "int64": 9}
Entries = list[tuple[bytes, bytes]]


# ---------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the block after ``seconds`` (scaled): a hang, or a quadratic loop, fails fast."""
    seconds = scaled(seconds)

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"no answer within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Model:
    """Two variables and an Adam optimizer that has stepped: what a failed load must leave alone."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        self.b = torch.nn.Parameter(torch.tensor([0.5, 0.25]))
        self.opt = tgo.AdamOptimizer([self.w, self.b], learning_rate=0.1)
        self.w.grad, self.b.grad = torch.ones(3), torch.ones(2)
        self.opt.step()

    def var_map(self) -> dict[str, torch.Tensor]:
        return {"w": self.w, "b": self.b}

    def snapshot(self) -> list[torch.Tensor]:
        state = [s.clone() for p in (self.w, self.b) for s in self.opt.state[p].values()]
        group = self.opt.param_groups[0]
        return [self.w.detach().clone(), self.b.detach().clone(), *state] + [
            group[k].clone() for k in ("beta1_power", "beta2_power")
        ]


def _saved(folder: Path, step: int = 1) -> Path:
    """A checkpoint the package saved: ``w`` [3], ``b`` [2], their Adam slots, the beta powers."""
    model = Model()
    prefix = folder / f"model.ckpt-{step}"
    save_tf_checkpoint(prefix, model.var_map(), model.opt, global_step=step)
    return prefix


# ---------------------------------------------------------------------- a tiny encoder
def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _block(entries: Entries) -> bytes:
    """A table block, a restart point at every entry."""
    body, restarts = bytearray(), []
    for key, value in entries:
        restarts.append(len(body))
        body += _varint(0) + _varint(len(key)) + _varint(len(value)) + key + value
    restarts = restarts or [0]
    return (
        bytes(body)
        + b"".join(r.to_bytes(4, "little") for r in restarts)
        + len(restarts).to_bytes(4, "little")
    )


def _append_block(out: bytearray, block: bytes) -> bytes:
    handle = _varint(len(out)) + _varint(len(block))
    out += block + b"\x00" + _masked_crc(block + b"\x00").to_bytes(4, "little")
    return handle


def _table_bytes(entries: Entries, times: int = 1) -> bytes:
    """A table of ``entries`` in one data block, which its index block names ``times`` times."""
    out = bytearray()
    data = _append_block(out, _block(entries))
    meta = _append_block(out, _block([]))
    last = entries[-1][0]
    index = _append_block(out, _block([(last + b"~" * i, data) for i in range(times)]))
    return bytes(out) + (meta + index).ljust(40, b"\x00") + TABLE_MAGIC.to_bytes(8, "little")


def _encoded(entry: BundleEntry) -> bytes:
    return _entry(DTYPE_ENUM[entry.dtype], _shape(*entry.shape), entry.offset, entry.size, entry.crc32c)


def _table_of(prefix: Path) -> Entries:
    """The index of a checkpoint the package saved (one shard, no partitioned variable), re-encoded."""
    header = _int_field(1, 1) + _bytes_field(3, _int_field(1, 1))
    entries = BundleReader(prefix).entries
    return [(b"", header)] + [(name.encode(), _encoded(entries[name])) for name in sorted(entries)]


def _write_index(prefix: Path, entries: Entries) -> None:
    Path(f"{prefix}.index").write_bytes(_table_bytes(entries))


def _entry(
    dtype: int | bytes = 1,
    shape: bytes | int = b"",
    offset: int = 0,
    size: int = 0,
    crc: int = 0,
    slices: list[bytes | int] | None = None,
) -> bytes:
    """A BundleEntryProto; an int given for a message is written as a varint, bytes for an int as bytes."""

    def field(number: int, value: int | bytes) -> bytes:
        return _bytes_field(number, value) if isinstance(value, bytes) else _int_field(number, value)

    out = field(1, dtype) + field(2, shape) + field(4, offset) + field(5, size)
    out += _varint(6 << 3 | 5) + crc.to_bytes(4, "little")
    return out + b"".join(field(7, s) for s in slices or [])


def _shape(*dims: int) -> bytes:
    return b"".join(_bytes_field(2, _int_field(1, d)) for d in dims)


def _with_entry(prefix: Path, name: bytes, value: bytes) -> None:
    """Replace (or add) the index entry ``name``, keeping the keys sorted."""
    entries = dict(_table_of(prefix))
    entries[name] = value
    _write_index(prefix, sorted(entries.items()))


def _load_refused(prefix: Path | str, *words: str) -> CorruptCheckpointError:
    """Load into a stepped model: must raise CorruptCheckpointError naming ``words``, change nothing."""
    model = Model()
    before = model.snapshot()
    with _deadline(20), pytest.raises(CorruptCheckpointError) as caught:
        load_tf_checkpoint(prefix, model.var_map(), model.opt)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    after = model.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return caught.value


def _listing(folder: Path) -> dict[str, bytes | str]:
    """Every file under ``folder`` -> its bytes (a symlink -> where it points)."""
    out: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = f"-> {os.readlink(path)}"
        elif path.is_file():
            out[key] = path.read_bytes()
    return out


# OrderedCode, as TF keys the pieces of a partitioned variable (tensor_slice_util / ordered_code.cc).
def _ordered_unsigned(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(raw)]) + raw


def _ordered_string(value: bytes) -> bytes:
    return value.replace(b"\xff", b"\xff\x00").replace(b"\x00", b"\x00\xff") + b"\x00\x01"


def _ordered_signed(value: int) -> bytes:
    length = next(n for n in range(1, 8) if -(2 ** (7 * n - 1)) <= value < 2 ** (7 * n - 1))
    raw = bytearray(value.to_bytes(length, "big", signed=True))
    header = ((0xFFFF << (16 - length)) & 0xFFFF).to_bytes(2, "big")
    raw[0] ^= header[0]
    if length > 1:
        raw[1] ^= header[1]
    return bytes(raw)


def _slice_key(name: str, extents: list[tuple[int, int]]) -> bytes:
    key = _ordered_unsigned(0) + _ordered_string(name.encode()) + _ordered_unsigned(len(extents))
    return key + b"".join(_ordered_signed(s) + _ordered_signed(n) for s, n in extents)


def _slice(extents: list[tuple[int, int]]) -> bytes:
    return b"".join(_bytes_field(1, _int_field(1, s) + _int_field(2, n)) for s, n in extents)


def _partitioned(folder: Path, pieces: int) -> Path:
    """A checkpoint holding ``v`` [pieces] as that many one-element pieces (as TF keys them)."""
    prefix = folder / "model.ckpt"
    write_bundle(str(prefix), {f"p{i:05d}": torch.tensor([float(i)]) for i in range(pieces)})
    parts = dict(_table_of(prefix))
    header = parts.pop(b"")
    entries = [(b"", header)]
    for i in range(pieces):
        entries.append((_slice_key("v", [(i, 1)]), parts[f"p{i:05d}".encode()]))
    slices: list[bytes | int] = [_slice([(i, 1)]) for i in range(pieces)]
    entries.append((b"v", _entry(1, _shape(pieces), slices=slices)))
    _write_index(prefix, sorted(entries))
    return prefix


# ---------------------------------------------------------------------- 1. the reader
def test_a_crafted_partitioned_checkpoint_loads_exactly(tmp_path: Path) -> None:
    """The control for the crafted ones below: pieces keyed as TF keys them load exactly."""
    prefix = _partitioned(tmp_path, 5)
    v = torch.zeros(5)
    load_tf_checkpoint(prefix, {"v": v})
    assert torch.equal(v, torch.arange(5.0))


@pytest.mark.parametrize(
    ("label", "value", "field"),
    [
        ("shape as a varint of 2**40", lambda e: _entry(1, 2**40, e.offset, e.size, e.crc32c), "'shape'"),
        ("shape as a varint of 1000", lambda e: _entry(1, 1000, e.offset, e.size, e.crc32c), "'shape'"),
        (
            "a dim as a varint",
            lambda e: _entry(1, _int_field(2, 3), e.offset, e.size, e.crc32c),
            "'dim'",
        ),
        ("a slice as a varint", lambda e: _entry(1, _shape(3), e.offset, e.size, e.crc32c, [7]), "'slices'"),
        ("dtype as the bytes b'9'", lambda e: _entry(b"9", _shape(3), e.offset, e.size, e.crc32c), "'dtype'"),
        (
            "dtype as the bytes b'abc'",
            lambda e: _entry(b"abc", _shape(3), e.offset, e.size, e.crc32c),
            "'dtype'",
        ),
        (
            "a length of 2**40 declared in the shape",
            lambda e: _int_field(1, 1) + _varint(2 << 3 | 2) + _varint(2**40),
            "2**40",
        ),
    ],
)
def test_a_field_of_the_wrong_wire_type_is_refused_naming_it(
    label: str, value: Callable[..., bytes], field: str, tmp_path: Path
) -> None:
    prefix = _saved(tmp_path)
    _with_entry(prefix, b"w", value(BundleReader(prefix).entries["w"]))
    start = time.perf_counter()
    error = _load_refused(prefix, f"{prefix}.index", "entry 'w'")
    assert time.perf_counter() - start < 5
    if field == "2**40":
        assert f"declares {2**40} bytes" in str(error)
    else:
        assert field in str(error)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    """Two CRC-valid entries under ``w`` (1.0, then 2.0): a sorted table has each key once."""
    prefix = tmp_path / "model.ckpt"
    write_bundle(str(prefix), {"a": torch.full((3,), 1.0), "w": torch.full((3,), 2.0)})
    entries = dict(_table_of(prefix))
    _write_index(prefix, [(b"", entries[b""]), (b"w", entries[b"a"]), (b"w", entries[b"w"])])
    w = torch.zeros(3)
    with pytest.raises(CorruptCheckpointError, match=rf"{prefix}\.index: key b'w' appears twice"):
        load_tf_checkpoint(prefix, {"w": w})
    assert not w.any()


def test_block_handles_given_twice_are_refused_before_any_block_is_parsed(tmp_path: Path) -> None:
    """An index block naming one 2000-entry block 200 times: 54 KB that parsed as 400,000 entries."""
    prefix = _saved(tmp_path)
    entries = _table_of(prefix)
    value = dict(entries)[b"w"]
    many = [entries[0]] + [(b"k%05d" % i, value) for i in range(2000)]
    Path(f"{prefix}.index").write_bytes(_table_bytes(many, times=200))
    start = time.perf_counter()
    _load_refused(prefix, f"{prefix}.index", "overlap")
    assert time.perf_counter() - start < 2


def test_keys_that_share_ever_longer_prefixes_are_refused_before_they_grow(tmp_path: Path) -> None:
    """Each key may share all of the one before: 20,000 keys of one new byte each, 100 KB encoded,
    decode to 200 MB (a 1 MB block to 31 GB). TF restarts sharing every 16 keys; refuse more."""
    prefix = _saved(tmp_path)
    header = _table_of(prefix)[0][1]
    body = bytearray(_varint(0) + _varint(0) + _varint(len(header)) + header)
    for i in range(20000):
        body += _varint(i) + _varint(1) + _varint(0) + b"a"
    block = bytes(body) + (0).to_bytes(4, "little") + (1).to_bytes(4, "little")  # one restart, at 0
    out = bytearray()
    data = _append_block(out, block)
    meta = _append_block(out, _block([]))
    index = _append_block(out, _block([(b"a" * 20000, data)]))
    footer = (meta + index).ljust(40, b"\x00") + TABLE_MAGIC.to_bytes(8, "little")
    Path(f"{prefix}.index").write_bytes(bytes(out) + footer)
    w = torch.zeros(3)
    tracemalloc.start()
    try:
        with _deadline(20), pytest.raises(CorruptCheckpointError) as caught:
            load_tf_checkpoint(prefix, {"w": w})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{prefix}.index: the keys of a" in str(caught.value)
    assert "decode to more than 16 times its size" in str(caught.value)
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB"
    assert not w.any()


def test_many_pieces_load_in_linear_time(tmp_path: Path) -> None:
    """4000 one-element pieces: 71 s with the pairwise overlap check; now a flag per element."""
    prefix = _partitioned(tmp_path, 4000)
    v = torch.zeros(4000)
    start = time.perf_counter()
    with _deadline(20):
        load_tf_checkpoint(prefix, {"v": v})
    elapsed = time.perf_counter() - start
    assert torch.equal(v, torch.arange(4000.0))
    # 1.3 s measured on 2 cores under a load of 7; the pairwise check took 71 s (4000 pieces).
    assert elapsed < 10, f"{elapsed:.1f} s"


def test_a_sparse_index_of_1_gib_is_read_by_its_blocks_not_whole(tmp_path: Path) -> None:
    """Only the footer and the blocks it names are read: a 1 GiB index (a hole between its blocks
    and its footer) loads holding a few KB of it, where reading it whole takes 1 GiB."""
    prefix = _saved(tmp_path)
    raw = Path(f"{prefix}.index").read_bytes()
    with open(f"{prefix}.index", "wb") as index:
        index.write(raw[:-FOOTER_SIZE])
        index.seek((1 << 30) - FOOTER_SIZE)
        index.write(raw[-FOOTER_SIZE:])
    w, b = torch.zeros(3), torch.zeros(2)
    tracemalloc.start()
    try:
        with _deadline(20):
            info = load_tf_checkpoint(prefix, {"w": w, "b": b})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.global_step == 1 and torch.equal(b, Model().b.detach())
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB"


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize(
    ("suffix", "make", "kind"),
    [(DATA, _fifo, "a FIFO"), (DATA, _directory, "a directory"), (".index", _fifo, "a FIFO")],
)
def test_a_fifo_or_directory_at_a_checkpoint_file_is_refused_without_waiting(
    suffix: str, make: Callable[[Path], None], kind: str, tmp_path: Path
) -> None:
    prefix = _saved(tmp_path)
    make(Path(f"{prefix}{suffix}"))
    _load_refused(prefix, f"{prefix}{suffix}", f"is {kind}, not a regular file")


def test_a_key_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    prefix = _saved(tmp_path)
    _with_entry(prefix, b"w\xff", dict(_table_of(prefix))[b"w"])
    _load_refused(prefix, f"{prefix}.index", "entry name b'w\\xff' is not UTF-8")


@pytest.mark.parametrize(
    ("contents", "words"),
    [
        (b'model_checkpoint_path: "model.ckpt-1\\x"\n', ("line 1", "invalid escape '\\\\x'")),
        (b'model_checkpoint_path: "model.ckpt-1\\q"\n', ("line 1", "invalid escape '\\\\q'")),
        (b'model_checkpoint_path: "mod\xe8le"\n', ("not UTF-8",)),
        (b'model_checkpoint_path: "mod\\350le"\n', ("line 1", "not a UTF-8 path")),
        (b'all_model_checkpoint_paths: "a"\nnot_a_field: "model.ckpt-1"\n', ("line 2", "'not_a_field'")),
    ],
)
def test_a_bad_state_file_is_refused_naming_it(
    contents: bytes, words: tuple[str, ...], tmp_path: Path
) -> None:
    _saved(tmp_path)
    state = tmp_path / "checkpoint"
    state.write_bytes(contents)
    error = _load_refused(tmp_path, str(state), *words)
    assert "checkpoint" in str(error)


def test_a_state_file_as_tf_writes_it_is_read(tmp_path: Path) -> None:
    """The control for the strict parser: every field of CheckpointState, octal-escaped UTF-8 (as
    Python's text_format writes it), numbers in each form text format allows, comments."""
    save_tf_checkpoint(tmp_path / "modèle.ckpt-1", {"w": torch.ones(2)})
    octal = "".join(f"\\{byte:03o}" for byte in "è".encode())
    (tmp_path / "checkpoint").write_text(
        f'model_checkpoint_path: "mod{octal}le.ckpt-1"\r\n'
        "# written by tf.train.CheckpointManager\n"
        f'all_model_checkpoint_paths: "mod{octal}le.ckpt-1"\n'
        "all_model_checkpoint_timestamps: 1.7e+09\n"
        "all_model_checkpoint_timestamps: 1700000000.5\n"
        "last_preserved_timestamp: -inf\n"
    )
    w = torch.zeros(2)
    load_tf_checkpoint(tmp_path, {"w": w})
    assert torch.equal(w, torch.ones(2))


def test_a_directory_loads_the_prefix_its_state_file_names_as_written(tmp_path: Path) -> None:
    """TF's Saver can write prefix ``d/model.index`` (its files ``model.index.index``, ...); the
    state file naming it must not be read as the index file of ``d/model``."""
    save_tf_checkpoint(tmp_path / "model", {"w": torch.ones(2)}, global_step=1)
    write_bundle(str(tmp_path / "model.index"), {"w": torch.full((2,), 2.0), "global_step": torch.tensor(2)})
    (tmp_path / "checkpoint").write_text(
        'model_checkpoint_path: "model.index"\n'
        'all_model_checkpoint_paths: "model"\n'
        'all_model_checkpoint_paths: "model.index"\n'
    )
    w = torch.zeros(2)
    assert load_tf_checkpoint(tmp_path, {"w": w}).global_step == 2
    assert torch.equal(w, torch.full((2,), 2.0))


# ---------------------------------------------------------------------- 2. the writer
@pytest.mark.parametrize(
    "planted", ["model.ckpt-2.data-00000-of-00001.tmp", "model.ckpt-2.index.tmp", "checkpoint.tmp"]
)
def test_a_symlink_planted_at_a_temporary_name_is_never_followed(planted: str, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (folder / planted).symlink_to(victim)
    save_tf_checkpoint(folder / "model.ckpt-2", {"w": torch.ones(1000)})
    assert victim.read_bytes() == b"precious"
    for name in ("model.ckpt-2.data-00000-of-00001", "model.ckpt-2.index", "checkpoint"):
        assert not (folder / name).is_symlink() and (folder / name).is_file(), name
    w = torch.zeros(1000)
    load_tf_checkpoint(folder, {"w": w})
    assert torch.equal(w, torch.ones(1000))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_save_that_fails_writing_the_state_file_leaves_nothing_new(tmp_path: Path) -> None:
    """The state file cannot be written (a file-size limit fails the write, as a full disk
    would): the new checkpoint must not be left in place, nor a temporary beside it."""
    prefix = _saved(tmp_path)
    paths = "".join(f'all_model_checkpoint_paths: "old/model.ckpt-{i:08d}"\n' for i in range(3000))
    (tmp_path / "checkpoint").write_text(f'model_checkpoint_path: "{prefix.name}"\n{paths}')
    before = _listing(tmp_path)
    import resource

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))
    try:
        with pytest.raises(OSError) as caught:
            save_tf_checkpoint(tmp_path / "model.ckpt-2", {"w": torch.ones(3)}, global_step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert caught.value.errno == errno.EFBIG
    assert _listing(tmp_path) == before


def test_a_save_beside_a_state_file_that_is_not_utf8_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_bytes(b'model_checkpoint_path: "mod\xe8le"\n')
    before = _listing(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=rf"{tmp_path / 'checkpoint'}: .* not UTF-8"):
        save_tf_checkpoint(tmp_path / "model.ckpt-1", {"w": torch.ones(3)})
    assert _listing(tmp_path) == before


@pytest.mark.parametrize(
    ("prefix", "var_map", "words"),
    [
        ("model.ckpt", {"\x00w": torch.ones(2)}, "cannot write tensor '\\x00w': a TF name holds no NUL"),
        ("model.ckpt", {"w\udc80": torch.ones(2)}, "cannot write tensor 'w\\udc80': its name is not valid"),
        ("model.ckpt", {"_CHECKPOINTABLE_OBJECT_GRAPH": torch.ones(2)}, "TF reserves the name"),
        ("", {"w": torch.ones(2)}, "path '' names no file"),
        ("model.ckpt.data-00000-of-00001", {"w": torch.ones(2)}, "ends as a checkpoint's file does"),
        ("model.ckpt.index", {"w": torch.ones(2)}, "ends as a checkpoint's file does"),
    ],
)
def test_what_could_not_be_read_back_is_refused_at_save(
    prefix: str, var_map: dict[str, torch.Tensor], words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # prefix "" wrote into the working directory
    with pytest.raises(ValueError) as caught:
        save_tf_checkpoint(prefix, var_map)
    assert words in str(caught.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("label", "entry", "words"),
    [
        (
            "a partitioned variable declaring [2**40]",
            _entry(1, _shape(2**40), slices=[_slice([(0, 2**40)])]),
            "piece [(0, 1099511627776)] of 'big' is missing",
        ),
        ("shape [0, 2**64 - 1]", _entry(1, _shape(0, 2**64 - 1)), "field 'size' is -1"),
        ("shape [2**62, 2**62, 0]", _entry(1, _shape(2**62, 2**62, 0)), "more elements than an int64"),
    ],
)
def test_append_checks_the_checkpoint_before_it_allocates(
    label: str, entry: bytes, words: str, tmp_path: Path
) -> None:
    prefix = _saved(tmp_path)
    _with_entry(prefix, b"big", entry)
    before = _listing(tmp_path)
    with _deadline(20), pytest.raises(CorruptCheckpointError) as caught:
        save_tf_checkpoint(prefix, {"other": torch.ones(2)}, append=True)
    assert words in str(caught.value) and "'big'" in str(caught.value)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize(
    ("var_map", "kwargs", "words"),
    [
        ({"w": torch.ones(3, device="meta")}, {}, ("'w'", "meta")),
        ({"w": torch.ones(3).to_sparse()}, {}, ("'w'", "sparse")),
        ({"w": torch.ones(3)}, {"global_step": 2**63}, ("global_step", str(2**63))),
        ({"w": torch.ones(3)}, {"global_step": torch.tensor(-1)}, ("global_step", "-1")),
    ],
)
def test_a_save_error_names_the_variable_or_the_argument(
    var_map: dict[str, torch.Tensor], kwargs: dict[str, object], words: tuple[str, ...], tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as caught:
        save_tf_checkpoint(tmp_path / "model.ckpt", var_map, **kwargs)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    assert not list(tmp_path.iterdir())
