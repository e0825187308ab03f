"""Speculative decoding: strategies (``off``, ``chain-D``, ``tree-DxK-N``, ``ngram-D``, ``suffix-D-N``,
``hybrid-DxK-N``), draft trees, exact verification (the rules that keep SD lossless), what acceptance buys, the
model-free n-gram and suffix drafters, and one SD step over a ragged batch (``SpecDecoder``)."""
from .acceptance import alpha_from_accept_length, expected_tokens, leviathan_speedup
from .strategy import OFF, SpecStrategy, StrategySource, strategy_source

__all__ = ["OFF", "SpecStrategy", "StrategySource", "alpha_from_accept_length", "expected_tokens",
           "leviathan_speedup", "strategy_source"]
