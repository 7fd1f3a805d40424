"""Tokenization for serving: Tokenizer (HF + chat template), incremental detokenizer, request output tracking."""
from radixserve.tokenizer.detokenizer import IncrementalDetokenizer, StopCheck, StopStringMatcher
from radixserve.tokenizer.output_processor import ChoiceUpdate, RequestTracker
from radixserve.tokenizer.tokenizer import Tokenizer, default_cache_dir

__all__ = ["ChoiceUpdate", "IncrementalDetokenizer", "RequestTracker", "StopCheck", "StopStringMatcher",
           "Tokenizer", "default_cache_dir"]
