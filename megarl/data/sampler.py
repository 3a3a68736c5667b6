"""A deterministic, resumable prompt sampler.

The order of epoch ``e`` is a pure function of ``(seed, e)`` (NumPy's ``default_rng([seed, e])``
permutation), so the sampler's whole state is two integers, ``epoch`` and ``position``. Saving them
in a checkpoint and loading them back continues with exactly the prompts an uninterrupted run would
have drawn next — the property resume tests check.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class ResumableSampler:
    """Draws batches of row indices, epoch after epoch, in a seeded order.

    Args:
        num_rows: dataset size (> 0).
        seed: seed of the per-epoch permutation.
        shuffle: False keeps file order in every epoch.

    Raises:
        ValueError: ``num_rows`` < 1.
    """

    def __init__(self, num_rows: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_rows < 1:
            raise ValueError(f"ResumableSampler: num_rows must be >= 1, got {num_rows}")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_indices(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` row indices; a batch may span an epoch boundary.

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out: list[int] = []
        while len(out) < batch_size:
            if self.position >= self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(batch_size - len(out), self.num_rows - self.position)
            out.extend(int(i) for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: ``num_rows``, ``seed``, ``shuffle``, ``epoch``, ``position``."""
        return {"num_rows": self.num_rows, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: the saved state was for a different dataset size, seed or shuffle setting
                (resuming would silently draw other prompts).
        """
        for key in ("num_rows", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state mismatch: saved {key}={state[key]!r}, "
                                 f"current {key}={getattr(self, key)!r}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
