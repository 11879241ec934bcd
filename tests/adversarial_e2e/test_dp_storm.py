"""The crash-class shapes (``attacks.CRASH_CLASS``: deep ``$defs`` chain, 3000-rule Lark,
deep JSON text, unmatchable constraints, 100k-deep tool-call arguments) fired at once at a
``--data-parallel-size 2`` endpoint while greedy neighbours stream and ``/health`` is polled:
every one a 400 naming its field, no replica process dies or restarts, the neighbours' outputs
are their solo outputs. The endpoint and its Ray runtime run in a child process
(``storm_child.data_parallel``)."""

import pytest

from tests.adversarial_e2e.attacks import CRASH_CLASS, NEIGHBOUR_PROMPTS
from tests.adversarial_e2e.conftest import require_alive
from tests.adversarial_e2e.storm import HEALTH_LATENCY_BOUND_S, neighbour_problems

# a Ray runtime and two replicas: tens of seconds on 2 shared cores
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp(dp_run):
    return require_alive(dp_run)["dp"]


def test_no_replica_died(dp):
    replicas = dp["replicas"]
    assert replicas["pids_after"] == replicas["pids_before"]
    assert replicas["restarts"] == [0, 0] and replicas["states"] == ["up", "up"]
    assert dp["after"] == dp["solo"] and dp["in_flight"] == 0


def test_crash_class_shapes_are_400s_naming_the_field(dp):
    assert [r["name"] for r in dp["attacks"]] == [a.name for a in CRASH_CLASS]
    assert [(r["name"], r["problem"]) for r in dp["attacks"] if r["problem"]] == []
    assert dp["counts"]["5xx"] == 0 and dp["counts"]["4xx"] == len(CRASH_CLASS)


def test_neighbours_and_health_unaffected(dp, capsys):
    assert set(dp["neighbours"]) == set(NEIGHBOUR_PROMPTS)
    assert neighbour_problems(dp["neighbours"], dp["solo"]) == []
    health = dp["health"]
    with capsys.disabled():
        print(f"\ndata-parallel storm: {dp['counts']}, /health max latency {health['max_latency_s']:.3f} s")
    assert health["failures"] == [] and health["max_latency_s"] < HEALTH_LATENCY_BOUND_S
