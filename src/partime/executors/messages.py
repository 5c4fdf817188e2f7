"""The messages that every link carries, and the table of their kinds.

A ``Message`` is what a link's ``get`` returns, whatever carries it: a shared-memory
``process.shared_memory.Channel``, a ``handoff.Handoff`` between threads, or a
``distributed.link.RankLink`` between ranks. Its ``kind`` says what it is: the data kinds go
along every link of every executor; the control kinds only between the ranks of the distributed
executor (rank 0 and the rank that serves a stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

# -- data: every executor -------------------------------------------------------------------------

KIND_DATA = 1
"""A message that carries one value (its tensors) for sample ``index``."""
KIND_END = 2
"""The producer will send nothing more; ``index`` says how many samples it sent."""
KIND_SKIP = 8
"""Sample ``index`` was skipped (``nonfinite="skip"``): a hole going forward (no tensors), a
gradient that will not come going back, or a result without learning (its output, if any, and
loss)."""
KIND_PREDICT = 10
"""Sample ``index`` is only predicted, not learnt from (``Pipeline.predict``): its value going
forward (the same tensors as a DATA), or its result (its output; no loss). Its gradient that will
not come goes back as a SKIP."""

# -- control: the distributed executor, between rank 0 and rank r ---------------------------------

KIND_PERMIT = 3
"""Rank 0 to rank r: ``index`` ticks have been offered in all (permits only grow)."""
KIND_STATE = 4
"""A stage's ``state_dict`` tensors: its first weights (0 to r), or a snapshot (r to 0)."""
KIND_SNAPSHOT = 5
"""Rank 0 to rank r: send the weights as they are once ``index`` ticks are done."""
KIND_CHECKPOINT = 9
"""Rank 0 to rank r: put this stage's part of a checkpoint in the store once ``index`` ticks are done
(``scalar``: the tick of the segment it is taken at); rank r to 0, without tensors: it is there."""
KIND_PING = 6
"""Nothing: keeps an idle link inside gloo's timeout."""
KIND_CLOSE = 7
"""The last message on a link."""


@dataclass(slots=True)
class Message:
    """What a link's ``get`` returns, whatever carries it.

    ``tensors`` are fresh tensors owned by the receiver; empty when the producer sent none
    (as for ``KIND_END``).
    """

    kind: int
    index: int
    scalar: float
    tensors: tuple[Tensor, ...]
