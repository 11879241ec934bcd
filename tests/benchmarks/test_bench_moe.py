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
