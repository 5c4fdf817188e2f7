"""The tick schedule against literal tables (SPEC.md's worked example among them)."""

from partime.core import schedule


def test_worked_example_of_the_spec_d3_learning():
    rows = list(schedule.clock(6, depth=3, learning=True))
    assert rows[:6] == [
        ("F0", "", ""),
        ("F1", "F0", ""),
        ("F2", "F1", "F0 B0"),
        ("F3", "F2 B0", "F1 B1"),
        ("F4 B0", "F3 B1", "F2 B2"),
        ("F5 B1", "F4 B2", "F3 B3"),
    ]
    # drain: no new input; every gradient reaches stage 0 by tick N - 1 + 2(D - 1) = 9
    assert rows[6:] == [
        ("B2", "F5 B3", "F4 B4"),
        ("B3", "B4", "F5 B5"),
        ("B4", "B5", ""),
        ("B5", "", ""),
    ]


def test_inference_d2_three_samples():
    assert list(schedule.clock(3, depth=2, learning=False)) == [
        ("F0", ""),
        ("F1", "F0"),
        ("F2", "F1"),
        ("", "F2"),
    ]


def test_d1_learning_is_forward_then_backward_every_tick():
    assert list(schedule.clock(3, depth=1, learning=True)) == [("F0 B0",), ("F1 B1",), ("F2 B2",)]


def test_streams_shorter_than_the_pipeline():
    assert list(schedule.clock(1, depth=3, learning=False)) == [("F0", "", ""), ("", "F0", ""), ("", "", "F0")]
    assert list(schedule.clock(0, depth=3, learning=True)) == []


def test_counts_and_last_ticks():
    assert schedule.segment_ticks(6, 3, learning=True) == 10
    assert schedule.segment_ticks(6, 3, learning=False) == 8
    assert [schedule.last_tick(i, 6, 3, learning=True) for i in range(3)] == [9, 8, 7]
    assert [schedule.last_tick(i, 6, 3, learning=False) for i in range(3)] == [5, 6, 7]
    # while the stream goes on, every sample from 0 on exists
    assert schedule.forward_sample(2, 100) == 98
    assert schedule.backward_sample(0, 100, depth=3) == 96
    assert schedule.backward_sample(0, 3, depth=3) is None
