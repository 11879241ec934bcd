"""Pure parts of data parallelism: the benchmark's shared-prefix workload from Mooncake rows, and
the merge of the replicas' Prometheus families under a ``replica`` label."""

import pytest

from kvserve.benchmarks.data_parallel import shared_prefix_requests

CORPUS = list(range(1000, 3000))


def _rows():
    return [
        {"hash_ids": [7, 8, 9], "output_length": 50},
        {"hash_ids": [1], "output_length": 3},
        {"hash_ids": [7, 8, 10, 11], "output_length": 5},
        {"hash_ids": [2, 3], "output_length": 4},
        {"hash_ids": [7, 12], "output_length": 2},
        {"hash_ids": [4], "output_length": 1},
    ]


def test_shared_prefix_requests_keep_the_trace_prefix_structure():
    reqs = shared_prefix_requests(
        _rows(), CORPUS, groups=1, singles=2, block_tokens=4, max_blocks=3, max_output_len=8
    )
    # group 7 (3 rows) and the first two singles, in trace order
    assert [len(r.prompt_token_ids) for r in reqs] == [12, 4, 12, 8, 8]
    a, b, c = reqs[0].prompt_token_ids, reqs[2].prompt_token_ids, reqs[4].prompt_token_ids
    assert a[:8] == b[:8] and a[8:] != b[8:]  # hash ids 7, 8 shared; 9 vs 10
    assert a[:4] == c[:4] and a[4:8] != c[4:8]
    assert reqs[1].prompt_token_ids != a[:4]
    assert [r.output_len for r in reqs] == [8, 3, 5, 4, 2]  # capped at max_output_len
    assert [r.id for r in reqs] == list(range(5))


def test_a_cut_keeps_prefix_groups_whole():
    # trace order: single 1, single 2, group 7 (3 rows); a plain cut to 2 would keep two singles
    rows = [_rows()[1], _rows()[3], _rows()[0], _rows()[2], _rows()[4]]
    reqs = shared_prefix_requests(rows, CORPUS, 1, 2, 4, 3, 8, num_requests=2)
    assert len(reqs) == 2
    assert reqs[0].prompt_token_ids[:8] == reqs[1].prompt_token_ids[:8]  # both of group 7
    reqs = shared_prefix_requests(rows, CORPUS, 1, 2, 4, 3, 8, num_requests=4)
    # the whole group, then the first single; trace order kept
    assert [len(r.prompt_token_ids) for r in reqs] == [4, 12, 12, 8]


def test_shared_prefix_requests_need_hash_ids():
    with pytest.raises(ValueError, match="hash_ids"):
        shared_prefix_requests([{"input_length": 5}], CORPUS, 1, 1, 4, 3, 8)


def test_merge_replica_families_labels_every_sample():
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from kvserve.distributed.dp_metrics import merge_replica_families

    def fams(running, ok):
        g = GaugeMetricFamily("kvserve:num_requests_running", "Running.", labels=["model_name"])
        g.add_metric(["m"], running)
        c = CounterMetricFamily("kvserve:request_success", "Done.", labels=["model_name", "finished_reason"])
        c.add_metric(["m", "stop"], ok)
        return [g, c]

    merged = merge_replica_families([(0, fams(2, 5)), (1, fams(3, 7))])
    assert [f.name for f in merged] == ["kvserve:num_requests_running", "kvserve:request_success"]
    running = {s.labels["replica"]: s.value for s in merged[0].samples}
    assert running == {"0": 2, "1": 3}
    ok = {
        (s.labels["replica"], s.labels["finished_reason"]): s.value
        for s in merged[1].samples
        if s.name.endswith("_total")
    }
    assert ok == {("0", "stop"): 5, ("1", "stop"): 7}


def test_bad_ray_address_fails_fast_naming_the_field():
    import socket
    import time

    from kvserve.distributed.launcher import check_ray_address

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"ray_address '127.0.0.1:{port}': no Ray head answers"):
        check_ray_address(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 6
    for bad in ("nohost", "host:", ":6379", "host:port"):
        with pytest.raises(ValueError, match="ray_address must be 'auto' or HOST:PORT"):
            check_ray_address(bad)
    check_ray_address("auto")  # left to Ray


def test_bad_ray_address_is_a_cli_error_before_any_replica_starts(tiny_llama_dir):
    import socket

    from kvserve.entrypoints.openai.api_server import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pytest.importorskip("ray")
    argv = ["--model", str(tiny_llama_dir), "--data-parallel-size", "2", "--ray-address", f"127.0.0.1:{port}"]
    assert main(argv) == 2
