"""Tokenization for serving: Tokenizer (HF + chat template), incremental detokenizer and stop-string matching."""
from radixserve.tokenizer.detokenizer import IncrementalDetokenizer, StopCheck, StopStringMatcher
from radixserve.tokenizer.tokenizer import Tokenizer, default_cache_dir

__all__ = ["IncrementalDetokenizer", "StopCheck", "StopStringMatcher", "Tokenizer", "default_cache_dir"]
