"""Atomic outputs: write under a temporary name beside the target and rename only on success.

A crashed or interrupted step must never leave a file that looks complete. This module knows
nothing about what is written; the engine (checkpoint markers, metrics, failure reports) and the
offline data tools share it. The .bin/.idx writer has its own two-file protocol (engine/data/indexed.py).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

# Temporary and staging names carry the writing process (host and pid): a writer killed outright (SIGKILL, the OOM
# killer, a power cut) cannot remove them, and the next writer of the same output removes those whose process is
# gone. Another machine's (a shared file system) are never touched: its processes cannot be seen from here.
_HOST = socket.gethostname()
_STAGING = ".staging-"


def _writer_tag() -> str:
    return f"{_HOST}-{os.getpid()}"


NAME_MAX = 255  # bytes in one file name, on every file system loom is run on (ext4, xfs, Lustre, NFS)
_TAG_MAX = len(_HOST) + 1 + 10  # the writer tag with the largest pid


def _temporary_prefix(path: Path, reserve: int = 0) -> str:
    """`.NAME.`, the start of every temporary name of `path`; a name too long to take the writer's tag (a legal
    output name near 255 bytes) and `reserve` more bytes is cut and given a hash of the whole, so that it stays its
    own."""
    name = path.name
    room = NAME_MAX - reserve - len(f"..{'x' * _TAG_MAX}.tmp".encode())
    if len(name.encode()) <= room:
        return f".{name}."
    digest = "~" + hashlib.sha1(name.encode()).hexdigest()[:12]
    cut = name.encode()[: room - len(digest)].decode(errors="ignore")
    return f".{cut}{digest}."


def temporary_sibling(path: str | Path, reserve: int = 0) -> Path:
    """A name in the same directory (so the final rename is atomic) that no other process uses; `reserve`: bytes
    the caller appends to it (a SentencePiece prefix's .model)."""
    path = Path(path)
    return path.with_name(f"{_temporary_prefix(path, reserve)}{_writer_tag()}.tmp")


def _left_by_a_gone_writer(name: str, prefix: str, suffix: str = "") -> bool:
    """Whether `name` is prefix + this host's tag of a process that no longer runs + suffix."""
    if not (name.startswith(f"{prefix}{_HOST}-") and name.endswith(suffix)):
        return False
    pid = name[len(prefix) + len(_HOST) + 1 : len(name) - len(suffix)]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def remove_stale_temporaries(path: str | Path, suffixes: tuple[str, ...] = (".tmp",), reserve: int = 0) -> None:
    """Remove the temporary files that writers of `path` on this machine, now gone, left beside it (temporary_sibling
    names with `reserve`, ending in one of `suffixes`: SentencePiece adds .model and .vocab to its own)."""
    path = Path(path)
    prefix = _temporary_prefix(path, reserve)
    for suffix in suffixes:
        for entry in path.parent.glob(f"{glob.escape(prefix)}*{suffix}"):
            if _left_by_a_gone_writer(entry.name, prefix, suffix):
                with contextlib.suppress(OSError):
                    entry.unlink()


def staging_folder(output: Path) -> Path:
    """A fresh folder inside `output` for a command's files until they are complete, after removing the staging
    folders of this machine's writers that are gone."""
    remove_stale_staging(output)
    staging = output / f"{_STAGING}{_writer_tag()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def is_staging(path: Path) -> bool:
    """Whether `path` is a staging folder (staging_folder's name): a command's output until it is complete."""
    return path.name.startswith(_STAGING) and path.is_dir()


def remove_stale_staging(output: Path) -> list[str]:
    """Remove the staging folders that commands on this machine, killed before they finished, left in `output`;
    returns their names."""
    removed = []
    if output.is_dir():
        for entry in output.iterdir():
            if entry.is_dir() and _left_by_a_gone_writer(entry.name, _STAGING):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; it replaces `path` if the block succeeds and is removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as error:
        # A write's error names no file ("[Errno 28] ..."), an open's the temporary name: the user knows `path`.
        if error.errno is not None and (error.filename is None or str(error.filename) == str(tmp)):
            raise OSError(error.errno, error.strerror, str(path)) from None
        raise
    finally:
        # A failed cleanup must not hide the write's own error (unlink of a missing file on a read-only mount is
        # EROFS); a temporary left behind is removed by the next writer (remove_stale_temporaries).
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def copy_atomically(source: Path, path: Path) -> None:
    """shutil.copyfile into `path` through atomic_path; an error in writing names `path` (copyfile's names the
    source)."""
    import shutil

    with atomic_path(path) as tmp:
        try:
            shutil.copyfile(source, tmp)
        except OSError as error:
            if not Path(source).is_file():
                raise
            raise OSError(error.errno, error.strerror, str(path)) from None


def cannot_create(path: Path) -> str | None:
    """Why a new file cannot be created at `path` (its folder is made if missing), or None: checked before a
    command's work, so that its result is not lost after it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        path.unlink()
    except OSError as error:
        return error.strerror or str(error)
    return None


def write_text_atomically(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import: os.umask can only be read by setting it, which races with other threads


def save_tensors_atomically(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, atomically, with the permissions of any new file (the umask's): save_file makes its
    files 0600, which the other users of a shared cluster's checkpoints and exports cannot read."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except Exception as error:
            raise _as_os_error(error, Path(path)) from None
        os.chmod(tmp, 0o666 & ~_UMASK)


SAFETENSORS_DTYPES = {  # torch's dtype names: safetensors' header names
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def torch_dtype_of(safetensors_name: str, key: str):
    """The torch dtype of a safetensors header's dtype name; ValueError naming tensor `key` for one loom does not
    read."""
    import torch

    names = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    if safetensors_name not in names:
        raise ValueError(f"{key} is stored as {safetensors_name}, which loom does not read")
    return getattr(torch, names[safetensors_name])


def stream_tensors_atomically(
    declared: dict, make: Callable, path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """A safetensors file of the tensors `declared` names ({key: (torch dtype, shape)}, in that order), each made by
    `make(key)` only when its bytes are due and dropped once written: peak memory is one tensor, where save_file
    holds every tensor it writes at once (an 8B model's merge or import held 2-3.5x the model). Atomic and with the
    umask's permissions as save_tensors_atomically; a made tensor of another dtype or shape than declared is a
    ValueError, and the file is not written."""
    import torch

    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for key, (dtype, shape) in declared.items():
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape)}
        header[key]["data_offsets"] = [offset, offset + size]
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as save_file's does
    with atomic_path(path) as tmp, open(tmp, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        for key, (dtype, shape) in declared.items():
            tensor = make(key)  # only now: the one tensor being written is all this writer holds
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{key}: made {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {tuple(shape)}")
            file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
        os.chmod(tmp, 0o666 & ~_UMASK)


def _as_os_error(error: Exception, path: Path) -> Exception:
    """safetensors reports the file system's errors as its own SafetensorError ("I/O error: No space left on
    device (os error 28)"): the OSError they are, naming the file, so a full disk is the user's one line."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    if found is None:
        return error
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def move_aside(folder: Path, entries: list[Path]) -> Path:
    """Move `entries` (inside `folder`) into folder/replaced/<time>/ and return that folder: what a user told a
    command to replace (--overwrite, train.overwrite) is kept out of its way, never deleted."""
    import time

    aside = folder / "replaced" / time.strftime("%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.mkdir(parents=True)
    moved = []
    try:
        for entry in entries:
            entry.rename(aside / entry.name)
            moved.append(entry)
    except OSError as error:  # an immutable or busy entry: put back what moved, so the failed command changed nothing
        if not put_back(aside, moved):
            raise OSError(
                error.errno, f"{error.strerror}; what could not be put back is in {aside}", error.filename
            ) from None
        raise
    return aside


@contextlib.contextmanager
def put_back_if_failed(replaced: tuple[Path, list[Path]] | None, output: str | Path) -> Iterator[None]:
    """What --overwrite moved aside (`replaced`: move_aside's folder and the entries) comes back if the block fails
    (a full disk): a failed command changes nothing. Where a new file holds an old one's place, the old stays
    aside, said."""
    try:
        yield
    except BaseException:
        if replaced is not None:
            whole = put_back(*replaced)
            print(
                f"--overwrite: the command failed; {output} holds what it held before"
                if whole
                else f"--overwrite: the command failed; what it replaced in {output} is in {replaced[0]}",
                flush=True,
            )
        raise


def put_back(aside: Path, entries: list[Path]) -> bool:
    """Undo move_aside for `entries` (a command that failed after moving them: the output they were is theirs
    again) where their places are free; True when all went back (and `aside` is gone)."""
    for entry in entries:
        if not entry.exists() and not entry.is_symlink():
            with contextlib.suppress(OSError):
                (aside / entry.name).rename(entry)
    for emptied in (aside, aside.parent):
        try:
            emptied.rmdir()
        except OSError:
            break
    return not aside.exists()
