"""The local side of ``mpcomm put`` / ``mpcomm get``: files read and written through a small staging ring.

``put`` reads FILE with ``pread`` into a registered buffer rather than mapping
it: a mapped file that shrinks under the reader kills the process with SIGBUS,
while a short ``pread`` is an error we can name. FILE's size and mtime are
compared before and after, so a file that changed while it was read is exit 2
("FILE changed while it was read") and no summary says it was put.

``get`` writes by what FILE is (:func:`target_kind`): a regular file (or a new
path) gets a temporary file in the same directory, renamed over it only when
every byte arrived; a FIFO or a device is written in place through the ring,
never replaced (a FIFO's reader gets the bytes; ``/dev/null`` stays the
device); a directory is refused. The temporary file is ours alone, so it is
mapped and the bytes land in it without a copy; its blocks are allocated
first (``posix_fallocate``), so a full disk is a clear error, not a SIGBUS.
The temporary name is short and bounded (``.mpcomm-XXXXXXXX.tmp``), so a FILE
whose name is at the file system's limit (255 bytes) still works.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import stat
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mpcomm

from ._common import EXIT_USAGE, CliError

#: ``get`` targets, by what the path is.
REPLACE = "replace"  # a regular file, or nothing yet: temporary file + rename
IN_PLACE = "in place"  # a FIFO or a device: opened and written, never replaced

Slot = Callable[[memoryview, int], None]


def move_direct(engine: mpcomm.Engine, op: str, local: mpcomm.Region, remote: mpcomm.RemoteRegion,
                remote_offset: int, length: int, *, chunk: int, inflight: int, timeout: float | None,
                advance: Callable[[int], None] = lambda n: None) -> None:
    """Move ``length`` bytes between ``local`` (offset 0 on) and the remote range, in ``chunk`` requests,
    ``inflight`` at a time; the first error is raised after the rest are cancelled."""
    issue = engine.write if op == "write" else engine.read
    pending: deque[tuple[mpcomm.Transfer, int]] = deque()
    pos = 0
    try:
        while pos < length or pending:
            while pos < length and len(pending) < inflight:
                n = min(chunk, length - pos)
                pending.append((issue(local, remote, remote_offset + pos, n, local_offset=pos, timeout=timeout), n))
                pos += n
            t, n = pending.popleft()
            t.result()
            advance(n)
    except BaseException:
        for t, _ in pending:
            t.cancel(timeout=1.0)
        raise


def ring_move(engine: mpcomm.Engine, op: str, remote: mpcomm.RemoteRegion, remote_offset: int, length: int, *,
              chunk: int, inflight: int, timeout: float | None, fill: Slot | None = None,
              drain: Slot | None = None, advance: Callable[[int], None] = lambda n: None) -> None:
    """Move ``length`` bytes in ``chunk`` requests, ``inflight`` at a time, through one registered ring.

    For a write, ``fill(view, pos)`` puts the bytes at ``pos`` into a slot before
    its request is issued; for a read, ``drain(view, pos)`` takes them out once
    the request completed. Both run on one helper thread, in increasing ``pos``
    order, beside the requests (the local file's I/O overlaps the transfer
    instead of adding to it); a slot is reused only after its fill was sent or
    its drain finished. The first error, of a request or of fill/drain, is
    raised after the rest are cancelled.
    """
    step = min(chunk, length)
    count = -(-length // step)
    slots = min(inflight, count)
    ring = engine.allocate(step * slots)
    issue = engine.write if op == "write" else engine.read
    work = fill if op == "write" else drain
    helper = ThreadPoolExecutor(1, thread_name_prefix="mpcomm-file")
    local: list[Future[None] | None] = [None] * slots  # the slot's fill (write) or drain (read)
    pending: deque[tuple[mpcomm.Transfer, int]] = deque()

    def span(i: int) -> tuple[int, int, memoryview]:
        pos = i * step
        n = min(step, length - pos)
        at = (i % slots) * step
        return pos, n, ring.view[at:at + n]

    def start_work(i: int) -> None:
        if work is not None:
            pos, _n, view = span(i)
            local[i % slots] = helper.submit(work, view, pos)

    def slot_ready(i: int) -> None:
        f, local[i % slots] = local[i % slots], None
        if f is not None:
            f.result()

    failed = False
    try:
        if op == "write":
            for i in range(slots):
                start_work(i)
        index = 0
        while index < count or pending:
            while index < count and len(pending) < slots:
                slot_ready(index)  # write: its bytes are in; read: the slot's last bytes are out
                pos, n, _view = span(index)
                pending.append((issue(ring, remote, remote_offset + pos, n, local_offset=(index % slots) * step,
                                      timeout=timeout), index))
                index += 1
            t, i = pending.popleft()
            t.result()
            if op == "read":
                start_work(i)
            elif i + slots < count:
                start_work(i + slots)  # the slot is free: read ahead into it
            advance(span(i)[1])
        for i in range(count - slots, count):
            slot_ready(i)  # the last drains
    except BaseException:
        failed = True
        for t, _ in pending:
            t.cancel(timeout=1.0)
        raise
    finally:
        helper.shutdown(wait=True, cancel_futures=True)  # nothing touches the ring once it is unregistered
        try:
            engine.unregister(ring, timeout=5.0)
        except mpcomm.MpcommError:
            if not failed:  # after a failure the first error is the one to report
                raise


# -- put: a file that may change while it is read ---------------------------------


@dataclass
class SourceFile:
    """FILE opened for ``put``: its size and mtime when opened, and the sha256 of what was read
    (``digest`` None when not asked for: hashing costs more than the copy)."""

    path: Path
    fd: int
    size: int
    mtime_ns: int
    digest: "hashlib._Hash | None"

    @classmethod
    def open(cls, path: Path, *, digest: bool = True) -> SourceFile:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CliError(f"{path}: {exc.strerror}", EXIT_USAGE) from exc
        st = os.fstat(fd)
        if st.st_size == 0:
            os.close(fd)
            raise CliError(f"{path}: the file is empty; nothing to put", EXIT_USAGE)
        return cls(path, fd, st.st_size, st.st_mtime_ns, hashlib.sha256() if digest else None)

    def close(self) -> None:
        os.close(self.fd)

    def changed(self, why: str) -> CliError:
        return CliError(f"{self.path} changed while it was read ({why}); the remote range may hold part of it "
                        "or a mix of old and new bytes: put it again", EXIT_USAGE)

    def fill(self, view: memoryview, pos: int) -> None:
        """Read exactly ``len(view)`` bytes at ``pos`` into ``view`` (a slot of the ring)."""
        got = 0
        while got < len(view):
            try:
                n = os.preadv(self.fd, [view[got:]], pos + got)
            except OSError as exc:
                raise CliError(f"{self.path}: {exc.strerror}", EXIT_USAGE) from exc
            if n == 0:
                raise self.changed(f"it ended at {pos + got} bytes, {self.size} when it was opened")
            got += n
        if self.digest is not None:
            self.digest.update(view)

    def check_unchanged(self) -> None:
        """Raise unless the file still has the size and mtime it had when opened."""
        st = os.fstat(self.fd)
        if st.st_size != self.size:
            raise self.changed(f"{self.size} bytes when opened, {st.st_size} now")
        if st.st_mtime_ns != self.mtime_ns:
            raise self.changed("it was modified")


# -- get: a path written by what it is -----------------------------------------------


def target_kind(path: Path) -> str:
    """REPLACE or IN_PLACE for ``path``; a directory, a socket or an unreadable path is a usage error."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return REPLACE
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror}", EXIT_USAGE) from exc
    if stat.S_ISDIR(mode):
        raise CliError(f"{path}: is a directory", EXIT_USAGE)
    if stat.S_ISREG(mode):
        return REPLACE
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return IN_PLACE
    raise CliError(f"{path}: not a regular file, FIFO or device", EXIT_USAGE)


class Sink:
    """Where ``get`` writes ``size`` bytes: a temporary file renamed over FILE at :meth:`commit`, or FILE itself.

    For a regular FILE, :attr:`map` is the temporary file mapped (register it
    and read into it); otherwise it is None and :meth:`drain` writes FILE in
    order. :meth:`hexdigest` is the sha256 of what arrived (None when not asked for).
    """

    def __init__(self, path: Path, kind: str, size: int, *, digest: bool = True) -> None:
        self.path = path
        self.kind = kind
        self.written = 0
        self.digest = hashlib.sha256() if digest else None
        self.map: mmap.mmap | None = None
        if kind == REPLACE:
            # Rename over the file a symlink names, in its directory, so the link stays a link.
            self.final = Path(os.path.realpath(path)) if path.is_symlink() else path
            self.tmp: Path | None = _temp_next_to(self.final)
            self.fd = os.open(self.tmp, os.O_RDWR)
            try:
                _reserve(self.fd, size)
                self.map = mmap.mmap(self.fd, size, access=mmap.ACCESS_WRITE)
            except OSError as exc:
                self.close()
                raise CliError(f"{path}: cannot hold {size} bytes in {self.final.parent}: {exc.strerror}",
                               EXIT_USAGE) from exc
        else:
            self.final, self.tmp = path, None
            try:  # no O_CREAT, no O_TRUNC: the FIFO or device is used as it is
                self.fd = os.open(path, os.O_WRONLY)
            except OSError as exc:
                raise CliError(f"{path}: {exc.strerror}", EXIT_USAGE) from exc

    def drain(self, view: memoryview, pos: int) -> None:
        """Write the bytes of ``pos`` (they come in order) and add them to the digest."""
        if self.digest is not None:
            self.digest.update(view)
        done = 0
        while done < len(view):
            try:
                done += os.write(self.fd, view[done:])
            except OSError as exc:
                raise CliError(f"{self.path}: write failed after {self.written + done} bytes: {exc.strerror}",
                               EXIT_USAGE) from exc
        self.written += done

    def hexdigest(self) -> str | None:
        if self.digest is None:
            return None
        if self.map is not None:
            self.digest.update(self.map)
        return self.digest.hexdigest()

    def commit(self) -> None:
        """Make the bytes FILE's: fsync and rename the temporary file (in place: nothing left to do)."""
        if self.tmp is not None:
            self._unmap()
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.final)
            self.tmp = None
        self.close()

    def close(self) -> None:
        """Close; an uncommitted temporary file is removed (an existing FILE stays as it was)."""
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            self.tmp = None


    def _unmap(self) -> None:
        if self.map is not None:
            mm, self.map = self.map, None
            mm.flush()
            try:
                mm.close()
            except BufferError:  # a transport still holds a view (a failed request): the GC unmaps it
                pass


def _reserve(fd: int, size: int) -> None:
    """Give the file ``size`` bytes of real blocks, so that a full disk is this error and not a SIGBUS
    when the mapped pages are written (a file system without fallocate gets a sparse file)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _temp_next_to(file: Path) -> Path:
    """A new file in FILE's directory (so the rename is atomic) with FILE's mode, or 0666 & ~umask.

    Its name is ``.mpcomm-`` + 8 random characters + ``.tmp`` whatever FILE is
    called: a name built from FILE's would pass the 255-byte limit first.
    """
    parent = file.parent if str(file.parent) else Path(".")
    try:
        fd, name = tempfile.mkstemp(prefix=".mpcomm-", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise CliError(f"{file}: cannot create a file in {parent}: {exc.strerror}", EXIT_USAGE) from exc
    try:
        try:
            mode = os.stat(file).st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return Path(name)
