"""The app's flow control keeps what the streams' queues hold when flow resumes within a generation."""

from __future__ import annotations

from mode.utils.queues import FlowControlQueue

from rankwatch.stream_processors.app import FlowControl


def _queue_and_control():
    generation = [1]
    control = FlowControl(lambda: generation[0])
    queue = FlowControlQueue(flow_control=control, clear_on_resume=True)
    return generation, control, queue


def test_resuming_within_the_generation_of_the_last_clear_keeps_the_queues():
    generation, control, queue = _queue_and_control()
    control.resume()  # the first resume empties the queues, as Faust's does
    queue.put_nowait("before the rebalance")
    control.suspend()
    control.clear()  # a rebalance starts: what the queues hold is dropped
    assert queue.empty()
    generation[0] = 2
    queue.put_nowait("of the old generation, put in late")
    control.resume()  # recovery starts in the new generation: emptied once more
    assert queue.empty() and control.is_active()
    queue.put_nowait(361)
    queue.put_nowait(362)
    control.resume()  # recovery ends: a fetch loop halfway through a batch puts 363 next
    queue.put_nowait(363)
    assert [queue.get_nowait() for _ in range(3)] == [361, 362, 363]
    assert control.is_active()


def test_a_new_generation_empties_the_queues_on_resume_even_without_a_clear():
    generation, control, queue = _queue_and_control()
    control.resume()
    queue.put_nowait("of generation 1")
    generation[0] = 2
    control.resume()
    assert queue.empty()
