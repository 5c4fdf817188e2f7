"""A stage's own random stream: what its forwards draw, the same under every executor.

A pipeline takes the caller's random state (torch's CPU generator) when it is made and gives it
to every stage (``StageConfig.random_state``). Stage 0 continues that state; stage ``i > 0``
draws from a stream derived from it and ``i`` (``derived``). A stage's forwards and its loss run
with the process's random stream set to the stage's own (``RandomStream.drawing``), so what
dropout draws in a stage does not depend on where the stage runs, on what the other stages draw
or on what the caller draws between ticks. A forward run again for a product draws what the
sample's own forward drew (``RandomStream.replaying``, with the state the forward started from).

The process's stream is one for all its threads (torch's CPU default generator, and dropout cannot
be given another): a stage swaps its own in only while it holds the process's turn at it
(``random_turns.TURNS``), which keeps the stages' draws, the caller's and a live source's apart.
A stage whose first forward draws nothing is taken to draw nothing, and runs without the turn
from then on. The stream is torch's CPU generator; a stage on a CUDA device draws from that
device's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ..random_turns import TURNS


def derived(origin: Tensor, stage: int) -> Tensor:
    """The random state stage ``stage`` starts from, given the pipeline's ``origin``: ``origin``
    itself at stage 0, else a generator seeded by a hash of ``origin`` and ``stage``."""
    if stage == 0:
        return origin.clone()
    digest = hashlib.sha256(origin.numpy().tobytes() + stage.to_bytes(8, "little")).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator.get_state()


class RandomStream:
    """The random stream of stage ``stage`` of a pipeline made with random state ``origin``."""

    def __init__(self, stage: int, origin: Tensor):
        self.state = derived(origin, stage)  # replaced, never changed in place: a record may hold it
        self.draws: bool | None = None  # whether its forwards draw; None until one has run

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Within it, the process's random stream is this stage's; after it, the stage's stream has
        moved on by what was drawn, and the process's is as it was."""
        if self.draws is False:
            yield
            return
        with TURNS.swapping():
            outer = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                yield
            finally:
                after = torch.get_rng_state()
                if self.draws is None:
                    self.draws = not torch.equal(after, self.state)
                    if not self.draws:
                        TURNS.draws_nothing()
                self.state = after
                torch.set_rng_state(outer)

    @staticmethod
    @contextmanager
    def replaying(state: Tensor | None) -> Iterator[None]:
        """Within it, the process's random stream starts at ``state`` (None: as it is); after it,
        the process's is as it was."""
        if state is None:
            yield
            return
        with TURNS.swapping():
            outer = torch.get_rng_state()
            torch.set_rng_state(state)
            try:
                yield
            finally:
                torch.set_rng_state(outer)
