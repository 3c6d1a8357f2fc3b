"""One writer per output folder: `mhmoe-train` holds an exclusive `fcntl.flock` on `OUTPUT_DIR/.mhmoe-train.lock`
for the whole run, so a second run on the same folder stops at once with one line instead of interleaving its metrics
and checkpoints with the first. The kernel drops the lock when the process ends, however it ends (a killed run never
leaves a stale lock). The file itself stays (empty); removing it on exit would race with a waiting writer."""

from __future__ import annotations

import os

from .arguments import TrainingError

LOCK_FILE = ".mhmoe-train.lock"


class OutputDirLocked(TrainingError):
    """Another process holds the output folder's lock."""


class OutputDirLock:
    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self) -> OutputDirLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            who = f" (process {holder})" if holder.isdigit() else ""
            raise OutputDirLocked(
                f"another mhmoe-train is writing to {os.path.dirname(self.path)}{who}: wait for it to finish, or "
                "choose another --output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


__all__ = ["LOCK_FILE", "OutputDirLock", "OutputDirLocked"]
