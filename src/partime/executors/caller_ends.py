"""The caller's ends of a pipeline's links: samples and targets in, results out.

Every executor whose stages run in workers of their own feeds stage 0 and the last stage through a
``Feeder`` and reads the last stage's results with ``result_of``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..checkpoint.files import message as transit_message
from ..core.boundary_values import ValueSpec, as_tensors, rebuild
from ..result import Result
from .messages import KIND_DATA, KIND_END, KIND_PREDICT, KIND_SKIP, Message


class Feeder:
    """The caller's end of stage 0's input link and of the last stage's target link (or None).

    It counts the samples fed in the current segment (``fed``) and remembers the targets fed that
    the last stage has not used yet (the ``"targets"`` of a checkpoint's transit): the last stage
    takes sample s's target in the tick that sends out sample s's result, so a target is used once
    its result has come out (``used``).
    """

    def __init__(self, inputs: Any, targets: Any | None, depth: int):
        self.inputs, self.targets, self.depth = inputs, targets, depth
        self.fed = 0
        self._unused: deque[dict[str, Any]] = deque()

    def resume(self, transit: dict[str, Any] | None, check: Callable[[], None]) -> None:
        """Go on from a checkpoint's ``transit`` (None: between two segments): its count of samples
        fed, and its targets not used yet, sent again."""
        if transit is not None:
            self.fed = transit["tick"]
            for target in transit["targets"]:
                self.target(target["sample"], tuple(target["tensors"]), check)

    def feed(self, index: int, x: Any, y: Any, check: Callable[[], None], learn: bool = True) -> None:
        """Send sample ``index`` and its target; ``x`` None is a skipped sample: a hole, sent without
        a target; ``learn`` False a sample only predicted: a PREDICT, sent without a target."""
        if x is None:
            self.inputs.put(KIND_SKIP, index, check=check)
        elif not learn:
            self.inputs.put(KIND_PREDICT, index, as_tensors(x, "sample"), check=check)
        else:
            self.inputs.put(KIND_DATA, index, as_tensors(x, "sample"), check=check)
            if self.targets is not None:
                self.target(index, as_tensors(y, "target"), check)
        self.fed += 1

    def used(self, index: int) -> None:
        """The result of sample ``index`` has come out: its target, and those before, are used."""
        while self._unused and self._unused[0]["sample"] <= index:
            self._unused.popleft()

    def target(self, index: int, tensors: tuple[Tensor, ...], check: Callable[[], None]) -> None:
        """Send sample ``index``'s target (also: a checkpoint's targets in transit, when resuming).

        The link sends the last stage a copy; ``tensors`` themselves are kept as they are, to be
        copied only into a checkpoint (``in_transit``): the pipeline's own copy
        (``Executor.feed``), or a checkpoint's, which no stage is handed."""
        if self.targets is None:
            raise ValueError(f"sample {index} has a target, but the last stage takes none")
        self.targets.put(KIND_DATA, index, tensors, check=check)
        if self.depth > 1:  # with one stage, a target is used in the tick it is fed
            self._unused.append({"sample": int(index), "tensors": list(tensors)})

    def end(self, check: Callable[[], None]) -> int:
        """End the segment; the number of samples it had."""
        samples, self.fed = self.fed, 0
        self.inputs.put(KIND_END, samples, check=check)
        self._unused.clear()
        return samples

    def in_transit(self) -> list[dict[str, Any]]:
        """The targets fed that the last stage has not used yet, as ``checkpoint.message`` dicts of
        copies (the tensors kept become the results' targets, which the caller may change)."""
        return [transit_message(m["sample"], m["tensors"]) for m in self._unused]


def result_of(message: Message, output: ValueSpec, learning: bool) -> Result:
    """The ``Result`` a message on the last stage's result link stands for."""
    if not message.tensors:  # a skipped input: it never went forward
        return Result(message.index, None, None, skipped=True)
    if message.kind == KIND_PREDICT:
        return Result(message.index, rebuild(output, message.tensors), None, predicted=True)
    return Result(
        message.index,
        rebuild(output, message.tensors),
        message.scalar if learning else None,
        skipped=message.kind == KIND_SKIP,
    )
