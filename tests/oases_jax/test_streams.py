"""The two-stream engine against timelines worked out by hand."""

import pytest

from oases_jax.streams import COMM, COMPUTE, Streams, replay


def test_an_issued_collective_hides_behind_the_compute_before_its_done():
    # compute 2 | start a (3) | compute 1 | done a | compute 2:
    # a runs 2..5, the compute 2..3 covers 1 s of it, the wait ends at 5, the step at 7.
    s = Streams(events=10)
    s.add(COMPUTE, 2.0)
    a = s.issue(3.0, kind="all-reduce")
    s.add(COMPUTE, 1.0)
    s.wait(a)
    s.add(COMPUTE, 2.0)
    assert s.makespan == pytest.approx(7.0)
    assert (s.compute_s, s.comm_s) == (5.0, 3.0)
    assert s.covered() == {"all-reduce": (3.0, 1.0)}
    assert [(e.stream, e.start, e.end) for e in s.events] == [
        (COMPUTE, 0.0, 2.0), (COMM, 2.0, 5.0), (COMPUTE, 2.0, 3.0), (COMPUTE, 5.0, 7.0)]


def test_collectives_queue_on_their_stream():
    # two collectives issued back to back run one after the other: 0..2 then 2..5
    s = Streams()
    a, b = s.issue(2.0, name="a"), s.issue(3.0, name="b")
    s.add(COMPUTE, 4.0)
    s.wait(a, b)
    assert (s.end(a), s.end(b), s.makespan) == (2.0, 5.0, 5.0)
    assert s.covered() == {COMM: (5.0, 4.0)}
    # per collective: the compute 0..4 covers all of a (0..2) and 2 of b's 3 s (2..5)
    assert [(w.name, w.start, w.end, w.covered_s) for w in s.windows()] == [
        ("a", 0.0, 2.0, 2.0), ("b", 2.0, 5.0, 2.0)]
    assert [w.share for w in s.windows()] == pytest.approx([1.0, 2 / 3])


def test_a_dependency_graph_counts_compute_placed_before_the_window_opened():
    # A collective that depends only on the first compute task starts at 1 while the second
    # compute task (added before it, 1..4) still runs: that compute covers 2 of its 2 s.
    s = Streams()
    first = s.add(COMPUTE, 1.0)
    s.add(COMPUTE, 3.0)
    c = s.add("ep", 2.0, [first], kind="all-to-all")
    assert s.end(c) == 3.0
    assert s.covered() == {"all-to-all": (2.0, 2.0)}
    # a task on its own stream waits for the stream, then for its dependencies
    d = s.add("ep", 1.0, [c])
    assert s.end(d) == 4.0 and s.makespan == 4.0


def test_sync_waits_for_everything_in_flight():
    s = Streams()
    s.issue(5.0)
    s.sync()
    s.add(COMPUTE, 1.0)
    assert s.makespan == 6.0 and s.covered() == {COMM: (5.0, 0.0)}


def test_replay_of_an_op_list_overlapped_and_synchronous():
    ops = [("c", 2.0), ("start", "x", 3.0), ("c", 1.0), ("done", "x"), ("c", 2.0)]
    assert replay(ops) == (7.0, 5.0, 3.0)
    # synchronous: the collective runs alone at its start, 2 + 3 + 1 + 2
    assert replay(ops, overlap=False) == (8.0, 5.0, 3.0)
    # a start never waited on still ends the step; sync waits for it
    assert replay([("start", "y", 4.0), ("c", 1.0)]) == (4.0, 1.0, 4.0)
    assert replay([("start", "y", 4.0), ("sync",), ("c", 1.0)]) == (5.0, 1.0, 4.0)
