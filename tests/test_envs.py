"""``kvserve.envs``: every ``KVSERVE_*`` variable the package names is declared there, parsed
at each access, and listed by ``kvserve doctor``."""

import json
import re
from pathlib import Path

import pytest

import kvserve
from kvserve import envs
from kvserve.entrypoints import doctor

PACKAGE = Path(kvserve.__file__).parent


def test_every_variable_the_package_names_is_declared():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bKVSERVE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert named, "the scan found no KVSERVE_ names at all"
    assert named <= set(envs.VARIABLES), sorted(named - set(envs.VARIABLES))


def test_values_are_parsed_at_each_access(monkeypatch):
    monkeypatch.delenv("KVSERVE_NUM_THREADS", raising=False)
    assert envs.KVSERVE_NUM_THREADS is None
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "0")
    assert envs.KVSERVE_NUM_THREADS == 1  # at least one thread
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    assert envs.KVSERVE_NATIVE is False
    monkeypatch.setenv("KVSERVE_NATIVE", "yes")
    assert envs.KVSERVE_NATIVE is True
    monkeypatch.setenv("KVSERVE_QUANT_ACT", " INT8 ")
    assert envs.KVSERVE_QUANT_ACT == "int8"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", "/tmp/kv-cache-here")
    assert envs.cache_root() == Path("/tmp/kv-cache-here")


@pytest.mark.parametrize(
    "name,raw",
    [("KVSERVE_QUANT_ACT", "int4"), ("KVSERVE_TP_SHARD_EMBEDDING", "yes"), ("KVSERVE_TP_TIMEOUT_S", "soon")],
)
def test_a_bad_value_names_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        getattr(envs, name)


def test_an_empty_api_key_stays_set_so_the_server_can_refuse_it(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "")
    assert envs.KVSERVE_API_KEY == ""
    with pytest.raises(AttributeError):
        envs.KVSERVE_NO_SUCH_VARIABLE  # noqa: B018


def test_doctor_lists_every_variable_and_hides_the_api_key(capsys, monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "sk-secret-value")
    monkeypatch.setenv("KVSERVE_QUANT_ACT", "bogus")
    rows = {r["name"]: r for r in doctor.gather()["environment"]}
    assert set(rows) == set(envs.VARIABLES)
    assert rows["KVSERVE_API_KEY"]["value"] == "<set>"
    assert rows["KVSERVE_QUANT_ACT"]["value"].startswith("invalid: KVSERVE_QUANT_ACT='bogus'")
    json.dumps(rows, default=str)
    doctor._print(doctor.gather())
    out = capsys.readouterr().out
    assert "sk-secret-value" not in out and "KVSERVE_TP_TIMEOUT_S" in out
