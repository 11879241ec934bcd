"""``worker.calibrate_threads``: the CPU thread count re-measured while the engine runs."""

import itertools

import torch

from kvserve.worker import worker


def test_env_override_and_result_applied(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")
        assert worker.calibrate_threads(2) == 1 and torch.get_num_threads() == 1
        monkeypatch.delenv("KVSERVE_NUM_THREADS")
        n = worker.calibrate_threads(2)
        assert n in (1, 2) and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_a_passing_disturbance_does_not_pick_one_thread(monkeypatch):
    """The two counts are timed alternately, best of each: a disturbance over the first three
    measurements (another process starting) must not choose 1 thread when 2 are otherwise
    faster. Timing one count's repetitions back to back did exactly that."""
    monkeypatch.delenv("KVSERVE_NUM_THREADS", raising=False)
    clock = itertools.count()
    now = [0.0]
    slot = [0]

    def fake_counter():  # start/end pairs; 2 threads take 10, 1 thread 17, x10 early
        if next(clock) % 2 == 0:
            return now[0]
        base = 10.0 if torch.get_num_threads() == 2 else 17.0
        now[0] += base * (10 if slot[0] < 3 else 1)
        slot[0] += 1
        return now[0]

    monkeypatch.setattr(worker.time, "perf_counter", fake_counter)
    before = torch.get_num_threads()
    try:
        assert worker.calibrate_threads(2, hidden=32, reps=3) == 2
    finally:
        torch.set_num_threads(before)
