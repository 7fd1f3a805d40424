"""`radixserve fleet --num-prefill N --num-decode M`: the worker command lines (roles, ports, bootstrap ports) and flag errors."""
from __future__ import annotations

import pytest

from radixserve.config import from_args
from radixserve.router.config import RouterConfig
from radixserve.router.fleet import build_parser, worker_commands


def commands(argv):
    args, rest = build_parser().parse_known_args(argv)
    return worker_commands(args, from_args(RouterConfig, args), rest)


def test_pd_fleet_commands():
    cmds = commands(["--num-prefill", "2", "--num-decode", "1", "--port", "40000",
                     "--model-path", "m"])
    assert [url for url, _ in cmds] == [f"http://127.0.0.1:{p}" for p in (40001, 40002, 40003)]
    roles = [cmd[cmd.index("--disaggregation-mode") + 1] for _, cmd in cmds]
    assert roles == ["prefill", "prefill", "decode"]
    ports = [cmd[cmd.index("--disaggregation-bootstrap-port") + 1] for _, cmd in cmds[:2]]
    assert ports == ["40004", "40005"]
    assert "--disaggregation-bootstrap-port" not in cmds[2][1]
    assert all("--model-path" in cmd for _, cmd in cmds)


@pytest.mark.parametrize("argv", [["--num-prefill", "1"], ["--num-decode", "1"],
                                  ["--num-workers", "2", "--num-prefill", "1", "--num-decode", "1"],
                                  []])
def test_pd_fleet_flag_errors(argv):
    with pytest.raises(ValueError):
        commands(argv)


def test_colocated_fleet_unchanged():
    cmds = commands(["--num-workers", "2", "--port", "41000"])
    assert len(cmds) == 2 and all("--disaggregation-mode" not in cmd for _, cmd in cmds)
