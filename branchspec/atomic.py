"""Writing files and folders all or nothing: under a temporary name beside the target,
renamed into place only once complete, so an interrupted write (a crash, a full disk, a
kill) never leaves a half-written file where a whole one is expected, and what it leaves
under its temporary name is recognisable and removed by the next write there."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_TMP_RE = re.compile(r"\..+\.(\d+)\.tmp")        # `_tmp_name`'s: .NAME.PID.tmp
PARTIAL_MARK = ".branchspec-partial"              # in a folder being written: the writer's pid


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def is_temporary(name: str) -> bool:
    """Whether a file name is one `write_atomically` writes before renaming."""
    return _TMP_RE.fullmatch(name) is not None


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp_path) fills a temporary sibling of `path`, which then replaces `path` in
    one rename; on any error the temporary file is removed and `path` is as it was. An
    OSError (a full disk, a refused write) is raised again naming `path`."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
        raise


_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


def os_error_of(error: BaseException, path) -> OSError | None:
    """The OSError inside a Rust library's own exception (safetensors' SafetensorError,
    tokenizers' bare Exception: "... File too large (os error 27)"), naming `path`; None
    when it is not an I/O error. So a full disk is an OSError wherever it strikes."""
    if isinstance(error, OSError):
        return error
    m = _OS_ERROR_RE.search(str(error))
    if m is None:
        return None
    errno = int(m.group(1))
    return OSError(errno, os.strerror(errno), str(path))


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with an I/O failure (a full disk, a file-size limit) raised
    as the OSError it is, naming `path`."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:   # noqa: BLE001 - SafetensorError is a bare Exception
        error = os_error_of(e, path)
        if error is None:
            raise
        raise error from e


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True      # someone else's process: leave its folder alone
    return True


def remove_abandoned_folders(out: Path) -> list[Path]:
    """Delete the temporary siblings of `out` that `new_folder` left when its process died
    mid-write (marked with that process's id, which is no longer running)."""
    removed = []
    parent = out.parent
    if not parent.is_dir():
        return removed
    for p in parent.glob(f".{out.name}.*"):
        mark = p / PARTIAL_MARK
        if not (p.is_dir() and mark.is_file()):
            continue
        try:
            pid = int(mark.read_text().strip())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextmanager
def new_folder(out: Path, refuse: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Write a folder all or nothing: the block fills a temporary sibling of `out` (which
    must not exist, or be empty; `refuse(out)` may check more), renamed into place when the
    block ends; on any error the sibling is removed and `out` is left as it was, and an
    OSError names the folder. Siblings abandoned by a killed writer are removed first."""
    out = Path(out)
    if refuse is not None:
        refuse(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_folders(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise OSError(e.errno, f"cannot write {out}: {e.strerror or e}") from e
    try:
        (tmp / PARTIAL_MARK).write_text(str(os.getpid()))
        yield tmp
        (tmp / PARTIAL_MARK).unlink()
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            # The file as it would have been named, not its temporary sibling's name.
            name = str(e.filename).replace(str(tmp), str(out)) if e.filename else None
            raise OSError(e.errno, f"cannot write {out}: {e.strerror or e}"
                                   f"{' (' + name + ')' if name else ''}; nothing was left there") from e
        raise
