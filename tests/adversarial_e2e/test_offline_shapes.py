"""The attack shapes through the offline API (``attacks.OFFLINE_ATTACKS``) on one engine:
every bad constraint or field is a ValueError naming the field, nothing of it stays queued or
holds a KV block or a grammar matcher, the heavy-but-legal calls succeed, and the engine's
greedy outputs are the same after all of them as before. Run in the child process of
``storm_child.py`` (the deep shapes must not be able to crash pytest)."""

import math
import re

import pytest

from tests.adversarial_e2e.attacks import OFFLINE_ATTACKS, SERVER_KWARGS
from tests.adversarial_e2e.conftest import require_alive


@pytest.fixture(scope="module")
def run(single_run):
    return require_alive(single_run)


@pytest.fixture(scope="module")
def offline(run):
    return run["offline"]


def _names_field(message: str, field: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(field)}(?![\w])", message) is not None


def test_every_offline_shape_ran(offline):
    assert [r["name"] for r in offline["results"]] == [a.name for a in OFFLINE_ATTACKS]


@pytest.mark.parametrize("attack", [a for a in OFFLINE_ATTACKS if a.field], ids=lambda a: a.name)
def test_a_bad_shape_is_a_value_error_naming_the_field(offline, attack):
    got = next(r for r in offline["results"] if r["name"] == attack.name)
    assert got["raised"] == "ValueError", got
    assert _names_field(got["message"], attack.field), got["message"]
    assert "Traceback" not in got["message"] and "\n" not in got["message"], got["message"]


def test_nothing_stays_queued_or_held_after_any_shape(offline):
    for got in offline["results"]:
        state = got["state"]
        assert (state["waiting"], state["running"], state["swapped"], state["unfinished"]) == (0, 0, 0, 0), (
            got
        )
        assert state["free_gpu_blocks"] == state["gpu_blocks"] == SERVER_KWARGS["num_gpu_blocks"], got
        assert state["live_matchers"] == 0, got


def test_heavy_legal_calls_succeed(offline, run):
    legal = [r for r in offline["results"] if r["field"] is None]
    assert len(legal) == sum(1 for a in OFFLINE_ATTACKS if a.field is None) >= 4
    for got in legal:
        assert got["raised"] is None, got
        assert all(o == "finished" for o in got.get("outcomes", ["finished"])), got
        assert not any(math.isnan(s) for s in got.get("scores", [])), got
    rows = next(r["prompt_logprob_rows"] for r in legal if "prompt_logprob_rows" in r)
    assert rows == run["long_prompt_lens"]


def test_the_engine_keeps_working(offline):
    assert offline["after"] == offline["before"] and all(offline["before"])
    assert offline["errors_logged"] == []
