"""Tests for partime.executors.process.shared_memory: values cross processes exactly, channels are bounded, waits abort."""

from __future__ import annotations

import gc
import math
import multiprocessing
import os

import pytest
import torch
import torch.multiprocessing as mp

from partime.core.boundary_values import TensorSpec
from partime.executors.messages import KIND_DATA, KIND_END, Message
from partime.executors.process.shared_memory import Channel
from partime.executors.waiting import POLL_S, Aborted, wait

CTX = mp.get_context("spawn")
PAIR = [TensorSpec((3, 4), torch.float32), TensorSpec((5,), torch.int64)]
KIND_OTHER = 7  # a kind a caller might add, sent without tensors


def _collect_then_echo(inbox: Channel, outbox: Channel) -> None:
    """Child: receive every message up to END, then send them all back unchanged, END last."""
    received = []
    while True:
        msg = inbox.get()
        received.append(msg)
        if msg.kind == KIND_END:
            break
    for msg in received:
        outbox.put(msg.kind, msg.index, msg.tensors, msg.scalar)


def _messages(n: int) -> list[Message]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        a = torch.randn(3, 4, generator=g)
        b = torch.randint(-(2**40), 2**40, (5,), generator=g, dtype=torch.int64)
        out.append(Message(KIND_DATA, i, 0.25 * i - 1.0, (a, b)))
    out.append(Message(KIND_OTHER, 123, math.pi, ()))
    out.append(Message(KIND_END, n, 0.0, ()))
    return out


def _sem_files(ch: Channel) -> list[str]:
    names = [sem._semlock.name for sem in (ch._free, ch._filled)]
    return ["/dev/shm/sem." + name.lstrip("/") for name in names]


def test_values_round_trip_exactly_through_a_spawned_process() -> None:
    down = Channel(CTX, PAIR, capacity=2, name="down")
    up = Channel(CTX, PAIR, capacity=2, name="up")
    sent = _messages(9)  # 9 samples wrap the 2-slot ring several times
    child = CTX.Process(target=_collect_then_echo, args=(down, up), daemon=True)

    def child_alive() -> None:
        if not child.is_alive():
            raise RuntimeError(f"child ended with exit code {child.exitcode}")

    child.start()
    try:
        for m in sent:
            down.put(m.kind, m.index, m.tensors, m.scalar, check=child_alive)
        back = [up.get(check=child_alive) for _ in sent]
        child.join(timeout=10)
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
    assert child.exitcode == 0
    assert [(m.kind, m.index, m.scalar) for m in back] == [(m.kind, m.index, m.scalar) for m in sent]
    for got, want in zip(back, sent):
        assert len(got.tensors) == len(want.tensors)
        for g, w in zip(got.tensors, want.tensors):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w)
    assert multiprocessing.active_children() == []
    if os.path.isdir("/dev/shm"):
        files = _sem_files(down) + _sem_files(up)
        del down, up
        gc.collect()
        assert [f for f in files if os.path.exists(f)] == []
        mine = f"torch_{os.getpid()}_"
        assert [f for f in os.listdir("/dev/shm") if f.startswith(mine)] == []


@pytest.mark.parametrize(
    "spec",
    [
        TensorSpec((), torch.float64),
        TensorSpec((2, 3), torch.float16),
        TensorSpec((4,), torch.bool),
        TensorSpec((2, 2), torch.bfloat16),
    ],
)
def test_one_tensor_round_trips_in_one_process(spec: TensorSpec) -> None:
    ch = Channel(CTX, [spec], capacity=3)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(spec.shape, generator=g).to(spec.dtype) for _ in range(5)]
    for i, v in enumerate(values):  # put and get in step, so the ring wraps
        ch.put(KIND_DATA, i, (v,), scalar=float(i))
        msg = ch.get()
        assert (msg.kind, msg.index, msg.scalar) == (KIND_DATA, i, float(i))
        assert msg.tensors[0].dtype == spec.dtype and torch.equal(msg.tensors[0], v)


def test_get_returns_fresh_tensors_and_put_copies_detached() -> None:
    ch = Channel(CTX, [TensorSpec((4,), torch.float32)], capacity=1)
    x = torch.ones(4, requires_grad=True)
    ch.put(KIND_DATA, 0, (x * 2,))
    first = ch.get().tensors[0]
    assert not first.requires_grad and first.grad_fn is None
    ch.put(KIND_DATA, 1, (torch.zeros(4),))  # reuses the only slot
    assert first.tolist() == [2.0, 2.0, 2.0, 2.0]
    first.fill_(5.0)
    assert ch.get().tensors[0].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_a_put_whose_copy_fails_sends_nothing_and_keeps_its_slot() -> None:
    ch = Channel(CTX, [TensorSpec((4,), torch.float32)], capacity=1)
    with pytest.raises(NotImplementedError, match="meta"):
        ch.put(KIND_DATA, 0, (torch.zeros(4, device="meta"),))
    ch.put(KIND_DATA, 1, (torch.arange(4.0),))  # would block forever had the slot been lost
    msg = ch.get()
    assert (msg.index, msg.tensors[0].tolist()) == (1, [0.0, 1.0, 2.0, 3.0])


def test_a_full_channel_blocks_the_producer_until_the_check_raises() -> None:
    ch = Channel(CTX, [TensorSpec((2,), torch.float32)], capacity=2, name="bounded")
    ch.put(KIND_DATA, 0, (torch.tensor([0.0, 0.5]),))
    ch.put(KIND_DATA, 1, (torch.tensor([1.0, 1.5]),))
    polls = []

    def give_up() -> None:
        polls.append(1)
        if len(polls) == 3:
            raise Aborted("stop waiting")

    with pytest.raises(Aborted, match="stop waiting"):
        ch.put(KIND_DATA, 2, (torch.tensor([2.0, 2.5]),), check=give_up)
    assert len(polls) == 3
    # The aborted put sent nothing and took no slot: the two messages come out, then a free slot.
    assert [ch.get().tensors[0].tolist() for _ in range(2)] == [[0.0, 0.5], [1.0, 1.5]]
    ch.put(KIND_END, 2)
    msg = ch.get()
    assert (msg.kind, msg.index, msg.tensors) == (KIND_END, 2, ())


def test_get_on_an_empty_channel_propagates_what_the_check_raises() -> None:
    ch = Channel(CTX, [TensorSpec((2,), torch.float32)])

    def aborted() -> None:
        raise Aborted("run over")

    with pytest.raises(Aborted, match="run over"):
        ch.get(check=aborted)
    ch.put(KIND_END, 0)  # the aborted get took nothing
    msg = ch.get(check=aborted)
    assert (msg.kind, msg.index, msg.tensors) == (KIND_END, 0, ())


def test_wait_spins_then_polls_and_propagates_any_error() -> None:
    sem = CTX.Semaphore(1)
    wait(sem, None)  # available: no check needed
    calls = []

    def fail() -> None:
        calls.append(1)
        raise KeyError("peer died")

    with pytest.raises(KeyError, match="peer died"):
        wait(sem, fail, spin_s=0.0, poll_s=0.01)
    assert len(calls) == 1
    sem.release()
    wait(sem, fail, spin_s=0.0, poll_s=0.01)
    assert len(calls) == 1
    assert POLL_S > 0


def test_spec_mismatch_names_channel_position_and_both_specs() -> None:
    ch = Channel(CTX, PAIR, name="acts")
    a, b = torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"'acts'.*tensor 0 is \(4, 3\) float32.*\(3, 4\) float32"):
        ch.put(KIND_DATA, 0, (torch.zeros(4, 3), b))
    with pytest.raises(ValueError, match=r"tensor 1 is \(5,\) int32.*\(5,\) int64"):
        ch.put(KIND_DATA, 0, (a, b.int()))
    with pytest.raises(ValueError, match=r"got 1 tensors .* expected 2"):
        ch.put(KIND_DATA, 0, (a,))
    with pytest.raises(ValueError, match=r"got 0 tensors for a message of kind 1"):
        ch.put(KIND_DATA, 0)
    with pytest.raises(ValueError, match=r"capacity must be an int >= 1, got 0"):
        Channel(CTX, PAIR, capacity=0)
    # None of the failed puts took a slot.
    ch.put(KIND_DATA, 0, (a, b))
    ch.put(KIND_DATA, 1, (a, b))
    assert [ch.get().index for _ in range(2)] == [0, 1]
