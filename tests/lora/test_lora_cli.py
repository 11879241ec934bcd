"""``kvserve generate --enable-lora --lora-modules NAME=PATH [--lora-name NAME]``: every prompt
runs with the chosen adapter (the same text as ``LLM.generate`` with its ``LoRARequest``), and
bad combinations exit 2 naming the flag before any model is built."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints import cli
from kvserve.lora_request import LoRARequest
from tests.lora.adapters import ALL_TARGETS, make_peft_adapter

pytest.importorskip("peft")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapter_paths(tiny_hf_model, tmp_path_factory):
    base = tiny_hf_model.cpu()
    return [
        make_peft_adapter(base, tmp_path_factory.mktemp(f"cli{i}"), 8, ALL_TARGETS, seed=30 + i)
        for i in (1, 2)
    ]


def _engine_flags(model_dir):
    return ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--max-lora-rank", "8"]


def _texts(llm, lora):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text.strip()


def test_generate_runs_the_chosen_adapter(tiny_llama_dir, adapter_paths, capsys):
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)
    want = [_texts(llm, LoRARequest(n, i + 1, p)) for i, (n, p) in enumerate(zip("ab", adapter_paths))]
    base = _texts(llm, None)
    assert len({base, *want}) == 3  # each adapter changes the output
    argv = ["generate", "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos", "--enable-lora"]
    argv += [
        *_engine_flags(tiny_llama_dir),
        "--lora-modules",
        f"a={adapter_paths[0]}",
        f"b={adapter_paths[1]}",
    ]
    assert cli.main([*argv, "--lora-name", "a"]) == 0
    out = capsys.readouterr().out
    assert f"{want[0]}  (8 tokens" in out and "LoRA adapter 'a'" in out, out
    # one module and no --lora-name: that one
    one = ["generate", "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos", "--enable-lora"]
    assert cli.main([*one, *_engine_flags(tiny_llama_dir), "--lora-modules", f"b={adapter_paths[1]}"]) == 0
    assert f"{want[1]}  (8 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-name", "a"], "--lora-name 'a' needs --lora-modules"),
        (["--enable-lora", "--lora-modules", "a=/x", "b=/y"], "pick one with --lora-name"),
        (["--enable-lora", "--lora-modules", "a=/x", "--lora-name", "c"], "--lora-name 'c' is not among"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y", "--lora-name", "a"], "given more than once"),
    ],
)
def test_generate_bad_lora_flags_exit_2_naming_the_flag(tiny_llama_dir, extra, message, capsys):
    argv = ["generate", "--prompt", PROMPT, *_engine_flags(tiny_llama_dir), *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_generate_bad_adapter_path_exits_2_naming_it(tiny_llama_dir, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    argv = ["generate", "--prompt", PROMPT, *_engine_flags(tiny_llama_dir), "--enable-lora"]
    assert cli.main([*argv, "--lora-modules", f"a={missing}"]) == 2
    assert missing in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "not_an_adapter"])
def test_generate_adapter_that_does_not_load_names_the_flag_and_module(
    tiny_llama_dir, tmp_path, kind, capsys
):
    # as `kvserve serve` words it: the flag, the module, then why
    path = tmp_path / "nope"
    if kind == "not_an_adapter":
        path.mkdir()
    argv = ["generate", "--prompt", PROMPT, *_engine_flags(tiny_llama_dir), "--enable-lora"]
    assert cli.main([*argv, "--lora-modules", f"sql={path}"]) == 2
    err = capsys.readouterr().err
    assert f"error: --lora-modules sql={path}: " in err, err


def test_generate_malformed_lora_module_is_an_argparse_error(tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *_engine_flags(tiny_llama_dir), "--enable-lora", "--lora-modules", "noequals"])
    assert e.value.code == 2 and "--lora-modules" in capsys.readouterr().err
