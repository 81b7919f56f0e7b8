"""Host-side data pipeline: corpora, tokenization, packing and island streams.

Modules, one concern each:
- settings: config.data checked once (`from_config`) as the frozen
  `DataSettings` the rest reads.
- sources: the batch-source protocol the training loop uses
  (`make_batch_source`, `make_eval_batches`), for every corpus.
- tokenizer: bytes or a SentencePiece model <-> token ids (`build_tokenizer`).
- embedded: the default, network-free corpus (the Python standard library).
- synthetic: a Markov-chain corpus with a known entropy rate, for tests.
- file_split: the deterministic train/validation split by file name.
- text_files: resolving `config.data.path` to a sorted list of files;
  files that are not UTF-8 text are refused.
- c4_files: C4's JSON-lines shards (.json/.jsonl, maybe gzipped) and split.
- c4_download: fetching C4's shards from the public allenai/c4 dataset
  (`python -m diloco_jax.data.c4_download`).
- train_tokenizer: a SentencePiece model trained on the first megabytes of
  the shards, cached beside them (`python -m diloco_jax.data.train_tokenizer`).
- tfds_documents: a TFDS split (e.g. "c4/en") read as virtual shards.
- packing: documents -> fixed-length sequences separated by EOS.
- in_memory_batches: island batches of an in-memory corpus, a pure function
  of the step (iid and clustered), and the eval batches.
- sharded_batches: island batches streamed from sharded documents, resumable
  from a few integers per island.
- read_ahead: a streamed corpus's next batches prepared by a background thread
  (`ReadAhead`), resuming exactly.
- prepare: pre-tokenizing a corpus into token shards with worker processes,
  resumable (`python -m diloco_jax.data.prepare`).
- token_shards: the token shards on disk and their index, checked before a
  run starts; token_batches: the "tokens" corpus's island batches read from
  them through memory maps.
- clustering: hashed n-gram features and k-means, for non-iid islands.
- corpus: in-memory corpora (`build_corpus`, `build_island_sequences`).
- errors: `DataError`, raised for every unusable data file or data setting,
  in one line naming the file or field.

May import nothing of diloco_jax outside data/.
"""
