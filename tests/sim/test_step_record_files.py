"""Malformed and mismatched step-record files (``bench fidelity --steps-out``) for
``load_steps`` and ``load_replay``: a ``steps`` that is not a list, a ``meta`` or ``trace`` that
is not an object, a shape count that is a string, or a cost model profiled with another block
size or dtype than the recorded engine is a ``ValueError`` naming the field; any file either
loads or raises ``ValueError``."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.sim.cost_model_file import parse_cost_model
from kvserve.sim.step_record import StepRecord, check_recorded_engine, load_steps, save_steps
from kvserve.sim.step_shape import StepShape
from tests.sim.test_cost_model_file import profile_data

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _valid(engine=None) -> dict:
    recs = [
        StepRecord(
            StepShape(prefill_tokens=64, prefill_seqs=1, prefill_attn_pairs=2.08, sampled_rows=1), 0.02
        ),
        StepRecord(
            StepShape(decode_seqs=3, context_tokens=90, sampled_rows=3), 0.01, 0.008, 0.011, 0.0, 1, 3, 0
        ),
    ]
    meta = {
        "trace": {"path": "t.csv"},
        "engine": engine or {"block_size": 16, "dtype": "float32", "model": None},
    }
    return {
        "schema": "kvserve-steps",
        "schema_version": 1,
        "meta": meta,
        "steps": [r.as_dict() for r in recs],
    }


def _write(tmp_path, data, name="steps.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize(
    "patch, match",
    [
        (lambda d: d.update(steps=5), r"steps must be a list"),
        (lambda d: d.update(steps=None), r"steps must be a list"),
        (lambda d: d.update(meta=[1]), r"meta must be an object"),
        (lambda d: d["steps"].append("x"), r"steps\[2\]: must be an object"),
        (lambda d: d["steps"][0].update(shape=[1, 2]), r"steps\[0\]\.shape: must be an object"),
        (
            lambda d: d["steps"][0]["shape"].update(decode_seqs="3"),
            r"steps\[0\]\.shape\.decode_seqs must be an integer",
        ),
        (
            lambda d: d["steps"][0]["shape"].update(decode_seqs=-1),
            r"steps\[0\]\.shape\.decode_seqs must be an integer",
        ),
        (
            lambda d: d["steps"][0]["shape"].update(decode_seqs=2.5),
            r"steps\[0\]\.shape\.decode_seqs must be an integer",
        ),
        (lambda d: d["steps"][0]["shape"].update(bogus=1), r"steps\[0\]\.shape: unknown field"),
        (lambda d: d["steps"][1].update(step_s="fast"), r"steps\[1\]\.step_s must be a finite number"),
        (lambda d: d["steps"][1].update(step_s=-0.1), r"steps\[1\]\.step_s must be a finite number"),
        (lambda d: d["steps"][1].update(num_waiting=True), r"steps\[1\]\.num_waiting must be an integer"),
        (lambda d: d["steps"][1].update(extra=1), r"steps\[1\]: unknown field"),
        (lambda d: d["steps"][1].pop("step_s"), r"steps\[1\]: missing field 'step_s'"),
    ],
)
def test_malformed_step_records_are_value_errors_naming_the_field(tmp_path, patch, match):
    data = _valid()
    patch(data)
    with pytest.raises(ValueError, match=match):
        load_steps(_write(tmp_path, data))


def test_non_finite_times_are_refused(tmp_path):
    p = tmp_path / "nan.json"
    p.write_text(json.dumps(_valid()).replace('"step_s": 0.01', '"step_s": NaN'))
    with pytest.raises(ValueError, match=r"steps\[1\]\.step_s must be a finite number"):
        load_steps(p)
    p.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="cannot read step records"):
        load_steps(p)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**400) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=12), kids, max_size=3),
    max_leaves=8,
)
_PATHS = st.sampled_from(
    ["", "meta", "steps", "steps.0", "steps.0.shape", "steps.1.step_s", "steps.0.shape.decode_seqs"]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=_PATHS, value=_JSON)
def test_any_step_file_loads_or_is_a_value_error(tmp_path, path, value):
    """Property: replacing any part of a valid file by any JSON value gives records whose
    fields are finite numbers >= 0, or a ``ValueError`` (never another exception)."""
    data = _valid()
    if path:
        *parents, last = path.split(".")
        node = data
        for k in parents:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[int(last) if isinstance(node, list) else last] = value
    else:
        data = value
    try:
        recs, meta = load_steps(_write(tmp_path, data))
    except ValueError:
        return
    assert isinstance(meta, dict)
    for r in recs:
        assert r.step_s >= 0 and all(v >= 0 for v in r.shape.as_dict().values())


def test_recorded_engine_must_match_the_cost_model():
    cm = parse_cost_model(profile_data(), "prof.json")  # block_size 16, float32
    check_recorded_engine({"engine": {"block_size": 16, "dtype": "auto"}}, cm)
    check_recorded_engine({}, cm)  # nothing recorded: nothing to check
    with pytest.raises(
        ValueError, match=r"block_size: the cost model prof\.json was profiled with block_size 16"
    ):
        check_recorded_engine({"engine": {"block_size": 8}}, cm)
    with pytest.raises(ValueError, match=r"dtype: .*profiled with dtype float32"):
        check_recorded_engine({"engine": {"block_size": 16, "dtype": "bfloat16"}}, cm)
    with pytest.raises(ValueError, match=r"quantization"):
        check_recorded_engine({"engine": {"block_size": 16, "quantization": "int8"}}, cm)


def test_load_replay_refuses_a_bad_step_file_or_another_engine_naming_the_problem(tmp_path):
    """The steps file and profile of a replay, read together: a malformed file or a profile of
    another engine (block size, dtype) is one ValueError naming the field."""
    from kvserve.sim.step_record import load_replay

    prof = _write(tmp_path, profile_data(), "prof.json")
    records, meta, _ = load_replay(_write(tmp_path, _valid(), "ok.json"), prof)
    assert len(records) == 2 and meta["trace"]["path"].endswith("t.csv")
    records, meta, _ = load_replay(_write(tmp_path, {**_valid(), "meta": {"trace": [1]}}, "trace.json"), prof)
    assert len(records) == 2
    cases = {
        "steps5.json": ({**_valid(), "steps": 5}, "steps must be a list"),
        "bs.json": (_valid(engine={"block_size": 8}), "block_size"),
        "bf.json": (_valid(engine={"block_size": 16, "dtype": "bfloat16"}), "dtype"),
    }
    for name, (data, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_replay(_write(tmp_path, data, name), prof)


def test_save_then_load_keeps_the_new_checks_happy(tmp_path):
    recs = [StepRecord(StepShape(prefill_tokens=3, prefill_attn_pairs=0.006), 0.5)]
    save_steps(tmp_path / "s.json", recs, {"engine": {"block_size": 4}})
    back, meta = load_steps(tmp_path / "s.json")
    assert back == recs and meta["engine"]["block_size"] == 4
