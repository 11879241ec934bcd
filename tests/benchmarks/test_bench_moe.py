"""``kvserve bench moe`` on a tiny layer: every mode is checked against the loop, the table and
JSON carry every cell."""

import json

from kvserve.benchmarks import moe


def test_bench_moe_writes_every_cell(tmp_path, capsys):
    out = tmp_path / "moe.json"
    rc = moe.main(
        ["--device", "cpu", "--shape", "tiny:32:16:4:2", "--rows", "1,9", "--repeats", "1", "--warmup", "0"]
        + ["--target", "0", "--json-out", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert [c["rows"] for c in data["cells"]] == [1, 9]
    for c in data["cells"]:
        assert c["per_expert_loop_s"] > 0 and c["auto_s"] > 0 and c["bmm_s"] > 0 and c["loop_s"] > 0
        assert c["speedup"] == c["per_expert_loop_s"] / c["auto_s"]
        assert 1 <= c["active_experts"] <= 4
    assert "speedup" in capsys.readouterr().out
    assert "native_s" in data["cells"][0]


def test_bench_moe_end_to_end_compares_both_paths(tmp_path, capsys):
    """``--end-to-end`` on two short requests and one tiny family: both implementations run, their
    MoE seconds are measured and their greedy outputs (equal here) compared."""
    wl = tmp_path / "w.jsonl"
    reqs = [
        {"prompt_token_ids": [1, 5, 9, 200, 31], "output_len": 4},
        {"prompt_token_ids": [7] * 12, "output_len": 3},
    ]
    wl.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "e2e.json"
    rc = moe.main(
        ["--end-to-end", "--family", "tiny-qwen3-moe", "--workload", str(wl), "--max-tokens", "4"]
        + ["--rounds", "1", "--target", "0", "--json-out", str(out)]
    )
    assert rc == 0
    fam = json.loads(out.read_text())["families"]["tiny-qwen3-moe"]
    assert fam["layers"] == 2
    assert fam["sequences"] == 2 and fam["equal_sequences"] == 2
    for impl in ("per_expert", "auto"):
        (run,) = fam[impl]
        assert run["moe_s"] > 0 and run["output_tokens"] == 7
    assert fam["moe_speedup"] == fam["per_expert"][0]["moe_s"] / fam["auto"][0]["moe_s"]
    assert "greedy sequences equal" in capsys.readouterr().out
