"""The single-row (batch-1) linear path: every path gives F.linear's result, `choose` takes the
fastest pass over the layers and sets it on all of them, the environment pins it, and layers
whose M = 1 does not run on a float weight offer nothing to choose."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from radixserve.layers import row_path
from radixserve.layers.linear import Linear
from radixserve.layers.quant_linear import Int8Weight, kernel_available


def layers(n: int = 3, bias: bool = True) -> list[Linear]:
    gen = torch.Generator().manual_seed(0)
    made = []
    for i in range(n):
        layer = Linear(64 + 32 * i, 96, bias=bias)
        layer.weight.data.copy_(torch.randn(96, 64 + 32 * i, generator=gen))
        if bias:
            layer.bias.data.copy_(torch.randn(96, generator=gen))
        layer.prepare()
        made.append(layer)
    return made


def test_every_single_row_path_matches_f_linear_and_larger_inputs_are_unaffected():
    layer = layers(1)[0]
    assert set(layer.row_paths()) == {"split", "linear", "packed"}
    x1, x8 = torch.randn(1, 64), torch.randn(8, 64)
    ref1 = torch.nn.functional.linear(x1, layer.weight, layer.bias)
    before8 = layer(x8)
    for path in row_path.PATHS:
        layer.use_row_path(path)
        assert layer.row_path == path
        got = layer(x1)
        assert got.shape == (1, 96) and got.dtype == torch.float32
        assert torch.allclose(got, ref1, rtol=1e-5, atol=1e-5), path
        assert torch.equal(layer(x8), before8), "M > 1 keeps its own path"


def costing(made: list[Linear], costs: dict[str, float]):
    """A fake clock: every reading adds the cost of the path the first layer is on, so a pass
    (end - start) costs what `costs` says for it."""
    ticks = {"t": 0.0}

    def clock() -> float:
        ticks["t"] += costs[made[0].row_path]
        return ticks["t"]
    return clock


def untimed() -> float:
    pytest.fail("nothing is timed")


def test_choose_takes_the_fastest_path_and_sets_it_on_every_layer(monkeypatch, tmp_path):
    monkeypatch.delenv(row_path.ENV, raising=False)
    for n, costs in enumerate(({"split": 3.0, "linear": 1.0, "packed": 2.0}, {"split": 1.0, "linear": 3.0, "packed": 2.0},
                               {"split": 2.0, "linear": 3.0, "packed": 1.0})):
        monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / str(n)))   # nothing kept from the last table
        made = layers()
        chosen = row_path.choose(made, clock=costing(made, costs))
        assert chosen == min(costs, key=costs.get)
        assert all(m.row_path == chosen for m in made)


def test_a_machine_keeps_its_first_decision_so_every_server_there_rounds_alike(monkeypatch, tmp_path):
    """A second server on the machine, whose own timing would pick another path, takes the kept
    one untimed; other layer shapes are a decision of their own; a broken file is re-decided."""
    monkeypatch.delenv(row_path.ENV, raising=False)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    first = layers()
    assert row_path.choose(first, clock=costing(first, {"split": 3.0, "linear": 1.0, "packed": 2.0})) == "linear"
    second = layers()
    assert row_path.choose(second, clock=untimed) == "linear"
    assert all(m.row_path == "linear" for m in second)
    other = layers(2)
    assert row_path.choose(other, clock=costing(other, {"split": 1.0, "linear": 3.0, "packed": 2.0})) == "split"
    assert row_path.choose(layers(), clock=untimed) == "linear"
    assert len(json.loads((tmp_path / "row_path.json").read_text())) == 2
    (tmp_path / "row_path.json").write_text("{not json")
    again = layers()
    assert row_path.choose(again, clock=costing(again, {"split": 2.0, "linear": 3.0, "packed": 1.0})) == "packed"


def test_a_server_starting_while_another_decides_waits_and_takes_its_decision(monkeypatch, tmp_path):
    """The decision is made under a file lock: a server that arrives while it is held gets the
    holder's path, never a timing of its own."""
    monkeypatch.delenv(row_path.ENV, raising=False)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    made = layers()
    key = row_path.decision_key(made, row_path.PATHS)
    got: dict[str, str] = {}
    with row_path._locked_decisions() as (decisions, save):
        waiter = threading.Thread(target=lambda: got.update(path=row_path.choose(made, clock=untimed)))
        waiter.start()
        save({**decisions, key: "packed"})
    waiter.join(timeout=60)
    assert got == {"path": "packed"}


def test_an_unusable_cache_dir_still_times_the_paths(monkeypatch, tmp_path):
    monkeypatch.delenv(row_path.ENV, raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "file" / "sub"))
    made = layers()
    assert row_path.choose(made, clock=costing(made, {"split": 2.0, "linear": 1.0, "packed": 3.0})) == "linear"


def test_a_pass_times_the_leading_layers_up_to_the_byte_cap():
    made = layers(3)   # 96 x 64, 96 x 96, 96 x 128 fp32: 24,576, 36,864, 49,152 bytes
    assert row_path.timed_prefix(made, 1) == made[:1]
    assert row_path.timed_prefix(made, 24_577) == made[:2]
    assert row_path.timed_prefix(made, 61_440) == made[:2]
    assert row_path.timed_prefix(made, 1 << 30) == made


def test_the_environment_pins_the_path_and_an_unknown_one_is_refused(monkeypatch):
    made = layers()
    monkeypatch.setenv(row_path.ENV, "linear")
    assert row_path.choose(made, clock=untimed) == "linear"
    assert all(m.row_path == "linear" for m in made)
    half = [m.to(torch.bfloat16) for m in layers()]
    for m in half:
        m.prepare()
    own = half[0].row_path   # packed where oneDNN packs bf16 here, else linear
    assert own in ("packed", "linear")
    monkeypatch.setenv(row_path.ENV, "split")   # not offered for bf16: prepare's own, untimed
    assert row_path.choose(half, clock=untimed) == own
    monkeypatch.setenv(row_path.ENV, "gemv")
    with pytest.raises(ValueError, match="gemv"):
        row_path.choose(made)


def test_layers_without_a_float_single_row_path_offer_none():
    """batch-invariant mode (packed for every M), a layer whose M = 1 runs on a quantized
    kernel, and a screened LM head: nothing to choose; a bf16 weight offers no split."""
    invariant = Linear(64, 96)
    invariant.weight.data.normal_()
    invariant.prepare(batch_invariant=True)
    assert invariant.row_paths() == () and row_path.choose([invariant]) is None
    half = Linear(64, 96).to(torch.bfloat16)
    half.prepare()
    assert "split" not in half.row_paths() and "linear" in half.row_paths()
    if kernel_available(Int8Weight):
        head = layers(1, bias=False)[0]
        assert head.enable_screened_head(4, 8)
        assert head.row_paths() == ()
        quant = Linear(64, 96)
        quant.load(Int8Weight.from_float(torch.randn(96, 64)))
        quant.prepare(quantized_max_tokens=0)
        assert quant.quantized and quant.row_paths() == ()


def test_the_model_prepares_every_float_layer_on_one_path(monkeypatch, tiny_llama_dir):
    from radixserve.cli import build_runner
    from radixserve.engine_config import EngineConfig

    monkeypatch.setenv(row_path.ENV, "packed")
    runner = build_runner(EngineConfig(model_path=str(tiny_llama_dir)))
    rows = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert rows and all(m.row_path == "packed" for m in rows)
