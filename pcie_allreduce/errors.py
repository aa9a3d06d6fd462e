"""Exception types raised by pcie_allreduce."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete correctly; the communicator is unusable afterwards.

    Attributes name where it happened so a multi-rank log points at the culprit.
    """

    def __init__(self, message: str, *, rank: int = -1, peer: int = -1, stage: str = "", epoch: int = 0,
                 block: int = -1) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.stage = stage
        self.epoch = epoch
        self.block = block


class CollectiveTimeout(CollectiveError):
    """A rank waited longer than the communicator's timeout for a peer's data."""


class CollectiveMismatch(CollectiveError):
    """Ranks issued different collectives (size, dtype or algorithm) as the same call."""


class InterNodeError(CollectiveError):
    """A send or receive between nodes (the hierarchical all-reduce) failed or did not complete in
    time; ``stage`` names the step, ``peer`` the rank at its other end."""


class UnavailableError(RuntimeError):
    """The CUDA kernels cannot be used here (no extension, no GPU, or no peer access)."""


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (its type name if it has none), for error texts that
    quote another library's failure."""
    return " ".join(str(exc).split()) or type(exc).__name__
