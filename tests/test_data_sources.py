"""The batch-source protocol, SentencePiece tokenizers and non-iid islands."""
import gzip
import json
import pathlib

import ml_collections
import numpy as np
import pytest
import sentencepiece as spm

from tests import helpers
from diloco_jax.data import clustering
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import in_memory_batches as streams
from diloco_jax.data import settings as data_settings
from diloco_jax.data import sources
from diloco_jax.data import tokenizer as tokenizer_lib


def _data_config(**overrides) -> ml_collections.ConfigDict:
  return helpers.small_data_config(**{
      "validation_fraction": 0.2, **overrides})


# Two unmistakable kinds of document: Python code and English prose.
_CODE_LINES = ("def f{i}(x):\n    return x + {i}\n",
               "for k in range({i}):\n    total += k * {i}\n",
               "class C{i}:\n    def __init__(self):\n        self.v = [{i}]\n")
_PROSE_LINES = ("The river ran quietly past the old mill in spring {i}. ",
                "She wrote letters to her brother every week of the year. ",
                "Many travellers stopped at the inn before the mountains. ")


def _code(index: int) -> str:
  return "".join(line.format(i=index + n) for n, line in enumerate(
      _CODE_LINES * 3))


def _prose(index: int) -> str:
  return "".join(line.format(i=index) for line in _PROSE_LINES * 3)


def _write_mixed_files(directory: pathlib.Path, count: int) -> dict[str, str]:
  kinds = {}
  for index in range(count):
    name = f"doc_{index:03d}.txt"
    is_code = index % 3 == 0  # unequal clusters: a third is code
    (directory / name).write_text(_code(index) if is_code else _prose(index))
    kinds[name] = "code" if is_code else "prose"
  return kinds


def _write_c4_shards(directory: pathlib.Path, documents: list[str]) -> None:
  """C4-format JSONL: `documents` dealt over 4 train shards, one prose
  document in the validation shard."""
  for shard in range(4):
    (directory / f"c4-train.{shard:05d}-of-00004.jsonl").write_text("".join(
        json.dumps({"text": text}) + "\n" for text in documents[shard::4]))
  (directory / "c4-validation.00000-of-00001.jsonl").write_text(
      json.dumps({"text": _prose(99)}) + "\n")


# SentencePiece.


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
  """A tiny model (vocab 200) trained here on text the test writes."""
  directory = tmp_path_factory.mktemp("spm")
  corpus = directory / "train.txt"
  corpus.write_text("\n".join(_prose(i) + "\n" + _code(i) for i in range(60)))
  prefix = directory / "tiny"
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(prefix), vocab_size=200,
      model_type="unigram", character_coverage=1.0, num_threads=1,
      minloglevel=2)
  return str(prefix) + ".model"


def test_sentencepiece_tokenizer_round_trips_and_reports_its_vocab(
    sentencepiece_model):
  tokenizer = tokenizer_lib.build_tokenizer(_data_config(
      tokenizer="sentencepiece", tokenizer_path=sentencepiece_model))
  assert tokenizer.vocab_size == 200
  processor = spm.SentencePieceProcessor(model_file=sentencepiece_model)
  assert tokenizer.eos_id == processor.eos_id() >= 0
  # Text already in SentencePiece's normal form (single spaces) round-trips.
  text = "The river ran quietly past the mill. def f(x): return x + 1"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.uint16 and ids.max() < 200
  assert tokenizer.eos_id not in ids
  assert tokenizer.decode(ids).decode() == text
  assert ids.tolist() == processor.encode(text)
  assert tokenizer.decode(np.append(ids, tokenizer.eos_id)) == tokenizer.decode(
      ids)
  assert tokenizer.encode(text.encode()).tolist() == ids.tolist()


def test_sentencepiece_without_eos_gets_an_extra_id(tmp_path):
  corpus = tmp_path / "train.txt"
  corpus.write_text("\n".join(_prose(i) + "\n" + _code(i) for i in range(30)))
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / "no_eos"),
      vocab_size=100, eos_id=-1, num_threads=1, minloglevel=2)
  tokenizer = tokenizer_lib.SentencePieceTokenizer(str(tmp_path /
                                                       "no_eos.model"))
  assert tokenizer.eos_id == 100 and tokenizer.vocab_size == 101


@pytest.mark.parametrize("path, message", [
    ("", r"config\.data\.tokenizer_path is required"),
    ("/nonexistent/t5.model", r"config\.data\.tokenizer_path: cannot load "
                              r"SentencePiece model '/nonexistent/t5.model'"),
    ("NOT_A_MODEL", r"config\.data\.tokenizer_path: cannot load"),
])
def test_sentencepiece_bad_model_path_names_the_field(tmp_path, path,
                                                      message):
  if path == "NOT_A_MODEL":
    path = str(tmp_path / "garbage.model")
    pathlib.Path(path).write_bytes(b"this is not a model")
  config = _data_config(corpus="embedded", tokenizer="sentencepiece",
                        tokenizer_path=path)
  with pytest.raises(ValueError, match=message):
    data_settings.validate_data_config(config)
  with pytest.raises(ValueError, match=message):
    corpus_lib.corpus_vocab_size(config)


def test_sentencepiece_is_refused_for_the_synthetic_corpus(sentencepiece_model):
  with pytest.raises(ValueError, match=r"config\.data\.tokenizer"):
    data_settings.validate_data_config(_data_config(
        tokenizer="sentencepiece", tokenizer_path=sentencepiece_model))


def test_sentencepiece_text_files_corpus(tmp_path, sentencepiece_model):
  data = tmp_path / "data"
  data.mkdir()
  _write_mixed_files(data, 30)
  config = _data_config(corpus="text_files", path=str(data),
                        tokenizer="sentencepiece",
                        tokenizer_path=sentencepiece_model)
  assert corpus_lib.corpus_vocab_size(config) == 200
  source = sources.make_batch_source(config, num_islands=2, batch_size=2,
                                     seed=0)
  assert source.info.vocab_size == 200
  batch = source.next_batch()
  assert batch.shape == (2, 2, 17) and batch.max() < 200
  corpus = corpus_lib.build_corpus(config)
  eos_count = int((corpus.train == source.info.eos_id).sum())
  assert 0 < eos_count <= 30  # about one EOS per document


def test_sentencepiece_c4_shards(tmp_path, sentencepiece_model):
  texts = [_prose(i) for i in range(20)]
  for shard in range(2):
    with gzip.open(tmp_path / f"c4-train.{shard:05d}-of-00002.json.gz",
                   "wt") as f:
      f.writelines(json.dumps({"text": text}) + "\n"
                   for text in texts[shard::2])
  with gzip.open(tmp_path / "c4-validation.00000-of-00001.json.gz", "wt") as f:
    f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
  config = _data_config(corpus="c4", path=str(tmp_path),
                        tokenizer="sentencepiece",
                        tokenizer_path=sentencepiece_model)
  source = sources.make_batch_source(config, 2, 2, seed=0)
  tokenizer = tokenizer_lib.build_tokenizer(config)
  stream = np.concatenate([source.next_batch()[0].ravel() for _ in range(20)])
  first_document = stream[:np.flatnonzero(stream == tokenizer.eos_id)[0]]
  # SentencePiece drops the trailing space of each text.
  assert tokenizer.decode(first_document).decode() in [t.strip() for t in texts]
  evaluation = sources.make_eval_batches(config, batch_size=2, num_batches=1)
  first_ids = tokenizer.encode(texts[0])
  assert evaluation.size < first_ids.size  # one document fills the batch
  np.testing.assert_array_equal(evaluation.ravel(),
                                first_ids[:evaluation.size])


# The in-memory batch source.


def test_in_memory_source_follows_island_batches_and_resumes():
  config = _data_config()
  source = sources.make_batch_source(config, num_islands=2, batch_size=3,
                                     seed=4)
  reference = streams.IslandBatches(corpus_lib.build_corpus(config).train, 2,
                                    3, seed=4)
  for step in range(5):
    np.testing.assert_array_equal(source.next_batch(), reference.batch(step))
  state = source.state()
  assert state == {"step": 5}
  expected = [source.next_batch() for _ in range(3)]
  resumed = sources.make_batch_source(config, 2, 3, seed=4)
  resumed.restore(json.loads(json.dumps(state)))
  for batch in expected:
    np.testing.assert_array_equal(resumed.next_batch(), batch)
  np.testing.assert_allclose(source.island_token_weights(), [0.5, 0.5])
  assert source.info.entropy_rate is not None
  with pytest.raises(ValueError, match="step"):
    resumed.restore({"step": -1})


def test_make_eval_batches_is_the_validation_prefix():
  config = _data_config()
  evaluation = sources.make_eval_batches(config, batch_size=2, num_batches=3)
  np.testing.assert_array_equal(
      evaluation,
      streams.eval_batches(corpus_lib.build_corpus(config).validation, 2, 3))


# Clustering and non-iid islands.


def test_hashed_features_are_unit_rows_and_deterministic():
  documents = [b"hello world", b"", np.arange(50, dtype=np.uint16), b"ab"]
  features = clustering.hashed_ngram_features(documents)
  assert features.shape == (4, clustering.NUM_BUCKETS)
  np.testing.assert_allclose(np.linalg.norm(features, axis=1), [1, 0, 1, 1],
                             rtol=1e-6)
  np.testing.assert_array_equal(features,
                                clustering.hashed_ngram_features(documents))


def test_kmeans_separates_two_alphabets_deterministically():
  rng = np.random.default_rng(0)
  documents = [bytes(rng.choice(list(alphabet), size=200))
               for alphabet in (b"abcdef", b"uvwxyz") * 20]
  labels = clustering.cluster_documents(documents, k=2, seed=1)
  np.testing.assert_array_equal(labels,
                                clustering.cluster_documents(documents, 2, 1))
  assert set(labels[0::2]) != set(labels[1::2])
  assert len(set(labels[0::2])) == len(set(labels[1::2])) == 1


def test_balance_offsets_even_out_a_dominant_cluster():
  # Three blobs holding 70 / 20 / 10 points of random weight, each around
  # its centroid: plain assignment follows the blobs; balanced assignment
  # moves the big blob's boundary until every cluster holds about a third.
  rng = np.random.default_rng(0)
  centroids = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]], np.float32)
  blobs = np.repeat([0, 1, 2], [70, 20, 10])
  features = (centroids[blobs]
              + rng.normal(0, 1, (blobs.size, 2))).astype(np.float32)
  weights = rng.integers(50, 150, blobs.size).astype(np.float64)
  offsets = clustering.balance_offsets(features, centroids, weights)
  np.testing.assert_array_equal(
      offsets, clustering.balance_offsets(features, centroids, weights))
  plain = clustering.assign(features, centroids)
  balanced = clustering.assign(features, centroids, offsets)
  plain_shares = np.bincount(plain, weights, 3) / weights.sum()
  shares = np.bincount(balanced, weights, 3) / weights.sum()
  assert plain_shares.max() > 0.6
  # Whole points cannot split the weight exactly: within the tolerance
  # plus one point's weight.
  np.testing.assert_allclose(
      shares, 1 / 3,
      atol=clustering.BALANCE_TOLERANCE / 3 + weights.max() / weights.sum())
  # Clusters grow at their edge: a point that moved from the big cluster
  # is nearer its new centroid, relative to the big one's, than every point
  # the big one kept (in squared distance, where the offsets act).
  distance = ((features[:, None] - centroids[None]) ** 2).sum(axis=2)
  for cluster in (1, 2):
    moved = (plain == 0) & (balanced == cluster)
    kept = balanced == 0
    assert moved.any()
    assert (distance[moved, cluster] - distance[moved, 0]).max() <= (
        distance[kept, cluster] - distance[kept, 0]).min()


def test_balanced_clusters_of_documents_are_deterministic():
  rng = np.random.default_rng(1)
  documents = [bytes(rng.choice(list(b"abcdef" if i % 4 else b"uvwxyz"),
                                size=200)) for i in range(40)]
  weights = np.full(len(documents), 201.0)
  labels = clustering.cluster_documents(documents, 2, seed=0,
                                        weights=weights)
  np.testing.assert_array_equal(
      labels, clustering.cluster_documents(documents, 2, 0, weights))
  assert np.bincount(labels, minlength=2).tolist() == [20, 20]
  # One island (the pretraining phase of a clustered run) takes everything.
  np.testing.assert_array_equal(
      clustering.cluster_documents(documents, 1, 0, weights), 0)


def test_balanced_text_files_islands_hold_equal_tokens(tmp_path):
  _write_mixed_files(tmp_path, 60)  # a third code, two thirds prose
  config = _data_config(corpus="text_files", path=str(tmp_path),
                        island_split="clustered_balanced",
                        sequence_length=32)
  island_sequences = corpus_lib.build_island_sequences(config, 2, seed=0)
  decoded = [tokenizer_lib.ByteTokenizer().decode(sequences).decode()
             for sequences in island_sequences]
  # The code island takes some prose to even out; no code leaves it.
  code_island = ["def f" in text for text in decoded].index(True)
  assert "def f" not in decoded[1 - code_island]
  assert "The river" in decoded[code_island]
  weights = sources.make_batch_source(config, 2, batch_size=2,
                                      seed=0).island_token_weights()
  np.testing.assert_allclose(weights, 0.5, atol=0.05)
  plain = sources.make_batch_source(
      _data_config(corpus="text_files", path=str(tmp_path),
                   island_split="clustered", sequence_length=32),
      2, batch_size=2, seed=0).island_token_weights()
  assert plain.min() < 0.4  # the unbalanced split it corrects


def test_balanced_c4_stream_holds_equal_tokens_and_resumes(tmp_path):
  _write_c4_shards(tmp_path, [_code(i) if i % 4 == 0 else _prose(i)
                              for i in range(80)])
  config = _data_config(corpus="c4", path=str(tmp_path),
                        island_split="clustered_balanced")
  source = sources.make_batch_source(config, 2, batch_size=2, seed=0)
  np.testing.assert_allclose(source.island_token_weights(), 0.5, atol=0.05)
  batches = np.stack([source.next_batch() for _ in range(200)])
  text = [tokenizer_lib.ByteTokenizer().decode(batches[:, island]).decode()
          for island in range(2)]
  # One island holds all the code plus prose; the other prose only.
  assert sorted("def f" in t for t in text) == [False, True]
  assert all("The river" in t for t in text)
  state = source.state()
  following = source.next_batch()
  resumed = sources.make_batch_source(config, 2, batch_size=2, seed=0)
  resumed.restore(json.loads(json.dumps(state)))
  np.testing.assert_array_equal(resumed.next_batch(), following)


def test_clustered_text_files_islands_separate_code_from_prose(tmp_path):
  kinds = _write_mixed_files(tmp_path, 60)
  config = _data_config(corpus="text_files", path=str(tmp_path),
                        island_split="clustered", sequence_length=32)
  island_sequences = corpus_lib.build_island_sequences(config, 2, seed=0)
  decoded = [tokenizer_lib.ByteTokenizer().decode(sequences).decode()
             for sequences in island_sequences]
  has_code = ["def f" in text for text in decoded]
  has_prose = ["The river" in text for text in decoded]
  # Each island holds one kind only.
  assert sorted(has_code) == [False, True] and has_prose == [
      not code for code in has_code]
  # Disjoint and complete: every train document's tokens are in one island.
  train_tokens = sum(
      len((tmp_path / name).read_bytes()) + 1 for name in kinds
      if name in {path.name for path in tmp_path.iterdir()})
  corpus = corpus_lib.build_corpus(config)
  held_out = int(
      (corpus.validation == tokenizer_lib.ByteTokenizer.eos_id).sum())
  packed = sum(sequences.size for sequences in island_sequences)
  assert packed <= train_tokens and held_out >= 1
  assert packed > corpus.train.size - 2 * 33  # only the tails are dropped
  source = sources.make_batch_source(config, 2, batch_size=2, seed=0)
  weights = source.island_token_weights()
  assert weights.sum() == pytest.approx(1.0)
  np.testing.assert_allclose(
      weights, [s.size / packed for s in island_sequences])
  code_island = has_code.index(True)
  assert weights[code_island] < weights[1 - code_island]  # a third is code
  batch = source.next_batch()
  batch_text = [tokenizer_lib.ByteTokenizer().decode(batch[i])
                for i in range(2)]
  assert source.state() == {"step": 1}
  assert b"The river" not in batch_text[code_island]


def test_clustered_synthetic_islands_cover_the_documents_once():
  config = _data_config(island_split="clustered")
  island_sequences = corpus_lib.build_island_sequences(config, 3, seed=0)
  # Synthetic documents hold 64 tokens with EOS; clusters partition them.
  total_documents = sum(int((s == 8).sum()) for s in island_sequences)
  assert 64 - 3 <= total_documents <= 64
  source = sources.make_batch_source(config, 3, batch_size=1, seed=0)
  assert source.island_token_weights().sum() == pytest.approx(1.0)
  batches = [source.next_batch() for _ in range(4)]
  source.restore({"step": 2})
  np.testing.assert_array_equal(source.next_batch(), batches[2])


def test_clustered_c4_stream_keeps_each_kind_on_one_island(tmp_path):
  _write_c4_shards(tmp_path, [_code(i) if i % 2 else _prose(i)
                              for i in range(40)])
  config = _data_config(corpus="c4", path=str(tmp_path),
                        island_split="clustered")
  source = sources.make_batch_source(config, 2, batch_size=2, seed=0)
  weights = source.island_token_weights()
  assert weights.sum() == pytest.approx(1.0) and (weights > 0).all()
  batches = np.stack([source.next_batch() for _ in range(30)])
  text = [tokenizer_lib.ByteTokenizer().decode(batches[:, island]).decode()
          for island in range(2)]
  kinds = [("def f" in t, "The river" in t) for t in text]
  assert sorted(kinds) == [(False, True), (True, False)]
  state = source.state()
  following = source.next_batch()
  resumed = sources.make_batch_source(config, 2, batch_size=2, seed=0)
  resumed.restore(json.loads(json.dumps(state)))
  np.testing.assert_array_equal(resumed.next_batch(), following)


def test_clustered_needs_enough_data_per_island(tmp_path):
  _write_mixed_files(tmp_path, 12)
  config = _data_config(corpus="text_files", path=str(tmp_path),
                        island_split="clustered", sequence_length=32)
  with pytest.raises(ValueError, match="island .* cluster holds"):
    sources.make_batch_source(config, 2, batch_size=64, seed=0)
