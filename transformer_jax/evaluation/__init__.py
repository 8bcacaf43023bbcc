"""Scoring: decoding, BLEU, parsing F1, perplexity, the paper's numbers and comparison tables."""
