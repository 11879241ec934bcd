"""vLLM's flags and LLM(...) keywords: each one in the snapshot of vLLM's parsers
(tests/data/vllm_flags.txt) has a fate in kvserve.entrypoints.vllm_compat, and kvserve's parser
and LLM do what that fate says; docs/coming_from_vllm.md is the table's rendering."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from kvserve.config import CacheConfig, EngineArgs, SchedulerConfig
from kvserve.entrypoints import vllm_compat as vc
from kvserve.entrypoints.cli import engine_args_from

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "tests" / "data" / "vllm_flags.txt"
SNAPSHOT_SCRIPT = ROOT / "benchmarks" / "vllm_cpu" / "snapshot_flags.py"


def _snapshot() -> dict[str, list[str]]:
    """Section name -> its non-comment lines."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in SNAPSHOT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
            continue
        assert current is not None, f"a line before any section: {line!r}"
        sections[current].append(line)
    return sections


#: The snapshot's flag sections: the installed vLLM's, then what earlier versions had.
ENGINE_SECTIONS = ("engine", "engine-older")
FLAG_SECTIONS = (*ENGINE_SECTIONS, "server", "server-older")


def _flags() -> dict[str, tuple[list[str], str]]:
    """Long flag -> (its other spellings, its arity), over the engine and server sections."""
    out = {}
    sections = _snapshot()
    for section in FLAG_SECTIONS:
        for line in sections.get(section, []):
            names, arity = (part.strip() for part in line.split("::"))
            flag, *aliases = names.split()
            assert flag not in out, f"{flag} listed twice"
            out[flag] = (aliases, arity)
    return out


@pytest.fixture
def serve_parser(monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    from kvserve.entrypoints.openai.api_server import make_arg_parser

    return make_arg_parser()


def _parse(parser, line: str):
    ns = parser.parse_args(line.split())
    lines = vc.apply_vllm_flags(ns)
    return ns, lines


# ---------------------------------------------------------------- the table against the snapshot
def test_every_snapshot_flag_has_a_fate_with_its_arity_and_aliases():
    flags = _flags()
    assert len(flags) > 200, "the snapshot lost its flags"
    missing = sorted(set(flags) - set(vc.FATES))
    assert not missing, f"vLLM flags without a fate in vllm_compat.FATES: {missing}"
    keyword_only = set(_snapshot()["engine-fields"])
    stale = sorted(set(vc.FATES) - set(flags) - keyword_only)
    assert not stale, f"fates of flags the snapshot does not have: {stale}"
    for flag, (aliases, arity) in flags.items():
        fate = vc.FATES[flag]
        assert fate.arity == arity, f"{flag}: snapshot arity {arity}, table {fate.arity}"
        assert sorted(vc.aliases_of(flag)) == sorted(aliases), flag
        assert fate.kind in (vc.SAME, vc.MAPPED, vc.IGNORED, vc.REFUSED), flag
        assert fate.why or fate.kind == vc.SAME, f"{flag}: {fate.kind} without a reason"
        if fate.kind == vc.MAPPED:
            assert fate.target and fate.convert, flag


def test_every_llm_keyword_has_a_fate():
    sections = _snapshot()
    assert tuple(sections["llm"] + sections.get("llm-older", [])) == vc.LLM_KEYWORDS
    engine_keys = [
        line.split()[0].lstrip("-").replace("-", "_")
        for section in ENGINE_SECTIONS
        for line in sections.get(section, [])
        if not line.startswith(("--enable-log-requests", "--disable-log-requests"))
    ]
    for key in [*vc.LLM_KEYWORDS, *engine_keys, *sections["engine-fields"]]:
        flag = vc.llm_keyword_flag(key)
        assert flag is not None and flag in vc.FATES, f"LLM keyword {key} has no fate"


def test_a_flag_missing_from_the_table_is_found():
    """The check above can fail: the snapshot with one more flag names one without a fate."""
    assert "--not-a-flag" not in vc.FATES
    flags = set(_flags()) | {"--not-a-flag"}
    assert sorted(flags - set(vc.FATES)) == ["--not-a-flag"]


def _installed_vllm() -> dict:
    """The flags and keywords of the vLLM in ``$VLLM_VENV`` (default /work/vllm-venv), read by
    ``snapshot_flags.py --json`` in that venv's Python; skips where there is none."""
    python = Path(os.environ.get("VLLM_VENV", "/work/vllm-venv")) / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM venv at {python.parent.parent} (set VLLM_VENV)")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [str(python), str(SNAPSHOT_SCRIPT), "--json"], capture_output=True, text=True, timeout=600, env=env
    )
    if proc.returncode != 0 and "No module named 'vllm'" in proc.stderr:
        pytest.skip(f"vllm is not importable in {python}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # imports vLLM in a subprocess (~13 s)
def test_every_flag_of_the_installed_vllm_has_a_fate():
    """Catches the next vLLM upgrade: a flag, spelling or keyword of the installed vLLM that
    the table does not know (rerun benchmarks/vllm_cpu/snapshot_flags.py, give each a fate)."""
    installed = _installed_vllm()
    problems = []
    for section in ("engine", "server"):
        for flag, (aliases, arity) in installed[section].items():
            if flag not in vc.FATES:
                problems.append(f"{flag} has no fate")
                continue
            problems += [f"{flag}: spelling {a} unknown" for a in aliases if a not in vc.aliases_of(flag)]
            if vc.FATES[flag].arity != arity:
                problems.append(f"{flag}: arity {arity}, the table's {vc.FATES[flag].arity}")
    for key in installed["llm"] + installed["engine_fields"]:
        if vc.llm_keyword_flag(key) is None:
            problems.append(f"LLM keyword {key} has no fate")
    assert not problems, f"{installed['version']}: {problems}"


def test_docs_page_is_the_rendered_table():
    page = (ROOT / "docs" / "coming_from_vllm.md").read_text()
    assert page == vc.render_markdown(), (
        "docs/coming_from_vllm.md is out of date: regenerate it with "
        "kvserve.entrypoints.vllm_compat.render_markdown()"
    )
    readme = (ROOT / "README.md").read_text()
    assert "(docs/coming_from_vllm.md)" in readme


# ---------------------------------------------------------------- the parser does what the table says
def test_a_common_vllm_launch_line_parses_into_the_engine_and_server_settings(serve_parser):
    ns, lines = _parse(
        serve_parser,
        "/models/llama --gpu-memory-utilization 0.9 -tp 2 --trust-remote-code --disable-log-requests "
        "--max-model-len 32k --dtype half --swap-space 4 --enforce-eager --host 0.0.0.0 --port 8001 "
        "--served-model-name llama alias --max-num-seqs 64 --max-num-batched-tokens 8K "
        "--enable-prefix-caching --uvicorn-log-level warning --kv-cache-dtype fp8 -pp 1 "
        "--disable-log-stats --generation-config vllm --scheduling-policy priority "
        "--num-gpu-blocks-override 100 --api-key k --seed 3 -q int8 --enable-chunked-prefill",
    )
    args = engine_args_from(ns)
    assert args.model == "/models/llama"
    assert args.tensor_parallel_size == 2
    assert args.max_model_len == 32000
    assert args.max_num_batched_tokens == 8192
    assert args.dtype == "float16"
    assert args.swap_space_gib == 4.0
    assert args.gpu_memory_utilization == 0.9
    assert args.max_num_seqs == 64 and args.seed == 3 and args.quantization == "int8"
    assert args.enable_prefix_caching is True and args.enable_chunked_prefill is True
    assert args.generation_config == "vllm"
    assert args.policy == "priority"
    assert args.num_gpu_blocks == 100
    assert args.kv_cache_dtype == "fp8"
    assert (ns.host, ns.port, ns.api_key) == ("0.0.0.0", 8001, "k")
    assert ns.served_model_name == ["llama", "alias"]
    assert ns.request_log is False
    assert ns.log_level == "warning"
    joined = "\n".join(lines)
    for flag in ("--trust-remote-code", "--enforce-eager", "--disable-log-stats"):
        assert f"vLLM flag {flag} ignored" in joined
    assert "never runs code from a model directory" in joined
    assert "--pipeline-parallel-size 1 accepted" in joined
    # the rest: one line per mapped flag, naming kvserve's setting
    mapped = [ln for ln in lines if " mapped: kvserve's " in ln]
    assert (
        len(lines) - len(mapped) == 4
        and "vLLM flag --swap-space 4 mapped: kvserve's --swap-space-gib 4.0." in mapped
    )


def test_a_launch_line_of_vllm_0_32_flags_parses(serve_parser):
    ns, lines = _parse(
        serve_parser,
        "/models/llama --device-memory-utilization 0.5 --spec-method ngram --spec-tokens 3 "
        "--max-num-scheduled-tokens 4k --kv-offloading-size 2 --enable-prefix-caching --log-level DEBUG "
        "--shutdown-timeout 5 --numa-bind --stream-interval 10 --watermark 0.02 --max-num-queued-reqs 64 "
        "-n 1 --no-enable-expert-parallel -cc {} --optimization-level 0",
    )
    args = engine_args_from(ns)
    assert args.gpu_memory_utilization == 0.5
    spec = args.create_speculative_config()
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert args.max_num_batched_tokens == 4000
    assert args.kv_offload_gib == 2.0 and args.enable_prefix_caching is True
    assert args.watermark == 0.02 and args.max_waiting == 64
    assert (ns.log_level, ns.shutdown_grace_s) == ("debug", 5.0)
    joined = "\n".join(lines)
    for flag in ("--numa-bind", "--stream-interval", "--compilation-config", "--optimization-level"):
        assert f"vLLM flag {flag} ignored" in joined
    assert "--nnodes 1 accepted" in joined and "--enable-expert-parallel False accepted" in joined
    mapped = [ln for ln in lines if " mapped: kvserve's " in ln]
    assert len(lines) - len(mapped) == 6
    assert (
        "vLLM flag --max-num-scheduled-tokens 4k mapped: kvserve's --max-num-batched-tokens 4000." in mapped
    )


@pytest.mark.parametrize(
    ("level", "kvserve_level"), [("DEBUG", "debug"), ("CRITICAL", "error"), ("NOTSET", "debug")]
)
def test_log_level_takes_vllm_spellings(serve_parser, level, kvserve_level):
    assert serve_parser.parse_args(["--log-level", level]).log_level == kvserve_level


def test_spec_flags_build_one_speculative_config(serve_parser):
    ns, _ = _parse(serve_parser, "--model /m --spec-model /draft --spec-tokens 2")
    spec = engine_args_from(ns).create_speculative_config()
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model",
        "/draft",
        2,
    )
    # over --speculative-config: its other keys kept, a key given twice must agree
    ns, _ = _parse(serve_parser, '--spec-tokens 2 -sc {"method":"ngram","prompt_lookup_max":3}')
    assert engine_args_from(ns).create_speculative_config().prompt_lookup_max == 3
    with pytest.raises(
        ValueError, match=r"^--spec-tokens 2 and speculative_config's num_speculative_tokens 4 disagree"
    ):
        _parse(serve_parser, '--spec-tokens 2 --speculative-config {"num_speculative_tokens":4}')
    with pytest.raises(
        ValueError, match=r"^--spec-method eagle3: method 'eagle3' is not supported by kvserve"
    ):
        _parse(serve_parser, "--spec-method eagle3 --spec-tokens 2")


def test_spec_keywords_of_llm_build_one_speculative_config():
    fields = set(EngineArgs.field_names())
    out = vc.translate_llm_kwargs(
        {"spec_tokens": 2, "speculative_config": {"disable_by_batch_size": 4}, "spec_model": "/d"}, fields
    )
    assert out == {
        "speculative_config": {
            "disable_by_batch_size": 4,
            "model": "/d",
            "method": "draft_model",
            "num_speculative_tokens": 2,
        }
    }
    # the flags' order, not the keywords': an explicit method is not taken for a disagreement
    out = vc.translate_llm_kwargs({"spec_model": "/d", "spec_method": "draft_model"}, fields)
    assert out["speculative_config"] == '{"method": "draft_model", "model": "/d"}'
    with pytest.raises(ValueError, match="^spec_method mtp: method 'mtp' is not supported"):
        vc.translate_llm_kwargs({"spec_method": "mtp"}, fields)


def _sample(flag: str, fate: vc.Fate) -> list[str]:
    """A command-line use of ``flag`` with a value vLLM would take."""
    samples = {
        "--kv-cache-memory-bytes": "2G",
        "--swap-space": "2",
        "--num-gpu-blocks-override": "7",
        "--scheduler-delay-factor": "0.5",
        "--uvicorn-log-level": "critical",
        "--task": "embedding",
        "--override-pooler-config": '{"pooling_type": "MEAN"}',
        "--kv-offloading-size": "2",
        "--shutdown-timeout": "5",
        "--max-num-scheduled-tokens": "4k",
        "--max-num-active-seqs": "8",
        "--max-num-queued-reqs": "9",
        "--spec-method": "ngram",
        "--spec-model": "/draft",
        "--spec-tokens": "3",
    }
    if fate.arity == vc.BOOL:
        return [flag]
    return [flag, samples.get(flag, "x1")]


@pytest.mark.parametrize("flag", [f for f in vc.FATES if f.startswith("-")])
def test_each_flag_does_what_its_fate_says(serve_parser, flag):
    fate = vc.FATES[flag]
    if fate.kind == vc.SAME:  # kvserve's own flag (its values: test_configuration_reference)
        assert flag in serve_parser._option_string_actions
        assert not vc.is_compat_action(serve_parser._option_string_actions[flag])
        return
    ns = serve_parser.parse_args(_sample(flag, fate))  # the parser takes every vLLM flag
    if fate.kind == vc.REFUSED:
        with pytest.raises(ValueError, match=rf"^{flag} .*is not supported: "):
            vc.apply_vllm_flags(ns)
        return
    lines = vc.apply_vllm_flags(ns)
    if fate.kind == vc.IGNORED:
        assert lines == [f"vLLM flag {flag} ignored: {fate.why}."]
        return
    assert (
        len(lines) == 1 and lines[0].startswith(f"vLLM flag {flag}") and " mapped: kvserve's --" in lines[0]
    )
    expected = {
        "--kv-cache-memory-bytes": ("kv_cache_memory_gib", 2.0),
        "--swap-space": ("swap_space_gib", 2.0),
        "--num-gpu-blocks-override": ("num_gpu_blocks", 7),
        "--scheduler-delay-factor": ("delay_factor", 0.5),
        "--uvicorn-log-level": ("log_level", "error"),
        "--enable-log-requests": ("request_log", True),
        "--disable-log-requests": ("request_log", False),
        "--task": ("runner", "pooling"),
        "--override-pooler-config": ("pooler_config", '{"pooling_type": "MEAN"}'),
        "--kv-offloading-size": ("kv_offload_gib", 2.0),
        "--shutdown-timeout": ("shutdown_grace_s", 5.0),
        "--max-num-scheduled-tokens": ("max_num_batched_tokens", 4000),
        "--max-num-active-seqs": ("max_num_seqs", 8),
        "--max-num-queued-reqs": ("max_waiting", 9),
        "--spec-method": ("speculative_config", '{"method": "ngram"}'),
        "--spec-model": ("speculative_config", '{"model": "/draft", "method": "draft_model"}'),
        "--spec-tokens": ("speculative_config", '{"num_speculative_tokens": 3}'),
    }[flag]
    assert getattr(ns, expected[0]) == expected[1]


def test_refused_flags_take_their_accepted_values_and_name_them_otherwise(serve_parser):
    ns, lines = _parse(serve_parser, "--model /m --tokenizer /m --load-format safetensors --no-enable-dbo")
    assert len(lines) == 3 and all(" accepted: " in line for line in lines)
    with pytest.raises(ValueError, match=r"--tokenizer /t is not supported: kvserve reads the tokenizer"):
        _parse(serve_parser, "--model /m --tokenizer /t")
    with pytest.raises(ValueError, match=r"--cpu-offload-gb 4 is not supported: .*\(accepted: 0, 0.0\)"):
        _parse(serve_parser, "--cpu-offload-gb 4")


@pytest.mark.parametrize(
    "task, runner",
    [("auto", "auto"), ("generate", "generate"), ("embed", "pooling"), ("embedding", "pooling"),
     ("score", "pooling"), ("reward", "pooling"), ("EMBED", "pooling")],
)  # fmt: skip
def test_legacy_task_runs_its_runner(serve_parser, task, runner):
    ns, lines = _parse(serve_parser, f"--model /m --task {task}")
    assert ns.runner == runner and lines == [f"vLLM flag --task {task} mapped: kvserve's --runner {runner}."]
    assert engine_args_from(ns).runner == runner


@pytest.mark.parametrize("task", ["classify", "transcription", "draft"])
def test_legacy_task_kvserve_does_not_serve_is_refused_by_name(serve_parser, task):
    with pytest.raises(ValueError, match=rf"^--task {task}: task '{task}' is not served by kvserve"):
        _parse(serve_parser, f"--model /m --task {task}")


def test_llm_task_keyword_selects_the_pooling_runner():
    fields = set(EngineArgs.field_names())
    assert vc.translate_llm_kwargs({"model": "/m", "task": "embed"}, fields) == {
        "model": "/m",
        "runner": "pooling",
    }
    out = vc.translate_llm_kwargs({"override_pooler_config": {"pooling_type": "LAST"}}, fields)
    assert out == {"pooler_config": {"pooling_type": "LAST"}}
    with pytest.raises(ValueError, match="^task classify: task 'classify' is not served"):
        vc.translate_llm_kwargs({"task": "classify"}, fields)


def test_positional_model_and_a_different_model_flag_conflict(serve_parser):
    ns, _ = _parse(serve_parser, "/a")
    assert ns.model == "/a"
    ns, _ = _parse(serve_parser, "/a --model /a")
    assert ns.model == "/a"
    with pytest.raises(ValueError, match="MODEL '/a' and --model '/b' name different models"):
        _parse(serve_parser, "/a --model /b")


def test_serve_exits_2_naming_a_refused_flag(capsys):
    from kvserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "/m", "--cpu-offload-gb", "2"])
    assert e.value.code == 2
    assert "--cpu-offload-gb 2 is not supported" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("32768", 32768),
        ("32k", 32000),
        ("25.6k", 25600),
        ("32K", 32768),
        ("1M", 2**20),
        ("1m", 10**6),
        ("2G", 2**31),
    ],
)
def test_human_readable_integers(text, value):
    assert vc.parse_human_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "32x", "", "3.5", "k"])
def test_human_readable_integers_refuse_other_forms(text):
    with pytest.raises(ValueError):
        vc.parse_human_int(text)


def test_dtype_aliases_of_vllm():
    assert EngineArgs(dtype="half").dtype == "float16"
    assert EngineArgs(dtype="float").dtype == "float32"
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineArgs(gpu_memory_utilization=1.5)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_model_len_that_is_not_a_positive_integer_is_refused(value):
    # 0 once read as unset: the model's whole length, silently
    with pytest.raises(ValueError, match=f"max_model_len must be an integer >= 1, got {value!r}"):
        EngineArgs(max_model_len=value)


# ---------------------------------------------------------------- LLM(...) keywords
def test_llm_keywords_are_translated_ignored_or_refused(caplog):
    fields = set(EngineArgs.field_names())
    with caplog.at_level(logging.INFO, logger="kvserve.vllm_compat"):
        out = vc.translate_llm_kwargs(
            {
                "model": "/m",
                "swap_space": 4,
                "trust_remote_code": True,
                "enforce_eager": True,
                "gpu_memory_utilization": 0.5,
                "kv_cache_dtype": "int8",
                "tokenizer": "/m",
                "num_gpu_blocks_override": 9,
                "cpu_offload_gb": 0,
            },
            fields,
        )
    assert out == {
        "model": "/m",
        "swap_space_gib": 4.0,
        "gpu_memory_utilization": 0.5,
        "kv_cache_dtype": "int8",
        "num_gpu_blocks": 9,
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(w.startswith("vLLM keyword ") for w in warnings)
    assert any("trust_remote_code ignored: kvserve never runs code" in w for w in warnings)
    with pytest.raises(ValueError, match="cpu_offload_gb 4 is not supported"):
        vc.translate_llm_kwargs({"cpu_offload_gb": 4}, fields)
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\): \['no_such_thing'\]"):
        vc.translate_llm_kwargs({"no_such_thing": 1}, fields)


def test_llm_keywords_of_server_settings_are_refused_by_name():
    fields = set(EngineArgs.field_names())
    with pytest.raises(ValueError, match=r"^otlp_traces_endpoint is a server setting \(kvserve serve --otlp"):
        vc.translate_llm_kwargs({"otlp_traces_endpoint": "http://c:4318"}, fields)
    assert vc.translate_llm_kwargs({"enable_sleep_mode": True}, fields) == {"enable_sleep_mode": True}


def test_llm_keyword_of_a_renamed_engine_field_sets_it():
    # vLLM's LLM(scheduling_policy=...) is kvserve's EngineArgs.policy (the flag's other name).
    fields = set(EngineArgs.field_names())
    assert vc.translate_llm_kwargs({"scheduling_policy": "fair"}, fields) == {"policy": "fair"}
    assert vc.translate_llm_kwargs({"policy": "fair", "scheduling_policy": "fair"}, fields) == {
        "policy": "fair"
    }
    with pytest.raises(ValueError, match=r"scheduling_policy='fair' and policy='fcfs' set one setting twice"):
        vc.translate_llm_kwargs({"policy": "fcfs", "scheduling_policy": "fair"}, fields)
    assert (
        EngineArgs(**vc.translate_llm_kwargs({"scheduling_policy": "priority"}, fields)).policy == "priority"
    )


@pytest.mark.parametrize(
    "line, make, typed",
    [
        (
            "--swap-space -1",
            lambda: CacheConfig(swap_space_gib=-1.0),
            "--swap-space (kvserve's --swap-space-gib) must be >= 0, got -1.0.",
        ),
        (
            "--num-gpu-blocks-override 0",
            lambda: CacheConfig(num_gpu_blocks=0),
            "--num-gpu-blocks-override (kvserve's --num-gpu-blocks) must be an integer >= 1, got 0.",
        ),
        (
            "--scheduler-delay-factor -1",
            lambda: SchedulerConfig(delay_factor=-1.0),
            "--scheduler-delay-factor (kvserve's --delay-factor) must be a finite number >= 0, got -1.0.",
        ),
        (
            "--max-num-active-seqs 0",
            lambda: SchedulerConfig(max_num_seqs=0),
            "--max-num-active-seqs (kvserve's --max-num-seqs) must be an integer >= 1, got 0.",
        ),
        # typed as kvserve's own: as it is
        (
            "--swap-space-gib -1",
            lambda: CacheConfig(swap_space_gib=-1.0),
            "--swap-space-gib must be >= 0, got -1.0.",
        ),
        (
            "--max-num-seqs 0",
            lambda: SchedulerConfig(max_num_seqs=0),
            "--max-num-seqs must be an integer >= 1, got 0.",
        ),
    ],
)
def test_an_engine_error_names_the_mapped_vllm_flag_as_typed(serve_parser, line, make, typed):
    """A mapped vLLM flag's bad value is refused by the engine setting it maps to; the serve
    error names the flag the user typed (and kvserve's beside it), not only kvserve's."""
    from kvserve.entrypoints.cli import flag_names

    ns, _ = _parse(serve_parser, line)
    with pytest.raises(ValueError) as e:
        make()
    assert vc.typed_flags(flag_names(str(e.value)), ns) == typed
