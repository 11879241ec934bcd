"""Adapter files that are not what they claim: FIFOs, devices, oversized files, and symlinked
files that lead out of ``--allowed-lora-root``. Each is refused without blocking the reader."""

import asyncio
import os
import threading

import pytest

from kvserve.entrypoints.openai.serving_engine import APIError
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.lora.peft import (
    CONFIG_FILE,
    MAX_ADAPTER_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterFileError,
    load_peft_adapter,
    max_weights_file_bytes,
)
from tests.entrypoints.openai.test_input_hardening import _FakeAsyncEngine, _load, _load_error
from tests.lora.test_lora_adapters import SHAPES, _adapter


def _finishes(fn, *args, **kw):
    """``fn(*args, **kw)``'s result or exception, from a daemon thread: a read that blocks for
    good fails the test instead of hanging the run."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # handed back to the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), f"{fn.__name__} blocked"
    return out


def _make_special(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        os.symlink(kind, path)  # a character device


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/null", "dir"])
@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_adapter_file_that_is_not_a_regular_file_is_refused_without_reading(tmp_path, kind, name):
    p = _adapter(tmp_path)
    os.remove(os.path.join(p, name))
    _make_special(os.path.join(p, name), kind)
    out = _finishes(load_peft_adapter, p, 1, SHAPES, 16)
    err = out.get("error")
    assert isinstance(err, AdapterFileError), out
    assert "is not a regular file" in str(err) and name in str(err)


def test_config_above_the_size_limit_is_refused_naming_it(tmp_path):
    p = _adapter(tmp_path)
    cfg = os.path.join(p, CONFIG_FILE)
    text = open(cfg).read()
    # whitespace-padded JSON: valid at the limit, refused one byte past it
    with open(cfg, "w") as f:
        f.write(text + " " * (MAX_ADAPTER_CONFIG_BYTES - len(text)))
    assert load_peft_adapter(p, 1, SHAPES, 16).rank == 4
    with open(cfg, "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=f"larger than {MAX_ADAPTER_CONFIG_BYTES} bytes") as e:
        load_peft_adapter(p, 1, SHAPES, 16)
    assert not isinstance(e.value, AdapterFileError)  # the file is there: say what is wrong


def test_weights_file_larger_than_any_adapter_of_the_model_is_refused(tmp_path):
    p = _adapter(tmp_path)
    w = os.path.join(p, WEIGHTS_FILE)
    data = open(w, "rb").read()
    header = 8 + int.from_bytes(data[:8], "little")
    limit = max_weights_file_bytes(SHAPES, 16)
    assert limit == SHAPES.num_layers * 16 * sum(i + o for i, o in SHAPES.in_out.values()) * 8
    with open(w, "r+b") as f:
        f.truncate(header + limit + 1)  # sparse: nothing is written
    with pytest.raises(ValueError, match=f"more than a LoRA of rank max_lora_rank=16 .*{limit} bytes"):
        load_peft_adapter(p, 1, SHAPES, 16)
    # a header length past the end of the file
    with open(w, "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE}: not a readable safetensors file"):
        load_peft_adapter(p, 1, SHAPES, 16)


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_symlinked_file_out_of_the_allowed_root_is_refused(tmp_path, name):
    root = tmp_path / "root"
    p = _adapter(root, "a")
    outside = _adapter(tmp_path, "outside")
    os.remove(os.path.join(p, name))
    os.symlink(os.path.join(outside, name), os.path.join(p, name))
    with pytest.raises(AdapterFileError, match="outside the allowed LoRA root"):
        load_peft_adapter(p, 1, SHAPES, 16, allowed_root=str(root))
    assert load_peft_adapter(p, 1, SHAPES, 16).rank == 4  # no root: the link is followed
    # a link to a file inside the root is fine
    inside = _adapter(root, "b")
    os.remove(os.path.join(p, name))
    os.symlink(os.path.join(inside, name), os.path.join(p, name))
    assert load_peft_adapter(p, 1, SHAPES, 16, allowed_root=str(root)).rank == 4


def test_server_gives_one_answer_for_special_and_escaping_files(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = _adapter(tmp_path, "outside")
    eng = _FakeAsyncEngine()
    models = OpenAIServingModels(eng, ["base"], allowed_lora_root=str(root))
    cases = {}
    for kind, name in (("fifo", CONFIG_FILE), ("/dev/zero", CONFIG_FILE), ("escape", WEIGHTS_FILE)):
        p = _adapter(root, kind.strip("/").replace("/", "-"))
        os.remove(os.path.join(p, name))
        if kind == "escape":
            os.symlink(os.path.join(outside, name), os.path.join(p, name))
        else:
            _make_special(os.path.join(p, name), kind)
        cases[kind] = os.path.basename(p)
    messages = set()
    for rel in (*cases.values(), "missing"):
        err = _finishes(_load_error, models, "x", rel)["value"]
        assert err.param == "lora_path" and err.code == "invalid_lora_adapter"
        messages.add(err.message.replace(repr(rel), "<path>"))
    assert len(messages) == 1, messages
    assert "is not a loadable LoRA adapter" in messages.pop()
    assert eng.paths == []  # nothing reached the engine
    assert _load(models, "ok", os.path.basename(_adapter(root, "ok"))).allowed_root == str(root.resolve())


def test_file_changed_after_the_server_check_gets_the_same_answer(tmp_path, caplog):
    """The engine reads the files itself (again after an eviction): its refusal of a file
    swapped after the server's check is answered like any other non-adapter path."""

    class SwappingEngine(_FakeAsyncEngine):
        def _add(self, req):
            cfg = os.path.join(req.lora_path, CONFIG_FILE)
            os.remove(cfg)
            os.mkfifo(cfg)
            return load_peft_adapter(
                req.lora_path, req.lora_int_id, SHAPES, 16, allowed_root=req.allowed_root
            )

    root = tmp_path / "root"
    p = _adapter(root, "a")
    models = OpenAIServingModels(SwappingEngine(), ["base"], allowed_lora_root=str(root))

    async def run():
        return await asyncio.wait_for(models.load_lora_adapter("x", "a"), 120)

    with pytest.raises(APIError) as e:
        asyncio.run(run())
    assert e.value.status == 400 and e.value.param == "lora_path"
    assert e.value.message == _load_error(models, "y", "missing").message.replace("'missing'", "'a'")
    assert models.num_adapters() == 0
    assert any("is not a regular file" in r.getMessage() and p in r.getMessage() for r in caplog.records)


def test_fifo_adapter_is_refused_and_the_engine_keeps_serving(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    from kvserve import LLM, SamplingParams
    from kvserve.lora.peft import ModelShapes
    from kvserve.lora_request import LoRARequest
    from tests.engine.test_e2e_tiny import assert_idle
    from tests.lora.adapters import lora_tensors, write_adapter

    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj"]}
    t = lora_tensors(shapes.num_layers, shapes.in_out, 4, ("q_proj",))
    good = LoRARequest("good", 1, write_adapter(tmp_path / "good", cfg, t))
    other = LoRARequest("other", 2, write_adapter(tmp_path / "other", cfg, t))
    fifo = LoRARequest("fifo", 3, write_adapter(tmp_path / "fifo", cfg, t))
    os.remove(os.path.join(fifo.lora_path, CONFIG_FILE))
    os.mkfifo(os.path.join(fifo.lora_path, CONFIG_FILE))
    llm = LLM(model=str(tiny_llama_dir), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]

    def gen(lora):
        return [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        ]

    before = gen(good)
    out = _finishes(llm.llm_engine.add_lora, fifo)
    assert isinstance(out.get("error"), AdapterFileError) and "is not a regular file" in str(out["error"])
    assert 3 not in llm.llm_engine.list_loras()
    # ``good`` evicted from the CPU cache, then its config swapped for a FIFO: reading it again
    # is refused the same way
    assert gen(other) == before  # the same weights
    assert 1 not in llm.llm_engine.list_loras()
    os.remove(os.path.join(good.lora_path, CONFIG_FILE))
    os.mkfifo(os.path.join(good.lora_path, CONFIG_FILE))
    out = _finishes(gen, good)
    assert isinstance(out.get("error"), ValueError) and "is not a regular file" in str(out["error"])
    assert gen(other) == before and all(len(x) == 5 for x in before)
    assert_idle(llm.llm_engine)
