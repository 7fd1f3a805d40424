"""What a detection does: the text heuristics report by default and act only when the operator asks
(--anomaly-guard-action abort), the acceptance detector acts only with a trained draft, and no
detector acts on a request whose sampling the client constrained (docs/anomaly_guard.md)."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.errors import OutputAnomaly
from radixserve.sampling_params import SamplingParams
from radixserve.server.anomaly import AnomalyGuard, GuardConfig, GuardSettings, acceptance_action
from radixserve.server.metrics import ServerMetrics
from radixserve.server.serving import GenerationRun
from radixserve.server.tracker import ChoiceUpdate
from radixserve.server_config import ServerConfig
from tests.unit.test_filters import context

BYTE_TOKEN = 111    # a lone UTF-8 byte in the default tokenizer: decodes to U+FFFD
CONSTRAINED = {"logit_bias": {"logit_bias": {BYTE_TOKEN: 100.0}}, "min_tokens": {"min_tokens": 1},
               "grammar": {"json_schema": '{"type": "object"}'},
               "penalty": {"frequency_penalty": 0.5}}


def detections(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render(None).decode()
    return {(s.labels["kind"], s.labels["action"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "radixserve:anomaly_detections_total" and s.value}


def stopped(metrics: ServerMetrics) -> float:
    text = metrics.render(None).decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "radixserve:num_anomalies_total")


def run_bytes(tokenizer, guard: GuardSettings, params: SamplingParams) -> tuple[str, ServerMetrics]:
    """32 byte tokens (32 U+FFFD: `garbled`) through a GenerationRun with `guard`."""
    ctx = context(tokenizer, [BYTE_TOKEN] * 32)
    ctx.guard, ctx.metrics = guard, ServerMetrics("m")

    async def go() -> str:
        async with GenerationRun(ctx, "r", [[1]], params) as run:
            (result,) = await run.results()
        return result.outputs[0].text
    return asyncio.run(go()), ctx.metrics


def test_report_counts_and_returns_the_text(default_tokenizer):
    text, metrics = run_bytes(default_tokenizer, GuardSettings(), SamplingParams(max_tokens=32))
    assert text == default_tokenizer.decode([BYTE_TOKEN] * 32) and "\ufffd" in text
    assert detections(metrics) == {("garbled", "report"): 1.0} and stopped(metrics) == 0


def test_abort_stops_an_unconstrained_request(default_tokenizer):
    with pytest.raises(OutputAnomaly, match="garbled"):
        run_bytes(default_tokenizer, GuardSettings(text_action="abort"), SamplingParams(max_tokens=32))


@pytest.mark.parametrize("name", sorted(CONSTRAINED))
def test_abort_only_reports_a_constrained_request(default_tokenizer, name):
    params = SamplingParams(max_tokens=32, **CONSTRAINED[name])
    text, metrics = run_bytes(default_tokenizer, GuardSettings(text_action="abort"), params)
    assert text == default_tokenizer.decode([BYTE_TOKEN] * 32)
    assert detections(metrics) == {("garbled", "report"): 1.0} and stopped(metrics) == 0


def test_a_reporting_detector_reports_once_and_the_others_keep_judging():
    reports = []
    guard = AnomalyGuard(GuardConfig(), reported=frozenset({"garbled"}), report=reports.append)
    assert guard.feed(ChoiceUpdate(0, "ok " + "\ufffd" * 8)) is None
    assert guard.feed(ChoiceUpdate(0, "\ufffd" * 8)) is None
    assert [r.kind for r in reports] == ["garbled"]
    found = guard.feed(ChoiceUpdate(0, "\ue000\ue001\ue002"))   # rare_chars still acts
    assert found is not None and found.kind == "rare_chars"


def test_which_kinds_only_report():
    text = {"repetition", "garbled", "rare_chars"}
    assert GuardSettings().reported_kinds(SamplingParams()) == text | {"spec_acceptance"}
    act = GuardSettings(text_action="abort", acceptance_action="abort")
    assert act.reported_kinds(SamplingParams()) == frozenset()
    for fields in CONSTRAINED.values():
        assert act.reported_kinds(SamplingParams(**fields)) == text | {"spec_acceptance", "low_confidence"}
    assert not SamplingParams(ignore_eos=True, stop=("x",), temperature=0).client_constrained


@pytest.mark.parametrize("algorithm, action", [("EAGLE", "abort"), ("NEXTN", "abort"),
                                               ("eagle", "abort"), ("ngram", "report"),
                                               ("draft", "report"), (None, "report")])
def test_auto_acts_only_with_a_trained_draft(algorithm, action):
    assert acceptance_action("auto", algorithm) == action
    assert acceptance_action("report", "EAGLE") == "report"
    assert acceptance_action("abort", "ngram") == "abort"


def test_settings_from_flags():
    plain = GuardSettings.from_config(ServerConfig())
    assert plain.text_action == "report" and plain.acceptance is None
    eagle = GuardSettings.from_config(ServerConfig(), "EAGLE")
    assert eagle.acceptance is not None and eagle.acceptance_action == "abort"
    ngram = GuardSettings.from_config(ServerConfig(anomaly_guard_action="abort"), "ngram")
    assert ngram.text_action == "abort" and ngram.acceptance_action == "report"
    assert GuardSettings.from_config(ServerConfig(disable_anomaly_guard=True), "EAGLE") is None


def test_every_detector_kind_is_a_known_output_anomaly_kind():
    """Metrics start a zero series per OUTPUT_ANOMALY_KINDS entry (a dashboard query needs one before any anomaly)."""
    from radixserve.errors import OUTPUT_ANOMALY_KINDS
    from radixserve.server.acceptance_guard import AcceptanceDetector
    from radixserve.server.anomaly import KINDS
    from radixserve.server.confidence_guard import ConfidenceDetector
    assert set(OUTPUT_ANOMALY_KINDS) == {*KINDS, AcceptanceDetector.kind, ConfidenceDetector.kind, "kv_checksum"}
