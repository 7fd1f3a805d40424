"""ModelRunner vs transformers on tiny random Llamas, driven by hand-built lists of ScheduledSeq.

Every sampled token is checked against transformers' full-sequence forward: same greedy id and
the same top-5 logprobs (1e-4). Scenarios: one prefill; a prefill split in chunks across steps
(start_pos > 0 attends to cached pages); decode steps; one batch mixing decodes and prefills
in both orders; page sizes 1 / 16 / a prompt that is no multiple of the page; GQA and MHA.
"""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine.runner_api import ScheduledSeq
from radixserve.engine_config import EngineConfig
from radixserve.runner.attention.torch_backend import TorchAttentionBackend
from radixserve.runner.model_runner import ModelRunner
from radixserve.sampling_params import SamplingParams
from tests.conftest import build_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=64, logprobs=5)
ATOL = 1e-4


class Seq:
    """A test-side request: prompt, outputs so far, and its (shuffled) pages."""

    def __init__(self, rid: str, prompt: list[int], pages: list[int]):
        self.rid, self.prompt, self.output, self.pages = rid, prompt, [], pages
        self.computed = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def chunk(self, n: int | None = None, prompt_logprobs: bool = False) -> ScheduledSeq:
        """The next n uncomputed tokens (all when None) as a ScheduledSeq."""
        end = len(self.tokens) if n is None else min(self.computed + n, len(self.tokens))
        ids = self.tokens[self.computed:end]
        params = SamplingParams(temperature=0, max_tokens=64, logprobs=5, prompt_logprobs=3)
        return ScheduledSeq(self.rid, ids, self.computed, self.pages, end == len(self.tokens),
                            params if prompt_logprobs else GREEDY, 7, self.prompt,
                            list(self.output), 0, self.computed if prompt_logprobs else None)


class Harness:
    """Runs batches and checks every sampled token against transformers."""

    def __init__(self, folder, page_size: int, seed: int = 0, **config):
        """`config`: further EngineConfig fields (device, attention_backend, ...)."""
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.runner = ModelRunner.from_config(EngineConfig(
            model_path=str(folder), page_size=page_size, max_total_tokens=4096, **config))
        self.page_size = page_size
        self.free = list(range(self.runner.num_pages))
        random.Random(seed).shuffle(self.free)  # non-contiguous page tables
        self.rng = random.Random(seed + 1)
        self.vocab = self.runner.vocab_size

    def new_seq(self, rid: str, prompt_len: int, max_len: int = 200) -> Seq:
        pages = [self.free.pop() for _ in range(-(-max_len // self.page_size))]
        return Seq(rid, [self.rng.randrange(3, self.vocab) for _ in range(prompt_len)], pages)

    @torch.inference_mode()
    def reference(self, tokens: list[int]) -> torch.Tensor:
        """log_softmax of transformers' logits, (len(tokens), V)."""
        return torch.log_softmax(self.hf(torch.tensor([tokens])).logits[0].float(), -1)

    def step(self, items: list[tuple[Seq, ScheduledSeq]]) -> None:
        out = self.runner.run([s for _, s in items])
        assert [r.request_id for r in out] == [s.request_id for _, s in items]
        for (seq, sched), res in zip(items, out):
            seq.computed = sched.start_pos + len(sched.input_ids)
            ref = self.reference(seq.tokens[:seq.computed])
            if sched.prompt_logprob_start is not None:
                self.check_prompt_logprobs(seq, sched, res.prompt_logprobs, ref)
            if not sched.sample:
                assert not res.token_ids
                continue
            expected = ref[-1]
            top_ref = torch.topk(expected, 5)
            assert res.token_ids[-1] == int(top_ref.indices[0]), (
                f"{seq.rid}: greedy {res.token_ids[-1]} != transformers {int(top_ref.indices[0])} "
                f"at position {seq.computed} (top-2 gap {float(top_ref.values[0] - top_ref.values[1]):.3g})")
            assert abs(res.logprobs[-1].logprob - float(top_ref.values[0])) < ATOL
            assert [t for t, _ in res.logprobs[-1].top] == top_ref.indices.tolist()
            assert torch.allclose(torch.tensor([lp for _, lp in res.logprobs[-1].top]), top_ref.values, atol=ATOL)
            seq.output.append(res.token_ids[-1])

    @staticmethod
    def check_prompt_logprobs(seq: Seq, sched: ScheduledSeq, got, ref: torch.Tensor) -> None:
        end = min(seq.computed, len(seq.prompt) - 1)
        positions = range(sched.start_pos + 1, end + 1)
        assert len(got) == len(positions)
        full = None
        for q, lp in zip(positions, got):
            if q - 1 >= ref.shape[0]:
                continue
            row = ref[q - 1]
            assert lp.token_id == seq.prompt[q]
            assert abs(lp.logprob - float(row[seq.prompt[q]])) < ATOL
            assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
            full = q
        assert full is not None or not got


@pytest.mark.parametrize("page_size", [1, 16])
def test_single_prefill_then_decode(gqa_dir, page_size):
    h = Harness(gqa_dir, page_size)
    seq = h.new_seq("a", 37)  # 37: no multiple of 16
    h.step([(seq, seq.chunk())])
    for _ in range(6):
        h.step([(seq, seq.chunk())])
    assert len(seq.output) == 7


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chunked_prefill_across_steps(gqa_dir, page_size):
    h = Harness(gqa_dir, page_size, seed=page_size)
    seq = h.new_seq("a", 45)
    for n in (7, 16, 1, 9):            # start_pos 0, 7, 23, 24: partial pages, a 1-token chunk
        h.step([(seq, seq.chunk(n))])
        assert not seq.output
    h.step([(seq, seq.chunk())])     # the rest, sampling the first token
    for _ in range(4):
        h.step([(seq, seq.chunk())])
    assert len(seq.output) == 5


def test_prompt_logprobs_over_chunks(gqa_dir):
    h = Harness(gqa_dir, 16)
    seq = h.new_seq("a", 40)
    h.step([(seq, seq.chunk(16, prompt_logprobs=True))])  # non-final chunk: 16 targets (pos 1..16)
    h.step([(seq, seq.chunk(None, prompt_logprobs=True))])


def mixed_batch_scenario(h: Harness, decodes_first: bool, mixed_steps: int) -> None:
    """Two decoding sequences share `mixed_steps` steps with prefill chunks (a fresh prompt in
    20-token chunks, one with a 17-token cached prefix), in either order; then all decode."""
    d1, d2 = h.new_seq("d1", 20), h.new_seq("d2", 33)
    h.step([(d1, d1.chunk()), (d2, d2.chunk())])
    fresh, cont = h.new_seq("fresh", 50), h.new_seq("cont", 30)
    h.step([(cont, cont.chunk(17))])   # cont keeps a cached prefix of 17 tokens
    for i in range(mixed_steps):
        decodes = [(d1, d1.chunk()), (d2, d2.chunk())]
        last = i == mixed_steps - 1
        prefills = [(fresh, fresh.chunk(None if last else 20))] + ([(cont, cont.chunk())] if i == 0 else [])
        h.step(decodes + prefills if decodes_first else prefills + decodes)
    for _ in range(2):
        h.step([(s, s.chunk()) for s in (d1, cont, d2, fresh)])
    assert len(d1.output) == mixed_steps + 3 and len(cont.output) == 3 and len(fresh.output) == 3


@pytest.mark.parametrize("decodes_first", [True, False])
def test_mixed_batch(mha_dir, decodes_first):
    mixed_batch_scenario(Harness(mha_dir, 16, seed=5), decodes_first, mixed_steps=3)


@pytest.mark.parametrize("chunk_bytes", [0, 1, 40_000])
def test_decode_batch_of_different_lengths(gqa_dir, chunk_bytes):
    """chunk_bytes: the backend's decode sub-batch budget (one, one-per-sequence, a few)."""
    h = Harness(gqa_dir, 16, seed=9)
    h.runner.backend = TorchAttentionBackend(h.runner.kv, decode_chunk_bytes=chunk_bytes)
    seqs = [h.new_seq(f"s{i}", n) for i, n in enumerate([1, 15, 16, 17, 64, 3])]
    h.step([(s, s.chunk()) for s in seqs])
    for _ in range(3):
        h.step([(s, s.chunk()) for s in seqs])
    assert all(len(s.output) == 4 for s in seqs)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.0},
])
def test_rope_scaling(tmp_path, rope):
    folder = build_tiny_llama(tmp_path, vocab_size=256, rope_scaling=rope, rope_theta=500.0, seed=4)
    h = Harness(folder, 16)
    assert h.runner.model_config.rope_scaling.rope_type == rope["rope_type"]
    seq = h.new_seq("a", 70)
    h.step([(seq, seq.chunk(40))])
    for _ in range(4):
        h.step([(seq, seq.chunk())])
    assert len(seq.output) == 4


def test_bfloat16_runs_close_to_float32(gqa_dir):
    """bf16 weights, activations and KV: every greedy pick is (near-)best under fp32 transformers."""
    h = Harness(gqa_dir, 16, seed=11)
    runner = ModelRunner.from_config(EngineConfig(model_path=str(gqa_dir), page_size=16,
                                                  max_total_tokens=4096, dtype="bfloat16"))
    assert runner.kv.dtype == torch.bfloat16 and runner.kv.compute_dtype == torch.bfloat16
    seq = h.new_seq("a", 40)
    for _ in range(5):
        res = runner.run([seq.chunk()])[0].logprobs[-1]
        seq.computed = len(seq.tokens)
        ref = h.reference(seq.tokens)[-1]
        assert float(ref.max() - ref[res.token_id]) < 0.05
        assert abs(res.logprob - float(ref[res.token_id])) < 0.05
        seq.output.append(res.token_id)


def test_qwen2_qkv_bias(tmp_path):
    """Qwen2 = the Llama decoder plus q/k/v biases (a ModelConfig flag)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random biases (they start at zero)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    h = Harness(tmp_path, 16, seed=6)
    assert h.runner.model_config.qkv_bias and not h.runner.model_config.o_bias
    seq = h.new_seq("a", 30)
    for _ in range(4):
        h.step([(seq, seq.chunk())])
