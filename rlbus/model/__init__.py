"""Local models: the tiny causal LM, its byte-level BPE tokenizer (trained on a corpus that
ships with this package, `bpe_corpus.json`), and the start-time tokenizer check."""
