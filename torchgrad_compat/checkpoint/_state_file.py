"""A directory's ``checkpoint`` state file: the text-format ``CheckpointState`` naming its latest checkpoint.

TensorFlow writes it as ``text_format.MessageToString`` does, one field a line::

    model_checkpoint_path: "model.ckpt-2"
    all_model_checkpoint_paths: "model.ckpt-1"
    all_model_checkpoint_paths: "model.ckpt-2"
    all_model_checkpoint_timestamps: 1700000000.5

with C-escaped strings (``\\"``, ``\\n``, octal ``\\303\\250`` for UTF-8 bytes).
It is parsed strictly: a field this message does not have, an invalid
escape, a path that is not UTF-8 or a file that is not are refused with a
``CorruptCheckpointError`` naming the file and the line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ._bundle import open_regular
from ._errors import CorruptCheckpointError

STATE_FILE = "checkpoint"
# CheckpointState's fields (tensorflow/core/protobuf/checkpoint_state.proto): True for a string.
_FIELDS = {
    "model_checkpoint_path": True,
    "all_model_checkpoint_paths": True,
    "all_model_checkpoint_timestamps": False,
    "last_preserved_timestamp": False,
}
_SKIP = re.compile(r"(?:\s+|#[^\n]*)*")
_FIELD_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t\r\n]*:")
_STRING = re.compile(r""""((?:[^"\\\n]|\\.)*)"|'((?:[^'\\\n]|\\.)*)'""")
_NUMBER = re.compile(
    r"([-+]?(?:inf(?:inity)?|nan|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))f?(?![\w.])", re.IGNORECASE
)
_ESCAPE = re.compile(
    r"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))", re.DOTALL
)
_SIMPLE_ESCAPES = {
    "n": b"\n",
    "r": b"\r",
    "t": b"\t",
    '"': b'"',
    "'": b"'",
    "\\": b"\\",
    "a": b"\a",
    "b": b"\b",
    "f": b"\f",
    "v": b"\v",
    "?": b"?",
}


def read_state(path: Path) -> dict[str, list[str | float]] | None:
    """The fields of the state file at ``path`` (each a list, in file order), or None when there is none."""
    try:
        fd = open_regular(path, "checkpoint state file")
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorruptCheckpointError(f"{path}: the checkpoint state file is not UTF-8 ({error})") from None
    return _parse(text, str(path))


def _skip(text: str, pos: int) -> int:
    """The position past any whitespace and comments at ``pos``."""
    return _SKIP.match(text, pos).end()  # type: ignore[union-attr]  # (it matches the empty string)


def _parse(text: str, where: str) -> dict[str, list[str | float]]:
    fields: dict[str, list[str | float]] = {}
    pos = _skip(text, 0)
    while pos < len(text):
        line = text.count("\n", 0, pos) + 1
        name = _FIELD_NAME.match(text, pos)
        if name is None:
            shown = re.match(r"\S{0,40}", text[pos:])[0]  # type: ignore[index]  # (it matches "")
            raise CorruptCheckpointError(f"{where}, line {line}: expected 'field: value', got {shown!r}")
        if name[1] not in _FIELDS:
            raise CorruptCheckpointError(
                f"{where}, line {line}: {name[1]!r} is not a field of a checkpoint state file "
                f"({', '.join(_FIELDS)})"
            )
        pos = _skip(text, name.end())
        value: str | float
        if _FIELDS[name[1]]:
            parts = []
            while quoted := _STRING.match(text, pos):
                parts.append(_unescape(quoted[1] if quoted[1] is not None else quoted[2], where, line))
                pos = _skip(text, quoted.end())
            if not parts:
                raise CorruptCheckpointError(f"{where}, line {line}: {name[1]} needs a quoted string")
            try:
                value = b"".join(parts).decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptCheckpointError(
                    f"{where}, line {line}: {name[1]} is not a UTF-8 path ({b''.join(parts)!r})"
                ) from None
        else:
            number = _NUMBER.match(text, pos)
            if number is None:
                raise CorruptCheckpointError(f"{where}, line {line}: {name[1]} needs a number")
            value = float(number[1])
            pos = _skip(text, number.end())
        fields.setdefault(name[1], []).append(value)
        if pos < len(text) and text[pos] in ",;":  # text format's optional field separators
            pos = _skip(text, pos + 1)
    return fields


def _unescape(body: str, where: str, line: int) -> bytes:
    """A text-format string's bytes: its characters as UTF-8, its C escapes decoded."""
    out = bytearray()
    pos = 0
    for escape in _ESCAPE.finditer(body):
        out += body[pos : escape.start()].encode("utf-8")
        octal, hex_, short, long, simple = escape.groups()
        if octal is not None:
            if int(octal, 8) > 0xFF:
                raise CorruptCheckpointError(f"{where}, line {line}: invalid escape \\{octal} in a string")
            out.append(int(octal, 8))
        elif hex_ is not None:
            out.append(int(hex_, 16))
        elif short is not None or long is not None:
            code = int(short or long, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise CorruptCheckpointError(f"{where}, line {line}: invalid escape {escape[0]} in a string")
            out += chr(code).encode("utf-8")
        elif simple in _SIMPLE_ESCAPES:
            out += _SIMPLE_ESCAPES[simple]
        else:
            raise CorruptCheckpointError(f"{where}, line {line}: invalid escape {escape[0]!r} in a string")
        pos = escape.end()
    return bytes(out + body[pos:].encode("utf-8"))


def latest_checkpoint(directory: str) -> str:
    """The path the directory's state file names as its latest checkpoint, as written there."""
    state = Path(directory) / STATE_FILE
    fields = read_state(state)
    if fields is None:
        raise FileNotFoundError(
            f"path {directory!r} is a directory without a {STATE_FILE!r} state file; "
            "pass a checkpoint prefix such as 'model.ckpt-1000'"
        )
    named = fields.get("model_checkpoint_path")
    if not named:
        raise FileNotFoundError(f"{state} names no model_checkpoint_path")
    return str(named[-1])  # text format: the last of a field given twice


def state_with(directory: Path, base: str) -> tuple[Path, bytes]:
    """The directory's state file and its contents once checkpoint ``base`` is added as the latest.

    The present file is read and checked first (a corrupt one is refused, so a
    save can stop before it writes anything).
    """
    state = directory / STATE_FILE
    previous = read_state(state) or {}
    paths = [p for p in previous.get("all_model_checkpoint_paths", []) if p != base] + [base]
    text = f"model_checkpoint_path: {_quote(base)}\n" + "".join(
        f"all_model_checkpoint_paths: {_quote(str(p))}\n" for p in paths
    )
    return state, text.encode("utf-8")


def _quote(path: str) -> str:
    """A text-format string: UTF-8 as is, quotes, backslashes and control characters escaped."""
    out = []
    for char in path:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\{ord(char):03o}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
