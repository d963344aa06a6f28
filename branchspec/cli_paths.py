"""The paths a command line names, checked before any work: a folder to read from (it
exists, is a folder, can be listed), a folder to write into (it is a folder, or can be
made one under a writable folder) and a file to write (its folder is one of those). Each
error names the flag and the path."""

from __future__ import annotations

import os
from pathlib import Path


def readable_folder(flag: str, path) -> Path:
    """FileNotFoundError when `path` does not exist; ValueError when it is not a folder or
    cannot be read."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p} does not exist")
    if not p.is_dir():
        raise ValueError(f"{flag} {p} is a file, not a folder")
    if not os.access(p, os.R_OK | os.X_OK):
        raise ValueError(f"{flag} {p} cannot be read (permission denied)")
    return p


def writable_folder(flag: str, path, empty: bool = False) -> Path:
    """ValueError unless `path` is a writable folder (`empty`: an empty one) or can be
    created: its nearest existing ancestor is a writable folder."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{flag} {p} is a file, not a folder")
        if empty and any(p.iterdir()):
            raise ValueError(f"{flag} {p} exists and is not an empty folder; choose a new path")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {p} is not writable (permission denied)")
        return p
    for ancestor in p.absolute().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ValueError(f"{flag} {p} cannot be created: {ancestor} is a file, not a folder")
            if not os.access(ancestor, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {p} cannot be created: {ancestor} is not writable (permission denied)")
            break
    return p


def writable_file(flag: str, path) -> Path:
    """ValueError unless `path` can be written as a file: a writable file, or a new one in
    a folder that `writable_folder` accepts (made when the file is written). An existing
    folder is accepted too, for commands that then write their default file name in it."""
    p = Path(path)
    if p.is_dir():
        return writable_folder(flag, p)
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{flag} {p} is not writable (permission denied)")
        return p
    if p.name in ("", ".", ".."):
        raise ValueError(f"{flag} {p} names no file")
    try:
        writable_folder(flag, p.parent)
    except ValueError as e:
        raise ValueError(f"{flag} {p} cannot be written: {str(e).removeprefix(f'{flag} ')}") from None
    return p
