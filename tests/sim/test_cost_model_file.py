"""The cost-model file: round trip, malformed and mismatched files, ``simulate --cost-model``."""

import copy
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import EngineArgs
from kvserve.sim.cli import main as simulate_main
from kvserve.sim.cli import simulate
from kvserve.sim.cost_model import CostModel
from kvserve.sim.cost_model_file import (
    SCHEMA,
    SCHEMA_VERSION,
    load_cost_model,
    model_identity,
    parse_cost_model,
    save_cost_model,
)
from kvserve.workload.workload import BenchRequest, generate_arrivals


def profile_data(**over) -> dict:
    """A valid file's object, as ``kvserve profile`` writes it (no measurements)."""
    data = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": "2026-01-01T00:00:00Z",
        "kvserve_version": "0.1.0",
        "model": {"name": "m", "path": "/nowhere/m", "config_sha256": "ab" * 32, "quantization": None},
        "dtype": "float32",
        "block_size": 16,
        "device": "cpu",
        "host": {"cpu": "Test CPU 9000", "cores": 2, "threads": 2, "flags": ["avx2"]},
        "engine": {"enable_chunked_prefill": True, "max_num_batched_tokens": 256, "num_gpu_blocks": 96},
        "coefficients": {
            "base_s": 0.004,
            "prefill_token_s": 1e-4,
            "prefill_attn_s": 2e-5,
            "decode_seq_s": 5e-4,
            "context_token_s": 1e-7,
            "sample_s": 1e-4,
        },
        "fit_error": {"all": {"n": 10, "mean": 0.05, "p90": 0.1, "max": 0.2, "bias": 0.0}},
        "profile": {
            "ranges": {
                "prefill_tokens": 4096,
                "prefill_attn_pairs": 1e5,
                "decode_seqs": 64,
                "context_tokens": 1e5,
            }
        },
    }
    data.update(over)
    return data


def _requests(n=20, output_len=6, rate=20.0):
    return [
        BenchRequest(
            prompt_token_ids=[(7 * i + j) % 900 + 3 for j in range(30 + i)],
            output_len=output_len,
            arrival_s=t,
            id=i,
        )
        for i, t in enumerate(generate_arrivals(n, rate, seed=1))
    ]


def test_round_trip_keeps_coefficients_and_names_the_source(tmp_path):
    path = tmp_path / "p.json"
    save_cost_model(path, profile_data())
    f = load_cost_model(path)
    cm = f.cost_model
    assert cm.base_s == 0.004 and cm.prefill_attn_s == 2e-5 and cm.swap_block_s == 0.0
    assert (f.block_size, f.dtype, f.engine["max_num_batched_tokens"]) == (16, "float32", 256)
    d = cm.describe()
    assert "m," in d and "Test CPU 9000" in d and "float32" in d and str(path) in d
    # the same file simulates the same numbers as the same coefficients given directly
    args = dict(num_gpu_blocks=64, max_model_len=512)
    direct = CostModel(info={}, **{**{k: 0.0 for k in cm.coefficients()}, **profile_data()["coefficients"]})
    assert simulate(EngineArgs(**args), _requests(), cost_model=cm) == simulate(
        EngineArgs(**args), _requests(), cost_model=direct
    )


def test_round_trip_keeps_knots_and_attention_split(tmp_path):
    path = tmp_path / "p.json"
    save_cost_model(
        path,
        profile_data(
            decode_knots={"8": 3e-4},
            prefill_knots={"512": 2e-4},
            attention_split={"kv_heads": 3, "threads": 2},
        ),
    )
    cm = load_cost_model(path).cost_model
    assert cm.decode_knots == {8: 3e-4} and cm.attention_split == (3, 2)
    assert cm.prefill_knots == {512: 2e-4}
    # a file without them simulates with none
    plain = load_cost_model(save_and(tmp_path / "q.json", profile_data())).cost_model
    assert plain.decode_knots == {} and plain.prefill_knots == {} and plain.attention_split is None
    from kvserve.sim.step_shape import StepShape

    b12 = StepShape(decode_seqs=12, context_tokens=1200, sampled_rows=12)
    b1 = StepShape(decode_seqs=1, context_tokens=900, sampled_rows=1)
    assert cm.step_cost(b12) - plain.step_cost(b12) == pytest.approx(4 * 3e-4)  # 4 decodes past 8
    assert cm.step_cost(b1) - plain.step_cost(b1) == pytest.approx(300 * 1e-7)  # 900 -> 1200 units
    chunk = StepShape(prefill_tokens=600, prefill_seqs=1, prefill_attn_pairs=180.3, sampled_rows=1)
    assert cm.step_cost(chunk) - plain.step_cost(chunk) == pytest.approx(512 * 2e-4)  # rows capped at 512


def save_and(path, data):
    save_cost_model(path, data)
    return path


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(schema="other"), "schema"),
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d.pop("block_size"), "block_size"),
        (lambda d: d.update(block_size=0), "block_size"),
        (lambda d: d.update(block_size="16"), "block_size"),
        (lambda d: d.pop("model"), "model"),
        (lambda d: d.update(model="m"), "model"),
        (lambda d: d["coefficients"].update(base_s=-1.0), "base_s"),
        (lambda d: d["coefficients"].update(decode_seq_s="fast"), "decode_seq_s"),
        (lambda d: d["coefficients"].update(decode_seq_s=float("nan")), "decode_seq_s"),
        (lambda d: d["coefficients"].update(warp_s=1.0), "warp_s"),
        (lambda d: d["coefficients"].pop("base_s"), "base_s"),
        (lambda d: d.pop("fit_error"), "fit_error"),
        (lambda d: d.update(engine=[1, 2]), "engine"),
        (lambda d: d["engine"].update(num_gpu_blocks=-3), "engine.num_gpu_blocks"),
        (lambda d: d["engine"].update(enable_chunked_prefill="yes"), "engine.enable_chunked_prefill"),
        (lambda d: d.update(decode_knots=[8]), "decode_knots"),
        (lambda d: d.update(decode_knots={"eight": 1e-4}), "decode_knots"),
        (lambda d: d.update(decode_knots={"0": 1e-4}), "decode_knots"),
        (lambda d: d.update(decode_knots={"8": -1e-4}), "decode_knots"),
        (lambda d: d.update(prefill_knots={"x": 1e-4}), "prefill_knots"),
        (lambda d: d.update(prefill_knots={"512": float("inf")}), "prefill_knots"),
        (lambda d: d.update(attention_split={"kv_heads": 0, "threads": 2}), "attention_split.kv_heads"),
        (lambda d: d.update(attention_split={"kv_heads": 3}), "attention_split.threads"),
        (lambda d: d.update(attention_split=[3, 2]), "attention_split"),
        # absurd: a unit's cost above an hour (MAX_COEFFICIENT_S), infinities, negatives
        (lambda d: d["coefficients"].update(base_s=3601.0), "base_s must be at most 3600 s"),
        (lambda d: d["coefficients"].update(prefill_token_s=1e300), "prefill_token_s must be at most"),
        (lambda d: d["coefficients"].update(sample_s=float("inf")), "sample_s must be a finite number"),
        (
            lambda d: d["coefficients"].update(context_token_s=-1e-9),
            "context_token_s must be a finite number >= 0",
        ),
        (lambda d: d.update(decode_knots={"8": 7200.0}), "decode_knots: 8 must be at most"),
        (lambda d: d.update(decode_knots={"8": float("nan")}), "decode_knots: 8 must be a finite"),
        (
            lambda d: d["engine"].update(max_num_batched_tokens=0),
            "engine.max_num_batched_tokens must be an integer >= 1",
        ),
        (lambda d: d["profile"]["ranges"].update(decode_seqs=float("nan")), "profile.ranges"),
        (lambda d: d["profile"]["ranges"].update(decode_seqs=-1), "profile.ranges"),
    ],
)
def test_malformed_file_is_an_error_naming_the_field(mutate, field):
    data = copy.deepcopy(profile_data())
    mutate(data)
    with pytest.raises(ValueError, match=field):
        parse_cost_model(data, "bad.json")


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_cost_model(tmp_path / "missing.json")
    p = tmp_path / "junk.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON cost-model file"):
        load_cost_model(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_cost_model(p)


def test_mismatched_block_size_or_dtype_is_an_error_naming_it():
    f = parse_cost_model(profile_data(), "p.json")
    with pytest.raises(ValueError, match="^block_size: .*profiled with block_size 16.*uses 32"):
        f.check_engine_args(EngineArgs(block_size=32))
    with pytest.raises(ValueError, match="^dtype: .*float32.*bfloat16"):
        f.check_engine_args(EngineArgs(dtype="bfloat16"))
    with pytest.raises(ValueError, match="^quantization: "):
        f.check_engine_args(EngineArgs(quantization="int8"))
    f.check_engine_args(EngineArgs())  # auto dtype, no model named: fine


def test_other_model_is_an_error_naming_it(tiny_llama_dir, tmp_path):
    ident = model_identity(str(tiny_llama_dir))
    f = parse_cost_model(profile_data(model=ident), "p.json")
    f.check_engine_args(EngineArgs(model=str(tiny_llama_dir)))  # the same model: fine
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(cfg))
    for w in tiny_llama_dir.glob("*.safetensors"):
        (other / w.name).symlink_to(w)
    with pytest.raises(ValueError, match="^model: .*config differs"):
        f.check_engine_args(EngineArgs(model=str(other)))


def test_simulate_cli_names_the_cost_model_and_takes_profiled_defaults(tmp_path, capsys, monkeypatch):
    from kvserve.sim import cli

    path = tmp_path / "p.json"
    save_cost_model(path, profile_data())
    seen = []
    real = cli.simulate

    def spy(args, *a, **kw):
        seen.append((args.enable_chunked_prefill, args.max_num_batched_tokens, args.num_gpu_blocks))
        return real(args, *a, **kw)

    monkeypatch.setattr(cli, "simulate", spy)
    out = tmp_path / "s.json"
    assert simulate_main(["--cost-model", str(path), "--num-requests", "8", "--json-out", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("cost model: m, Test CPU 9000") and "float32" in first
    assert seen == [(True, 256, 96)]
    assert json.loads(out.read_text())["cost_model"].startswith("m, Test CPU 9000")
    # built-in: the header says so
    assert simulate_main(["--num-requests", "4"]) == 0
    assert "not this machine" in capsys.readouterr().out.splitlines()[0]


def test_simulate_cli_bad_cost_model_is_one_line_error(tmp_path, capsys):
    path = tmp_path / "p.json"
    save_cost_model(path, profile_data())
    assert simulate_main(["--cost-model", str(path), "--block-size", "32"]) == 2
    err = capsys.readouterr().err
    assert "block_size" in err and "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(profile_data(schema_version=0)))
    assert simulate_main(["--cost-model", str(bad)]) == 2
    assert "schema_version" in capsys.readouterr().err


def test_same_trace_same_seed_same_simulation(tmp_path):
    """Determinism: two runs of one trace with one seed give identical summaries."""
    cm = parse_cost_model(profile_data(), "p.json").cost_model
    args = dict(num_gpu_blocks=24, max_model_len=512, seed=3)  # tight: preemptions too
    a = simulate(EngineArgs(**args), _requests(30, output_len=40, rate=500.0), cost_model=cm)
    b = simulate(EngineArgs(**args), _requests(30, output_len=40, rate=500.0), cost_model=cm)
    assert a == b and a["finished"] == 30 and a["num_preemptions"] > 0


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(
    path=st.sampled_from(
        [(), ("model",), ("coefficients",), ("host",), ("engine",)]
        + [(k,) for k in profile_data()]
        + [("coefficients", k) for k in profile_data()["coefficients"]]
    ),
    value=_json_values,
)
def test_any_corrupted_field_is_a_value_error_or_accepted(path, value):
    """Fuzz: replacing any field (or the whole object) by any JSON value either loads a cost
    model with finite, non-negative coefficients or raises ValueError; never another exception."""
    data = copy.deepcopy(profile_data())
    if not path:
        data = value
    else:
        obj = data
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    try:
        f = parse_cost_model(data, "fuzz.json")
    except ValueError:
        return
    cm = f.cost_model
    assert all(math.isfinite(v) and v >= 0 for v in cm.coefficients().values())
    assert f.block_size >= 1 and cm.describe() and isinstance(f.engine, dict)
    try:
        f.samples()
    except ValueError:
        pass


def test_stored_samples_with_bad_times_are_named(tmp_path):
    data = profile_data()
    data["profile"]["samples"] = [{"shape": {"prefill_tokens": 8}, "t": -0.5}]
    with pytest.raises(ValueError, match=r"profile.samples\[0\]: t must be a finite number >= 0"):
        parse_cost_model(data, "p.json").samples()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda d: d["coefficients"].update(decode_seq_s=5000.0),
            "coefficients: decode_seq_s must be at most 3600 s",
        ),
        (
            lambda d: d["coefficients"].update(base_s=-0.1),
            "coefficients: base_s must be a finite number >= 0",
        ),
        (
            lambda d: d["engine"].update(num_gpu_blocks=10**9),
            "--num-gpu-blocks (or the engine of --cost-model",
        ),
    ],
)
def test_simulate_cli_refuses_absurd_cost_models(tmp_path, capsys, mutate, match):
    data = profile_data()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))  # as a hand-edited file: not through save_cost_model's check
    assert simulate_main(["--cost-model", str(path), "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert match in err and str(path) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_simulate_cli_missing_cost_model_file(capsys):
    assert simulate_main(["--cost-model", "/nonexistent/p.json"]) == 2
    assert "--cost-model /nonexistent/p.json: no such file" in capsys.readouterr().err


def test_simulate_cli_cost_model_with_speculation(tmp_path, capsys):
    """The acceptance-model keys of --speculative-config are the simulator's, not the engine's:
    checking the profile against the flags must not choke on them."""
    path = tmp_path / "p.json"
    save_cost_model(path, profile_data())
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "mean_accepted_len": 2.0}'
    out_json = tmp_path / "s.json"
    args = ["--cost-model", str(path), "--num-requests", "4", "--speculative-config", spec]
    assert simulate_main([*args, "--json-out", str(out_json)]) == 0
    sd = json.loads(out_json.read_text())["spec_decode"]
    assert 0 < sd["num_drafts"] < sd["num_draft_tokens"]  # k = 2: a draft is 1-2 tokens
    # the printed line counts drafts (verifications) and their tokens apart, as the JSON does
    line = f"speculative decoding: {sd['num_drafts']} drafts of {sd['num_draft_tokens']} tokens,"
    assert line in capsys.readouterr().out


def test_steps_past_the_profiled_shapes_are_counted_and_noted(tmp_path, capsys):
    """A profile of short prompts says so when a simulation prefills longer ones."""
    small = profile_data(profile={"ranges": {"prefill_tokens": 16, "prefill_attn_pairs": 0.1}})
    cm = parse_cost_model(small, "p.json").cost_model
    s = simulate(EngineArgs(num_gpu_blocks=64, max_model_len=512), _requests(5), cost_model=cm)
    assert s["num_extrapolated_steps"] >= 5  # every prompt (30+ tokens) is past 16 * 1.25
    roomy = parse_cost_model(profile_data(), "p.json").cost_model
    assert (
        simulate(EngineArgs(num_gpu_blocks=64, max_model_len=512), _requests(5), cost_model=roomy)[
            "num_extrapolated_steps"
        ]
        == 0
    )
    path = tmp_path / "p.json"
    save_cost_model(path, small)
    assert simulate_main(["--cost-model", str(path), "--num-requests", "4"]) == 0
    assert "larger than any step the cost model was profiled on" in capsys.readouterr().out
    with pytest.raises(ValueError, match="profile.ranges"):
        parse_cost_model(profile_data(profile={"ranges": {"decode_seqs": "many"}}), "p.json")


def test_deeply_nested_or_huge_number_file_is_an_error_naming_it(tmp_path, capsys):
    """JSON nested past the parser's depth (was RecursionError: a traceback) or an integer past
    Python's digit limit (a message naming neither file nor field) is a one-line error."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="deep.json: not a JSON cost-model file"):
        load_cost_model(deep)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(profile_data()).replace('"block_size": 16', '"block_size": ' + "1" * 5000))
    assert simulate_main(["--cost-model", str(big), "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{big}: not a JSON cost-model file" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "profile, match",
    [
        (
            {"samples": [{"shape": {"prefill_tokens": "x"}, "t": 0.1}]},
            r"samples\[0\].shape: prefill_tokens must be",
        ),
        (
            {"samples": [{"shape": {"prefill_attn_pairs": math.nan}, "t": 0.1}]},
            r"samples\[0\].shape: prefill_attn_pairs",
        ),
        ({"samples": [{"shape": {"decode_seqs": -3}, "t": 0.1}]}, r"samples\[0\].shape: decode_seqs must be"),
        ({"samples": [{"shape": {"decode_seqs": 1e308}, "t": 0.1}]}, r"decode_seqs must be at most 1e\+15"),
        ({"swap_samples": [{"t": 0.1}]}, r"swap_samples\[0\]: blocks must be an integer >= 0, got None"),
        ({"swap_samples": [{"blocks": "x", "t": 0.1}]}, r"swap_samples\[0\]: blocks must be"),
        ({"swap_samples": [{"blocks": 4, "t": -1}]}, r"swap_samples\[0\]: t must be a finite number >= 0"),
        ({"swap_samples": 5}, r"profile.swap_samples is malformed"),
    ],
)
def test_refit_of_malformed_stored_measurements_names_the_entry(tmp_path, capsys, profile, match):
    """``kvserve profile --refit``: a stored step shape or swap sample that is not a count was a
    TypeError / KeyError traceback (or numpy's "SVD did not converge"): now exit 2 naming it."""
    from kvserve.sim.profile import main as profile_main

    data = profile_data()
    ok = {"prefill_tokens": 8, "prefill_seqs": 1, "decode_seqs": 2, "context_tokens": 90, "sampled_rows": 3}
    data["profile"]["samples"] = [{"shape": ok, "t": 0.01}] * 12
    data["profile"].update(copy.deepcopy(profile))
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    assert profile_main(["--out", str(tmp_path / "o.json"), "--refit", str(p)]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err
    assert str(p) in err  # the file given to --refit, not "<cost model>"
