"""On the command line (``kvserve generate`` / ``kvserve serve``) a bad engine setting exits 2
with a message naming the flag the user typed (``--tensor-parallel-size``, ``--quantization``,
``--data-parallel-size``, ...), not the Python keyword ``LLM(...)`` takes; ``LLM(...)`` keeps
the keyword."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.config import EngineArgs
from kvserve.entrypoints import cli
from kvserve.entrypoints.openai import api_server

CASES = [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer in [1, 64], got 0"),
    (
        ["--tensor-parallel-size", "2", "--quantization", "gptq"],
        "--quantization gptq is not supported with --tensor-parallel-size > 1",
    ),
    (
        ["--tensor-parallel-size", "2", "--quantization", "gguf"],
        "use --quantization int8 or --quantization int4 on a float checkpoint",
    ),
    (["--tensor-parallel-size", "2", "--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be an integer >= 1, got 0"),
    (["--router-balance-threshold", "-1"], "--router-balance-threshold must be an integer >= 0"),
]
KEYWORDS = ("tensor_parallel_size", "quantization=", "data_parallel_size", "router_balance_threshold")


def _no_keyword(err: str) -> None:
    assert not any(k in err for k in KEYWORDS), err


@pytest.mark.parametrize("flags, message", CASES)
def test_generate_bad_engine_flag_names_the_flag(flags, message, capsys):
    assert cli.main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    _no_keyword(err)


@pytest.mark.parametrize("flags, message", CASES)
def test_serve_bad_engine_flag_names_the_flag(flags, message, capsys):
    assert api_server.main(flags) == 2
    err = capsys.readouterr().err
    assert message in err, err
    _no_keyword(err)


def test_tp_size_not_dividing_heads_names_the_flag(tiny_llama_dir, capsys):
    # refused from the model's shapes before any peer process starts
    argv = ["generate", "--prompt", "hi", "--model", str(tiny_llama_dir), "--device", "cpu"]
    assert cli.main([*argv, "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 3 must divide both num_attention_heads=4" in err, err
    _no_keyword(err)


def test_python_api_keeps_the_keyword_names():
    with pytest.raises(
        ValueError, match="quantization='gptq' is not supported with tensor_parallel_size > 1"
    ):
        EngineArgs(tensor_parallel_size=2, quantization="gptq")


_FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
_MULTI_WORD = [n for n in _FIELDS if "_" in n]


@given(st.sampled_from(_MULTI_WORD), st.sampled_from(["must be 1", "> 1", "is off", "=3 needs x"]))
def test_flag_names_rewrites_every_multi_word_field(name, rest):
    sep = "" if rest.startswith("=") else " "
    out = cli.flag_names(f"{name}{sep}{rest}.")
    flag = "--" + name.replace("_", "-")
    assert out.startswith(flag), out
    assert name not in out


@given(st.sampled_from(_FIELDS), st.sampled_from(["_config", "s", ".x", "_y"]))
def test_flag_names_leaves_longer_identifiers_alone(name, suffix):
    # ``quantization_config``, ``speculative_config.foo``, ``models``: not the flag
    text = f"the {name}{suffix} of the checkpoint"
    assert cli.flag_names(text) == text


@pytest.mark.parametrize(
    "text",
    [
        "the model's config.json has no num_attention_heads",
        "quantization 'gptq' (a quantized checkpoint) is not supported with tensor_parallel_size > 1",
        "a device other than CPU",
    ],
)
def test_flag_names_keeps_prose_words(text):
    out = cli.flag_names(text)
    assert out.replace("--tensor-parallel-size", "tensor_parallel_size") == text


def test_flag_names_writes_a_switch_as_the_flag_argparse_takes():
    # --enable-prefix-caching is a switch (--no-... turns it off); "--enable-prefix-caching True"
    # would be refused by argparse
    from kvserve.config import CacheConfig

    with pytest.raises(ValueError) as e:
        CacheConfig(kv_offload_gib=0.25)
    assert cli.flag_names(str(e.value)).endswith("need --enable-prefix-caching.")
    out = cli.flag_names("needs scheduling_backfill=False and enable_lora=True, tensor_parallel_size=2")
    assert out == "needs --no-scheduling-backfill and --enable-lora, --tensor-parallel-size 2"
