"""``kvserve bench heavy-neighbours`` runs end to end on the tiny model with small sizes and
writes one row per scenario."""

import json

import pytest

from kvserve.benchmarks import heavy_neighbours


@pytest.mark.slow  # starts a server process
def test_heavy_neighbours_small_run(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "hn.json"
    args = ["--model", str(tiny_llama_dir), "--pl-prompts", "3", "--pl-len", "40", "--echo-prompts", "2"]
    args += ["--beam-width", "3", "--beam-tokens", "3", "--beam-prompt-len", "8", "--neighbour-len", "8"]
    args += ["--neighbour-tokens", "2", "--decode-tokens", "4", "--delay-s", "0.05", "--json-out", str(out)]
    assert heavy_neighbours.main(args + ["--", "--dtype", "float32"]) == 0
    result = json.loads(out.read_text())
    assert result["solo_ttft_s"] > 0
    rows = {r["scenario"]: r for r in result["scenarios"]}
    assert set(rows) == set(heavy_neighbours.SCENARIOS)
    for r in rows.values():
        assert r["heavy_status"] == 200 and r["neighbour_ttft_s"] > 0, r
        assert r["rss_peak_growth_mib"] is not None
    # the prompt-logprob answer carries 3 x 39 positions of up to 21 entries, the plain one none
    assert rows["prompt_logprobs"]["heavy_response_bytes"] > 10 * rows["plain"]["heavy_response_bytes"]
    assert "neighbour solo TTFT" in capsys.readouterr().out


def test_heavy_neighbours_refuses_an_unwritable_json_out(tmp_path, capsys):
    assert heavy_neighbours.main(["--json-out", str(tmp_path)]) == 2
    assert "--json-out" in capsys.readouterr().err
