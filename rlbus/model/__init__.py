"""Local models: the tiny causal LM, its byte-level BPE tokenizer, and the start-time
tokenizer check."""
