"""C58 at the bootstrap handshake: the Expect carries the decode worker's parallel layout and layer ids; the prefill
worker refuses a pair that is not built, or layer metadata that does not pair layer for layer, naming both layouts,
and the request fails on both legs (kv_transfer_failed, never tokens) with nothing leaked. Over the fake runner, on
loopback TCP (the layouts travel through the real msgpack encoding). End to end: tests/api/test_pd_cp.py."""
from __future__ import annotations

import msgspec
import pytest

from radixserve.disagg.protocol import Expect, KVLayout
from tests.unit.pd_helpers import Rig, greedy, pd_engine
from tests.unit.test_engine import reference
from tests.unit.test_pd_engine import assert_idle

BASE = KVLayout(page_size=4, kv_dtype="fake", num_layers=3, num_kv_heads=1, head_dim=1, model="fake",
                layer_ids=(0, 1, 2))


def run_pair(prefill_layout: KVLayout, decode_layout: KVLayout) -> tuple[Rig, dict]:
    p, d = pd_engine("prefill"), pd_engine("decode")
    p.prefill.layout, d.decode.layout = prefill_layout, decode_layout
    rig = Rig(p, d)
    try:
        rig.submit(p, d, "r", [3, 1, 4, 1, 5, 9, 2], greedy(4), room=11)
        rig.finish("r", "p-r")
        rig.idle()
        assert_idle(p, d)
        return rig, {"transfers": d.stats()["pd"], "bootstrap_failures": p.stats()["pd"]["bootstrap_failures"]}
    finally:
        rig.close()


@pytest.mark.parametrize("prefill, decode", [
    (dict(cp_size=2), {}), ({}, dict(tp_size=2)), (dict(cp_size=2), dict(tp_size=2)),
    (dict(cp_size=2, layer_split=True), {}), (dict(cp_size=4, layer_split=True), dict(tp_size=2)),
    (dict(tp_size=2), {}), (dict(tp_size=2), dict(tp_size=4))],
    ids=["cp2-tp1", "cp1-tp2", "cp2-tp2", "layer-split-cp2-tp1", "layer-split-cp4-tp2", "tp2-tp1", "tp2-tp4"])
def test_built_pairs_pass_the_handshake(prefill, decode):
    rig, _ = run_pair(msgspec.structs.replace(BASE, **prefill), msgspec.structs.replace(BASE, **decode))
    assert rig.tokens["r"] == reference([3, 1, 4, 1, 5, 9, 2], 4)
    assert rig.finals["r"].error is None


@pytest.mark.parametrize("prefill, decode, message", [
    (dict(tp_size=2), dict(pp_size=2), "prefill worker tp=2 cp=1 pp=1 -> decode worker tp=1 cp=1 pp=2"),
    ({}, dict(cp_size=2), "prefill worker tp=1 cp=1 pp=1 -> decode worker tp=1 cp=2 pp=1"),
    (dict(cp_size=2), dict(tp_size=2, cp_size=2, layer_split=True),
     "prefill worker tp=1 cp=2 pp=1 -> decode worker tp=2 cp=2 pp=1 with layer split"),
    (dict(pp_size=2), {}, "prefill worker tp=1 cp=1 pp=2 -> decode worker tp=1 cp=1 pp=1"),
    (dict(pp_size=2), dict(pp_size=2), "prefill worker tp=1 cp=1 pp=2 -> decode worker tp=1 cp=1 pp=2"),
    ({}, dict(layer_ids=(0, 2, 1)), "KV layer ids on decode are [0, 2, 1], not layers 0..2 in order"),
    (dict(layer_ids=(1, 2, 3)), {}, "KV layer ids on prefill are [1, 2, 3]"),
    ({}, dict(num_layers=4, layer_ids=(0, 1, 2, 3)), "num_layers is 3 on prefill but 4 on decode"),
], ids=["tp2-to-pp2", "cp2-decode", "cp2-to-layer-split", "pp2-prefill", "pp2-pair", "reordered-layers",
        "shifted-layers", "layer-count"])
def test_refused_pair_fails_both_legs_at_the_handshake(prefill, decode, message):
    rig, stats = run_pair(msgspec.structs.replace(BASE, **prefill), msgspec.structs.replace(BASE, **decode))
    for rid in ("r", "p-r"):
        final = rig.finals[rid]
        assert final.error_code == "kv_transfer_failed" and message in final.error, final.error
    assert rig.tokens.get("r", []) == []                 # no text reaches the client
    assert stats["bootstrap_failures"] == 1 and stats["transfers"]["transfers_failed"] == 1


def test_layout_survives_the_wire():
    """What the decode worker encodes is what the prefill worker checks: layer ids keep their order."""
    layout = msgspec.structs.replace(BASE, layer_ids=(2, 0, 1), cp_size=2)
    sent = Expect(room=1, page_ids=[0], num_prompt_tokens=1, prompt_crc=0, seed=0, layout=layout)
    got = msgspec.msgpack.Decoder(Expect).decode(msgspec.msgpack.encode(sent))
    assert got.layout == layout and got.layout.layer_ids == (2, 0, 1)
