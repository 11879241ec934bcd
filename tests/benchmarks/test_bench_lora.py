"""``kvserve bench lora`` at a tiny size: every scenario runs, nothing fails, the JSON holds the
ratios, the adapter load time and the profile."""

import json


def test_lora_bench_tiny_run(tiny_llama_dir, tmp_path, capsys):
    from kvserve.benchmarks.lora import main

    work = tmp_path / "w.jsonl"
    work.write_text(
        "\n".join(
            json.dumps({"id": i, "prompt_token_ids": [5 + i, 6, 7, 8], "output_len": 3}) for i in range(5)
        )
        + "\n"
    )
    out = tmp_path / "lora.json"
    rc = main(
        [
            "--model",
            str(tiny_llama_dir),
            "--workload",
            str(work),
            "--dtypes",
            "float32",
            "--rank",
            "4",
            "--profile-steps",
            "1",
            "--scenarios",
            "base,lora4,lora16,base16",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vs base" in printed and "lora16" in printed
    res = json.loads(out.read_text())["results"]["float32"]
    assert res["base"]["vs_base"] == 1.0
    for scen, n in (("lora4", 4), ("lora16", 16)):
        r = res[scen]
        assert r["failed"] == 0 and r["output_tokens"] == 15 and r["adapters"] == n
        assert r["vs_base"] > 0 and r["adapter_load_ms"] > 0
        assert 0 < r["profile"]["lora_share"] < 1
    # 16 adapters through 4 slots: slots were refilled
    assert res["lora16"]["slot_loads"] > 4 and res["lora16"]["slot_load_ms"] > 0
    # base16: no adapters, the batch capped at 16 sequences
    assert res["base16"]["adapters"] == 0 and res["base16"]["output_tokens"] == 15
    assert res["base16"]["max_num_seqs"] == 16 and res["base"]["max_num_seqs"] > 16
    assert res["base16"]["slot_loads"] == 0 and res["base16"]["slot_load_ms"] is None
