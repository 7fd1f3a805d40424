"""`radixserve serve --tp-size 2`, `--cp-size 2 --enable-layer-split`, `--pp-size 2` (one follower process beside the
engine) and `--pp-size 2 --tp-size 2` (three): the same greedy text as the single-process tiny server, and a clean
stop (the followers leave on rank 0's stop message, not on a broken connection)."""
from __future__ import annotations

import pytest

from tests.api.conftest import API_KEY, TINY_CONTEXT, ServerProcess, start_tiny_server, terminate

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]


def completion_texts(server, model: str) -> list[str]:
    client = server.client()
    return [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in PROMPTS]


@pytest.mark.parametrize("flags, field, world", [(["--tp-size", "2"], "tp_size", 2),
                                                 (["--cp-size", "2", "--enable-layer-split"], "cp_size", 2),
                                                 (["--pp-size", "2", "--tp-size", "2"], "pp_size", 4)],
                         ids=["tp2", "cp2-layer-split", "pp2-tp2"])
def test_multi_rank_server_gives_one_ranks_text_and_stops_cleanly(request, tiny_server, flags, field, world):
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT), "--max-total-tokens", "16384",
                                         "--page-size", "16", "--served-model-name", "tiny", *flags],
                               api_key=API_KEY, log_level="info")
    try:
        assert server.stats()["runner"][field] == 2
        assert completion_texts(server, "tiny") == completion_texts(tiny_server, "tiny")
        terminate(server.proc)
        assert server.proc.returncode == 0
        log = server.output(tail_chars=None)
        assert "tensor-parallel rank" not in log and "Traceback" not in log, log[-4000:]
        assert all(f"rank {r} of {world} joined" in log for r in range(1, world))
    finally:
        server.stop()


def test_two_nodes_one_rank_each(request, tiny_server):
    """`--nnodes 2` on this machine: node 0 (`--node-rank 0`) serves the API with rank 0, node 1 (`--node-rank 1`,
    the same engine flags) runs rank 1 only (ranks node_rank * ranks per node + local) and answers /health and /live
    for its probes, nothing else; the text is one process's, and stopping node 0 ends node 1 with code 0."""
    from radixserve.runner.tp import free_init_addr

    common = ["--model-path", str(request.getfixturevalue("tiny_model_dir")), "--context-length", str(TINY_CONTEXT),
              "--max-total-tokens", "16384", "--page-size", "16", "--served-model-name", "tiny", "--tp-size", "2",
              "--nnodes", "2", "--dist-init-addr", free_init_addr()]
    node1 = ServerProcess([*common, "--node-rank", "1"], log_level="info")
    node0 = None
    try:
        node0 = ServerProcess([*common, "--node-rank", "0"], api_key=API_KEY, log_level="info").wait_ready()
        assert node0.stats()["runner"]["tp_size"] == 2
        assert completion_texts(node0, "tiny") == completion_texts(tiny_server, "tiny")
        assert [node1.get(path).status_code for path in ("/health", "/live", "/v1/models")] == [200, 200, 404]
        terminate(node0.proc)
        assert node0.proc.returncode == 0 and node1.proc.wait(60) == 0
        log = node1.output(tail_chars=None)
        assert "rank 1 of 2 joined" in log and "Traceback" not in log, log[-4000:]
    finally:
        node1.stop()
        if node0 is not None:
            node0.stop()
