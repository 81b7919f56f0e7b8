"""Host-side data pipeline: corpora, tokenization, packing and island streams.

Modules, one concern each:
- tokenizer: bytes <-> token ids (ByteTokenizer).
- embedded: the default, network-free corpus (the Python standard library).
- synthetic: a Markov-chain corpus with a known entropy rate, for tests.
- file_split: the deterministic train/validation split by file name.
- text_files: resolving `config.data.path` to a sorted list of files.
- packing: documents -> fixed-length sequences separated by EOS.
- streams: deterministic, resumable per-island batches and eval batches.
- corpus: `build_corpus(config.data)` and `validate_data_config`.
"""
