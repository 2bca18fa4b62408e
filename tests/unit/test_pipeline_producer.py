"""The H2D pipeline's producer thread (``pipeline_thread: true``) without a GPU: items arrive in order, the
reader is closed whatever ends the load, an error reaches the consumer, the hand-over queue bounds how far the
producer runs ahead, and stopping early leaves no thread behind."""

import time

import pytest

pytest.importorskip("torch")

from vllm_fastload.streaming.pipeline import _Producer  # noqa: E402
from vllm_fastload.streaming.timing import StageTimes  # noqa: E402


class Reader:
    """A reader that counts what it handed out and whether it was closed."""

    def __init__(self, n):
        self.n, self.given, self.closed = n, 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.given == self.n:
            raise StopIteration
        self.given += 1
        return f"t{self.given - 1}", self.given - 1

    def close(self):
        self.closed = True


def times():
    return StageTimes().measures("consumer_wait_s")


def test_items_arrive_in_order_and_the_reader_is_closed():
    reader = Reader(5)
    p = _Producer(reader, lambda t: (t * 10, f"ev{t}"), lookahead=2, times=times())
    got = list(p.handed_over())
    p.stop()
    p.raise_error()
    assert got == [(f"t{i}", i * 10, f"ev{i}") for i in range(5)]
    assert reader.closed and not p.thread.is_alive()


def test_a_copy_error_reaches_the_consumer_after_the_items_before_it():
    def to_device(t):
        if t == 2:
            raise RuntimeError("copy of t2 failed")
        return t, None

    reader = Reader(5)
    p = _Producer(reader, to_device, lookahead=2, times=times())
    got = [name for name, _, _ in p.handed_over()]
    p.stop()
    assert got == ["t0", "t1"] and reader.closed
    with pytest.raises(RuntimeError, match="copy of t2 failed"):
        p.raise_error()


def test_the_queue_bounds_how_far_the_producer_runs_ahead_and_stop_ends_it():
    calls = []
    reader = Reader(100)
    p = _Producer(reader, lambda t: (calls.append(t), None), lookahead=2, times=times())
    time.sleep(0.5)  # the consumer reads nothing: the producer fills the queue, then holds one item
    assert len(calls) == 3
    p.stop()
    assert not p.thread.is_alive() and reader.closed
    assert [name for name, _, _ in p.dropped] == ["t2"]  # kept until the consumer waited for its copies
