"""UploadLimits: what the UploadAdapter streams of one server (one replica with ``--ray``) may
hold at once: at most ``--max-concurrent-uploads`` streams, and ``--upload-disk-budget``
bytes of weights on disk among them (adapter_upload.py takes a lease per stream).

What counts: an upload from its first message until it is loaded, refused or cut. An
adapter once loaded no longer counts: it is a registered adapter like any other (the admin
unloads it; in the private store its directory goes with it), and with a shared
``--upload-dir`` no replica knows when another stops reading a file.

Invariants: used only on the server's event loop (no lock); a lease reserves bytes before
they are written; ``held`` and ``in_flight`` are the sums over the open leases, and a lease
gives back everything it holds exactly once (``release``, also on exit from ``with``).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from ..error_code import ErrorCode, ServiceError
from ..server_options import ServerOptions

if TYPE_CHECKING:
    from typing_extensions import Self


class UploadLease:
    """One upload's place: counted in flight until released, with the bytes it reserved."""

    def __init__(self, limits: UploadLimits):
        self._limits = limits
        self.bytes = 0
        self.open = True

    def reserve(self, n: int) -> None:
        """Hold ``n`` more bytes of the budget (RESOURCE_EXHAUSTED when they do not fit)."""
        self._limits._reserve(self, n)

    def release(self) -> None:
        if self.open:
            self.open = False
            self._limits._release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class UploadLimits:
    def __init__(self, max_uploads: int, budget: int):
        self.max_uploads = max_uploads
        self.budget = budget
        self.in_flight = 0  # open leases
        self.held = 0  # bytes the open leases reserved

    @classmethod
    def from_options(cls, options: ServerOptions) -> UploadLimits:
        return cls(options.max_concurrent_uploads, options.upload_budget)

    def admit(self) -> UploadLease:
        """A lease for one more upload, or RESOURCE_EXHAUSTED when the cap is reached."""
        if self.in_flight >= self.max_uploads:
            raise ServiceError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"{self.in_flight} uploads are in flight, the most --max-concurrent-uploads "
                f"({self.max_uploads}) allows; retry once one has ended")
        self.in_flight += 1
        return UploadLease(self)

    def _reserve(self, lease: UploadLease, n: int) -> None:
        if not lease.open:
            raise RuntimeError("reserve on a released upload lease")
        if self.held + n > self.budget:
            others = self.held - lease.bytes
            raise ServiceError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the upload needs {lease.bytes + n} bytes of disk, and with the "
                f"{others} bytes other uploads in flight hold that passes "
                f"--upload-disk-budget ({self.budget} bytes); retry once they have ended, "
                "or send less")
        lease.bytes += n
        self.held += n

    def _release(self, lease: UploadLease) -> None:
        self.in_flight -= 1
        self.held -= lease.bytes
        lease.bytes = 0
