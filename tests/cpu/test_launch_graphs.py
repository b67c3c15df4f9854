"""Launch graphs of cached calls (fmha_rt/csrc/launch_graphs.c) on the CPU: a hit launches its plan as one
graph kept per (plan, stream), made on its first replay there (the recording call's, on its stream);
it launches one by one while the stream is being captured, while another call holds that graph, and
after making the graph failed; a failed graph launch raises like a failed launch and the next call
makes the graph anew; the table frees the least recently used graph for a new one, and
release_workspaces() frees them all.

The stand-in's graphs (fake_gpu.py) run their nodes through the same recorded launch path as launches
one by one, so what the driver stand-in records is what a graph's nodes would run.
"""
import threading

import pytest

import fmha_rt
from fmha_rt.plan import portable
from fmha_rt.runtime.backend import ffi, lib
from fmha_rt.errors import DriverError

from test_plan_cache import Inputs, bwd, call_inside_first_launch, fwd, hits, run_threads, unpack, warm


@pytest.fixture(autouse=True)
def two_launch_backward(monkeypatch):
    """The small problems here would take the one-launch backward, and the deterministic ones the ORDERED
    strategy (three launches): these tests want graphs of two nodes, the two-kernel backward's."""
    monkeypatch.setattr(portable, "SINGLE_MAX_SCORES", -1)
    monkeypatch.setattr(portable, "ORDERED_FOR_DETERMINISTIC", frozenset())


def graphs_kept() -> int:
    count = ffi.new("size_t *")
    assert lib.fmha_launch_graphs_kept(count) == lib.FMHA_OK
    return count[0]


def made(rt) -> list:
    """(token, nodes) of every graph made, in order."""
    return [(event[1], event[3]) for event in rt.graph_events if event[0] == "create"]


def test_hits_launch_one_graph_per_plan_and_stream_with_each_calls_pointers(rt, driver):
    x, y = Inputs(rt), Inputs(rt)
    bwd(x, deterministic=True, stream=0)()
    assert rt.graph_events == [], "a planned call launches one by one"
    planned = driver.take()
    bwd(x, deterministic=True, stream=0)()  # the second sighting: recorded, and launched as the plan's graph
    for inputs, stream in ((y, 0), (x, 0), (x, 0x10)):
        bwd(inputs, deterministic=True, stream=stream)()
    ((first, nodes), (second, _)) = made(rt)
    assert nodes == 2 and rt.graph_launches() == [(first, 0)] * 3 + [(second, 0x10)]
    launched = driver.take()
    assert [key for key, *_ in launched] == [key for key, *_ in planned] * 4
    assert launched[:2] == planned and launched[4:6] == planned, "a graph's nodes get what a planned call launches"
    dq_of_y = unpack(launched[2][0], launched[2][2])
    assert dq_of_y["Q"] == y.q.ptr and dq_of_y["dQ"] == y.dq.ptr
    assert graphs_kept() == 2 and hits() == 3 and not rt.callback_errors


def test_a_stream_being_captured_launches_one_by_one(rt, driver):
    x = Inputs(rt)
    warm(fwd(x, stream=0x20))
    ((token, _),) = made(rt)
    driver.take()
    rt.capturing.add(0x20)
    fwd(x, stream=0x20)()
    assert len(rt.graph_launches()) == 1 and len(driver.take()) == 1
    rt.capturing.clear()
    fwd(x, stream=0x20)()
    assert rt.graph_launches() == [(token, 0x20)] * 2 and len(made(rt)) == 1


def test_when_making_the_graph_fails_the_plan_launches_one_by_one_without_asking_again(rt, driver):
    x = Inputs(rt)
    rt.graph_failures["create"] = 1
    warm(fwd(x))  # the recording call fails to make the graph
    for _ in range(3):
        fwd(x)()
    assert rt.graph_events == [] and len(driver.take()) == 5 and rt.graph_failures["create"] == 0
    assert graphs_kept() == 1, "the slot remembers the failure"


def test_a_failed_graph_launch_names_the_call_kernel_and_device_and_the_next_call_makes_it_anew(rt, driver):
    x = Inputs(rt)
    warm(bwd(x, deterministic=True))
    keys = [key for key, *_ in driver.take()[-2:]]
    rt.graph_failures["launch"] = 1
    with pytest.raises(DriverError) as raised:
        bwd(x, deterministic=True)()
    assert raised.value.call == "fmha_launch" and raised.value.kernel == keys[0] and raised.value.device == 0
    bwd(x, deterministic=True)()
    ((first, _), (second, _)) = made(rt)
    assert ("destroy", first) in rt.graph_events and first not in rt.graphs and second in rt.graphs
    assert rt.graph_launches()[-1] == (second, 0)


def test_a_call_made_while_its_graph_is_held_launches_one_by_one(monkeypatch, rt, driver):
    """A cached call of the same plan and stream made from inside the graph's launch (as a launch
    callback could, or another thread at that moment) finds the graph held and does not wait for it."""
    outer, inner = Inputs(rt), Inputs(rt)
    warm(fwd(outer))  # the graph is made
    driver.take()
    call_inside_first_launch(monkeypatch, driver, fwd(inner))
    fwd(outer)()
    (outside, inside) = [unpack(key, packed) for key, _, packed, _ in driver.take()]
    assert outside["Q"] == outer.q.ptr and inside["Q"] == inner.q.ptr
    assert len(made(rt)) == 1 and len(rt.graph_launches()) == 2


def test_release_frees_every_graph_and_the_next_hit_makes_one_anew(rt, driver):
    x = Inputs(rt)
    warm(fwd(x, stream=0))
    fwd(x, stream=0x30)()
    assert graphs_kept() == 2
    fmha_rt.release_workspaces()
    assert graphs_kept() == 0 and rt.graphs == {}
    fwd(x, stream=0)()
    assert len(made(rt)) == 3


def test_the_least_recently_used_graph_makes_room_for_a_new_one(rt, driver):
    x = Inputs(rt)
    slots = lib.FMHA_LAUNCH_GRAPH_SLOTS
    streams = [0x100 + i for i in range(slots + 1)]
    warm(fwd(x, stream=streams[0]))
    for stream in streams[1:-1]:
        fwd(x, stream=stream)()
    fwd(x, stream=streams[0])()  # the first stream's graph is now the most recently used
    fwd(x, stream=streams[-1])()
    tokens = {stream: token for token, stream in rt.graph_launches()}
    assert [event for event in rt.graph_events if event[0] == "destroy"] == [("destroy", tokens[streams[1]])]
    assert graphs_kept() == slots and len(rt.graphs) == slots


def test_sixteen_threads_on_four_streams_launch_their_own_pointers_through_at_most_four_graphs(rt, driver):
    inputs = [Inputs(rt) for _ in range(16)]
    warm(bwd(inputs[0], deterministic=True, stream=0x40))
    driver.take()
    expected = {}

    def work(i, x):
        expected[threading.get_ident()] = x
        for _ in range(20):
            bwd(x, deterministic=True, stream=0x40 + i % 4)()

    errors = run_threads(work, list(enumerate(inputs)))
    assert not errors, errors
    assert len(driver.launches) == 16 * 20 * 2 and not rt.callback_errors
    for key, _, packed, stream, thread in driver.launches:
        x, args = expected[thread], unpack(key, packed)
        assert args["Q"] == x.q.ptr and args["dO"] == x.dout.ptr, key
    assert len(made(rt)) <= 4 and {stream for _, stream in rt.graph_launches()} <= {0x40, 0x41, 0x42, 0x43}
