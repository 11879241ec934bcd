"""Engine flags on the command line: every ``kvserve serve`` flag has help text; the
scheduler's flags (``--scheduling-policy`` with its alias ``--policy``, ``--fair-input-weight``,
``--fair-output-weight``, ``--tenant-weights``, ``--[no-]waiting-aware-eviction``) reach the
engine arguments, and bad values are errors naming the flag."""

import argparse

import pytest

from kvserve.entrypoints.cli import add_engine_args, engine_args_from, flag_names


@pytest.fixture
def parser():
    p = argparse.ArgumentParser(prog="kvserve")
    add_engine_args(p)
    return p


def test_fair_flags_reach_the_engine_args(parser):
    ns = parser.parse_args(
        "--scheduling-policy fair --fair-input-weight 0.5 --fair-output-weight 3 --tenant-weights a=2,b=1".split()
    )
    args = engine_args_from(ns)
    assert args.policy == "fair"
    assert (args.fair_input_weight, args.fair_output_weight) == (0.5, 3.0)
    assert args.tenant_weights == {"a": 2.0, "b": 1.0}
    assert engine_args_from(parser.parse_args(["--policy", "priority"])).policy == "priority"
    defaults = engine_args_from(parser.parse_args([]))
    assert (defaults.policy, defaults.fair_input_weight, defaults.fair_output_weight) == ("fcfs", 1.0, 2.0)
    assert defaults.tenant_weights is None


def test_waiting_aware_eviction_flag_reaches_the_engine_args(parser):
    assert engine_args_from(parser.parse_args([])).waiting_aware_eviction is True
    args = engine_args_from(parser.parse_args(["--no-waiting-aware-eviction"]))
    assert args.waiting_aware_eviction is False


@pytest.mark.parametrize(
    "argv,message",
    [
        ("--scheduling-policy lottery", "argument --scheduling-policy/--policy: invalid choice: 'lottery'"),
        (
            "--tenant-weights a=0",
            "argument --tenant-weights: tenant_weights['a'] must be a finite number > 0",
        ),
        ("--tenant-weights a", "argument --tenant-weights: tenant_weights entry 'a' is not NAME=WEIGHT"),
        ("--fair-output-weight x", "argument --fair-output-weight: invalid float value: 'x'"),
    ],
)
def test_bad_flag_values_are_argparse_errors_naming_the_flag(parser, capsys, argv, message):
    with pytest.raises(SystemExit):
        parser.parse_args(argv.split())
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--fair-input-weight", "--fair-output-weight"])
def test_a_weight_at_or_below_zero_is_refused_naming_the_flag(parser, flag):
    with pytest.raises(ValueError) as e:
        engine_args_from(parser.parse_args([flag, "0"]))
    assert flag_names(str(e.value)) == f"{flag} must be a finite number > 0, got 0.0."


def test_every_serve_flag_has_help_text():
    """``kvserve serve --help`` explains every flag (a vLLM user reads it to map their flags)."""
    from kvserve.entrypoints.openai.api_server import make_arg_parser

    p = make_arg_parser()
    bare = [a.option_strings or [a.dest] for a in p._actions if not (a.help or "").strip()]
    assert bare == []
    assert "--scheduling-policy" in p.format_help()
