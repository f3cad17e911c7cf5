"""The memory both Mooncake backends transfer through: one :class:`BufferPool` registered with the
Mooncake client once, and a one-off registered :class:`Region` for a payload the pool cannot hold.

Imports no Mooncake module: each backend passes its own client's register and unregister calls
(``register_buffer`` of the store, ``register_memory`` of the transfer engine), so the lazy
connector registry still imports only the backend that is selected.
"""

from __future__ import annotations

from collections.abc import Callable

from omnirelay.errors import TransferFailed

from .buffers import Block, BufferPool, Region


class RegisteredPool:
    def __init__(self, nbytes: int, register: Callable[[int, int], int], unregister: Callable[[int], int],
                 backend: str):
        """Raises TransferFailed when the client refuses the pool; ``backend`` prefixes errors."""
        self.pool = BufferPool(nbytes)
        self._register, self._unregister, self._backend = register, unregister, backend
        if register(self.pool.address, self.pool.capacity) != 0:
            raise TransferFailed(f"{backend}: cannot register the buffer pool")

    def allocate(self, size: int) -> Block | Region:
        """A pool block, or a one-off registered buffer when the pool is full."""
        block = self.pool.allocate(size)
        if block is not None:
            return block
        try:
            return Region(size, self._register, self._unregister)
        except MemoryError as exc:
            raise TransferFailed(f"{self._backend}: {exc}") from None

    def close(self) -> None:
        """Unregister the pool and let go of the client: a backend that drops its own reference
        then has the client's destructor run (the transfer engine stops its threads there)."""
        self._unregister(self.pool.address)
        self._register = self._unregister = None
