"""Tests of the data pipeline: properties, not golden numbers."""
import pathlib

import ml_collections
import numpy as np
import pytest

from tests import helpers
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import embedded
from diloco_jax.data import in_memory_batches as streams
from diloco_jax.data import packing
from diloco_jax.data import settings as data_settings
from diloco_jax.data import synthetic
from diloco_jax.data import tokenizer as tokenizer_lib


def _data_config(**overrides) -> ml_collections.ConfigDict:
  return helpers.small_data_config(**{
      "validation_fraction": 0.05, **overrides})


# Tokenizer.


def test_byte_tokenizer_round_trips_text_and_bytes():
  tokenizer = tokenizer_lib.ByteTokenizer()
  text = "héllo, wörld\n\x00\xff"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.uint16
  assert tokenizer.decode(ids) == text.encode("utf-8")
  every_byte = bytes(range(256))
  assert tokenizer.decode(tokenizer.encode(every_byte)) == every_byte


def test_byte_tokenizer_decode_drops_eos_and_out_of_range():
  tokenizer = tokenizer_lib.ByteTokenizer()
  assert tokenizer.vocab_size == tokenizer.eos_id + 1 == 257
  assert tokenizer.decode([104, tokenizer.eos_id, 105, 300, -1]) == b"hi"


# Embedded corpus.


def test_stdlib_split_is_deterministic_disjoint_and_complete():
  train = embedded.stdlib_source_files("train", 0.05)
  validation = embedded.stdlib_source_files("validation", 0.05)
  assert train == embedded.stdlib_source_files("train", 0.05)
  assert train and validation
  assert not set(train) & set(validation)
  every_file = sorted(
      path for path in embedded.stdlib_root().rglob("*.py")
      if not {"site-packages", "dist-packages"} & set(path.parts))
  assert sorted(train + validation) == every_file
  root = embedded.stdlib_root()
  relative = [path.relative_to(root).as_posix() for path in train]
  assert relative == sorted(relative)
  # Roughly the requested fraction of files is held out.
  assert 0.02 < len(validation) / len(every_file) < 0.08


def test_stdlib_split_rejects_unknown_split():
  with pytest.raises(ValueError, match="split"):
    embedded.stdlib_source_files("test", 0.05)


def test_read_documents_skips_unreadable_and_empty_files(tmp_path):
  (tmp_path / "a.py").write_bytes(b"a = 1\n")
  (tmp_path / "empty.py").write_bytes(b"")
  (tmp_path / "b.py").write_bytes(b"b = 2\n")
  paths = [tmp_path / "a.py", tmp_path / "missing.py", tmp_path / "empty.py",
           tmp_path / "b.py"]
  assert list(embedded.read_documents(paths)) == [b"a = 1\n", b"b = 2\n"]


def test_build_embedded_corpus():
  corpus = corpus_lib.build_corpus(
      _data_config(corpus="embedded", sequence_length=128))
  assert corpus.vocab_size == 257 and corpus.eos_id == 256
  assert corpus.entropy_rate is None
  assert corpus.train.shape[1] == corpus.validation.shape[1] == 129
  assert corpus.train.shape[0] > 10 * corpus.validation.shape[0] > 0
  assert corpus.train.dtype == np.uint16
  # Python source is mostly printable ASCII, with EOS between files.
  assert corpus.train.max() == 256
  assert b"import" in tokenizer_lib.ByteTokenizer().decode(corpus.train[:100])


# Packing.


def test_pack_documents_shape_eos_and_concatenation_identity():
  rng = np.random.default_rng(0)
  documents = [rng.integers(0, 100, size=length, dtype=np.uint16)
               for length in (5, 0, 17, 3, 40, 9)]
  eos_id, sequence_length = 100, 7
  packed = packing.pack_documents(iter(documents), eos_id, sequence_length)
  stream = np.concatenate([np.append(doc, eos_id) for doc in documents])
  num_sequences = stream.size // (sequence_length + 1)
  assert packed.shape == (num_sequences, sequence_length + 1)
  assert packed.dtype == np.uint16
  np.testing.assert_array_equal(packed.ravel(),
                                stream[:num_sequences * (sequence_length + 1)])
  # EOS ends each document: its positions are the cumulative lengths.
  eos_positions = np.flatnonzero(packed.ravel() == eos_id)
  expected = np.cumsum([doc.size + 1 for doc in documents]) - 1
  np.testing.assert_array_equal(eos_positions,
                                expected[expected < packed.size])


def test_pack_documents_drops_incomplete_tail_and_handles_nothing():
  packed = packing.pack_documents([np.arange(10, dtype=np.uint16)], 99, 4)
  assert packed.shape == (2, 5)  # 11 tokens: one token of tail dropped.
  assert packing.pack_documents([], 99, 4).shape == (0, 5)


# Synthetic Markov source.


def test_markov_source_is_a_stochastic_matrix_with_stationary_pi():
  source = synthetic.MarkovSource(vocab_size=12, concentration=0.3, seed=1)
  matrix, pi = source.transition_matrix, source.stationary_distribution
  np.testing.assert_allclose(matrix.sum(axis=1), 1.0, atol=1e-12)
  assert (matrix >= 0).all() and (pi >= 0).all()
  np.testing.assert_allclose(pi.sum(), 1.0, atol=1e-12)
  np.testing.assert_allclose(pi @ matrix, pi, atol=1e-12)
  assert 0 < source.entropy_rate() < np.log(12)


def test_markov_source_entropy_rate_of_extreme_concentrations():
  # Nearly uniform rows approach log(V); peaked rows have far lower entropy.
  uniform = synthetic.MarkovSource(vocab_size=10, concentration=1e4, seed=0)
  peaked = synthetic.MarkovSource(vocab_size=10, concentration=0.05, seed=0)
  assert uniform.entropy_rate() == pytest.approx(np.log(10), abs=1e-2)
  assert peaked.entropy_rate() < 0.5 * np.log(10)


def test_markov_samples_have_the_entropy_rate_as_nll():
  source = synthetic.MarkovSource(vocab_size=16, concentration=0.5, seed=3)
  documents = source.sample_documents(num_documents=64, document_length=4096,
                                      seed=7)
  assert documents.shape == (64, 4096) and documents.dtype == np.uint16
  assert documents.max() < 16
  log_probabilities = np.log(
      source.transition_matrix[documents[:, :-1], documents[:, 1:]])
  assert -log_probabilities.mean() == pytest.approx(source.entropy_rate(),
                                                    abs=0.02)
  # First tokens follow the stationary distribution.
  first_tokens = source.sample_documents(20000, 1, seed=8)[:, 0]
  frequencies = np.bincount(first_tokens, minlength=16) / first_tokens.size
  np.testing.assert_allclose(frequencies, source.stationary_distribution,
                             atol=0.02)


def test_markov_sampling_is_deterministic_given_seeds():
  source = synthetic.MarkovSource(vocab_size=5, concentration=1.0, seed=0)
  again = synthetic.MarkovSource(vocab_size=5, concentration=1.0, seed=0)
  np.testing.assert_array_equal(source.transition_matrix,
                                again.transition_matrix)
  np.testing.assert_array_equal(source.sample_documents(4, 50, seed=1),
                                again.sample_documents(4, 50, seed=1))
  assert not np.array_equal(source.sample_documents(4, 50, seed=1),
                            source.sample_documents(4, 50, seed=2))


# Island batch streams.


def _numbered_sequences(num_sequences: int, length: int = 4) -> np.ndarray:
  """Row r is filled with r, so a batch reveals which rows it holds."""
  return np.repeat(np.arange(num_sequences, dtype=np.uint16)[:, None], length,
                   axis=1)


def test_island_batches_shape_and_determinism():
  sequences = _numbered_sequences(103)
  batches = streams.IslandBatches(sequences, num_islands=3, batch_size=4,
                                  seed=5)
  batch = batches.batch(2)
  assert batch.shape == (3, 4, 4) and batch.dtype == np.int32
  np.testing.assert_array_equal(batch, batches.batch(2))
  fresh = streams.IslandBatches(sequences, num_islands=3, batch_size=4, seed=5)
  np.testing.assert_array_equal(batch, fresh.batch(2))
  other_seed = streams.IslandBatches(sequences, num_islands=3, batch_size=4,
                                     seed=6)
  assert not np.array_equal(batch, other_seed.batch(2))


def test_island_batches_cover_each_epoch_once_disjointly():
  num_sequences, num_islands, batch_size = 103, 3, 4
  batches = streams.IslandBatches(_numbered_sequences(num_sequences),
                                  num_islands, batch_size, seed=0)
  assert batches.steps_per_epoch == (103 // 3) // 4 == 8
  epoch_orders = []
  for epoch in range(2):
    steps = range(epoch * batches.steps_per_epoch,
                  (epoch + 1) * batches.steps_per_epoch)
    rows = np.stack([batches.batch(step)[:, :, 0] for step in steps], axis=1)
    per_island = rows.reshape(num_islands, -1)  # [island, sequences in order]
    used = per_island.ravel()
    # Every sequence at most once; only the remainder goes unused.
    assert len(set(used.tolist())) == used.size
    assert used.size == num_sequences - (num_sequences % num_islands) - (
        num_islands * ((num_sequences // num_islands) % batch_size))
    for island in range(num_islands):
      for other in range(island + 1, num_islands):
        assert not set(per_island[island]) & set(per_island[other])
    epoch_orders.append(per_island)
  assert not np.array_equal(epoch_orders[0], epoch_orders[1])


def test_island_batches_resume_from_any_step():
  sequences = _numbered_sequences(50)
  iterated = streams.IslandBatches(sequences, num_islands=2, batch_size=3,
                                   seed=1)
  for step in range(20):  # Crosses two epoch boundaries (8 steps per epoch).
    expected = iterated.batch(step)
  resumed = streams.IslandBatches(sequences, num_islands=2, batch_size=3,
                                  seed=1)
  np.testing.assert_array_equal(resumed.batch(19), expected)
  # Going back to an earlier epoch gives the same batch as before.
  np.testing.assert_array_equal(iterated.batch(3), resumed.batch(3))


def test_island_batches_reject_too_little_data():
  with pytest.raises(ValueError, match="need at least 8 sequences"):
    streams.IslandBatches(_numbered_sequences(7), num_islands=2, batch_size=4,
                          seed=0)


def test_eval_batches_are_the_first_sequences_in_order():
  sequences = _numbered_sequences(10)
  evaluation = streams.eval_batches(sequences, batch_size=3, num_batches=2)
  assert evaluation.shape == (2, 3, 4) and evaluation.dtype == np.int32
  np.testing.assert_array_equal(evaluation[:, :, 0], [[0, 1, 2], [3, 4, 5]])
  with pytest.raises(ValueError, match="12 sequences, but only 10"):
    streams.eval_batches(sequences, batch_size=3, num_batches=4)


# build_corpus and validate_data_config.


def test_build_synthetic_corpus():
  config = _data_config()
  corpus = corpus_lib.build_corpus(config)
  assert corpus.vocab_size == 9 and corpus.eos_id == 8
  tokens_per_split = {"train": 64 * 64, "validation": 8 * 64}
  for split, tokens in tokens_per_split.items():
    sequences = getattr(corpus, split)
    assert sequences.shape == (tokens // 17, 17)
    assert sequences.max() == 8  # EOS present; symbols below it.
  assert not np.array_equal(corpus.train[:len(corpus.validation)],
                            corpus.validation)
  source = synthetic.MarkovSource(8, 0.5, seed=[0, 1])
  assert corpus.entropy_rate == pytest.approx(source.entropy_rate())
  again = corpus_lib.build_corpus(config)
  np.testing.assert_array_equal(corpus.train, again.train)


def _write_text_files(directory: pathlib.Path, count: int) -> list[bytes]:
  contents = []
  for index in range(count):
    content = (f"file {index}: " + "lorem ipsum " * 40).encode()
    (directory / f"doc_{index:02d}.txt").write_bytes(content)
    contents.append(content)
  return contents


def test_build_text_files_corpus_from_directory_and_glob(tmp_path):
  contents = _write_text_files(tmp_path, 12)
  by_directory = corpus_lib.build_corpus(
      _data_config(corpus="text_files", path=str(tmp_path),
                   validation_fraction=0.3))
  by_glob = corpus_lib.build_corpus(
      _data_config(corpus="text_files", path=str(tmp_path / "*.txt"),
                   validation_fraction=0.3))
  np.testing.assert_array_equal(by_directory.train, by_glob.train)
  np.testing.assert_array_equal(by_directory.validation, by_glob.validation)
  assert by_directory.vocab_size == 257
  assert by_directory.train.shape[0] > 0 and by_directory.validation.shape[0] > 0
  # All the text lands in one split or the other (minus dropped tails).
  total_tokens = sum(len(content) + 1 for content in contents)
  packed_tokens = by_directory.train.size + by_directory.validation.size
  assert total_tokens - 2 * 17 < packed_tokens <= total_tokens


def test_build_text_files_corpus_from_one_file(tmp_path):
  (tmp_path / "only.txt").write_bytes(b"x" * 1000)
  corpus = corpus_lib.build_corpus(
      _data_config(corpus="text_files", path=str(tmp_path / "only.txt"),
                   validation_fraction=0.1))
  num_sequences = 1001 // 17
  assert corpus.validation.shape[0] == round(0.1 * num_sequences)
  assert corpus.train.shape[0] + corpus.validation.shape[0] == num_sequences


def test_build_text_files_keeps_both_splits_non_empty(tmp_path):
  _write_text_files(tmp_path, 2)
  # A tiny fraction puts both files in train; the last one moves over.
  corpus = corpus_lib.build_corpus(
      _data_config(corpus="text_files", path=str(tmp_path),
                   validation_fraction=0.001))
  decoded = tokenizer_lib.ByteTokenizer().decode(corpus.validation)
  assert decoded.startswith(b"file 1:")
  assert corpus.train.shape[0] > 0


@pytest.mark.parametrize("overrides, message", [
    ({"corpus": "wikipedia"}, r"config\.data\.corpus='wikipedia' is not one "
                              r"of 'embedded', 'synthetic', 'text_files'"),
    ({"corpus": "text_files"},
     r"config\.data\.path is required for corpus 'text_files'"),
    ({"corpus": "text_files", "path": "/nonexistent/*.txt"},
     r"config\.data\.path: no files match '/nonexistent/\*\.txt'"),
    ({"corpus": "text_files", "path": "/nonexistent/file.txt"},
     r"config\.data\.path: '/nonexistent/file.txt' does not exist"),
    ({"corpus": "c4"}, r"config\.data\.path is required for corpus 'c4'"),
    ({"corpus": "c4", "path": "/nonexistent/c4"},
     r"config\.data\.path: '/nonexistent/c4' does not exist"),
    ({"sequence_length": 0}, r"config\.data\.sequence_length must be"),
    ({"validation_fraction": 1.5}, r"config\.data\.validation_fraction"),
])
def test_validate_data_config_names_the_bad_field(overrides, message):
  with pytest.raises(ValueError, match=message):
    data_settings.validate_data_config(_data_config(**overrides))
  with pytest.raises(ValueError, match=message):
    corpus_lib.build_corpus(_data_config(**overrides))


def test_validate_data_config_checks_synthetic_sizes():
  config = _data_config()
  config.synthetic.vocab_size = 70000
  with pytest.raises(ValueError, match=r"config\.data\.synthetic\.vocab_size"):
    data_settings.validate_data_config(config)
  config = _data_config(sequence_length=1000)
  with pytest.raises(ValueError, match=r"synthetic\.validation_documents"):
    data_settings.validate_data_config(config)


def test_validate_data_config_accepts_good_configs(tmp_path):
  _write_text_files(tmp_path, 1)
  data_settings.validate_data_config(_data_config())
  data_settings.validate_data_config(_data_config(corpus="embedded"))
  data_settings.validate_data_config(
      _data_config(corpus="text_files", path=str(tmp_path)))
