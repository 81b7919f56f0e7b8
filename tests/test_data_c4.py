"""The streamed C4 corpus: JSON-lines shards and TFDS, packing, resuming."""
import gzip
import importlib
import json
import pathlib

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import tiny
from tests import helpers
from diloco_jax.data import c4_files
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import settings as data_settings
from diloco_jax.data import sources
from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.run import train

EOS = tokenizer_lib.ByteTokenizer.eos_id


def _data_config(**overrides) -> ml_collections.ConfigDict:
  return helpers.small_data_config(**{
      "corpus": "c4", "sequence_length": 15,
      "validation_fraction": 0.3, **overrides})


def _document(shard: str, index: int) -> str:
  # Varying lengths make sequences straddle document boundaries.
  return f"<{shard}:{index}>" + "abc " * (index % 5)


def _write_shard(path: pathlib.Path, texts: list[str],
                 blank_lines: bool = False) -> None:
  lines = []
  for number, text in enumerate(texts):
    lines.append(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                             "url": f"https://example.com/{number}"}))
    if blank_lines:
      lines.append("")
  content = "\n".join(lines) + "\n"
  if path.name.endswith(".gz"):
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(content)
  else:
    path.write_text(content, encoding="utf-8")


def _write_c4(directory: pathlib.Path, num_train: int = 4,
              docs_per_shard: int = 12) -> dict[str, list[str]]:
  """C4-named shards, alternately .json.gz and .jsonl; returns their texts."""
  texts = {}
  for shard in range(num_train):
    suffix = ".json.gz" if shard % 2 == 0 else ".jsonl"
    name = f"c4-train.{shard:05d}-of-{num_train:05d}{suffix}"
    texts[name] = [_document(f"t{shard}", index)
                   for index in range(docs_per_shard)]
    _write_shard(directory / name, texts[name], blank_lines=shard == 1)
  name = "c4-validation.00000-of-00001.json.gz"
  texts[name] = [_document("v0", index) for index in range(docs_per_shard)]
  _write_shard(directory / name, texts[name])
  return texts


def _decoded_documents(tokens: np.ndarray) -> list[str]:
  """Splits a token stream at EOS; the first and last pieces may be partial."""
  pieces = np.split(tokens, np.flatnonzero(tokens == EOS))
  return [tokenizer_lib.ByteTokenizer().decode(piece).decode()
          for piece in pieces]


def test_c4_shards_pack_into_batches_with_eos_after_each_document(tmp_path):
  texts = _write_c4(tmp_path)
  source = sources.make_batch_source(_data_config(path=str(tmp_path)),
                                     num_islands=2, batch_size=3, seed=0)
  assert source.info.vocab_size == 257 and source.info.eos_id == EOS
  batches = np.stack([source.next_batch() for _ in range(12)])
  assert batches.shape == (12, 2, 3, 16) and batches.dtype == np.int32
  train_names = sorted(name for name in texts if "train" in name)
  for island in range(2):
    stream = batches[:, island].ravel()
    documents = _decoded_documents(stream)[1:-1]  # whole documents only
    own_shards = {f"t{index}" for index, _ in enumerate(train_names)
                  if index % 2 == island}
    own_texts = [text for index, name in enumerate(train_names)
                 if index % 2 == island for text in texts[name]]
    # Every whole document is one of the island's, with EOS right after it.
    assert documents and all(document in own_texts for document in documents)
    assert {document[1:3] for document in documents} <= own_shards
    # Within a shard, documents come in line order, each once per epoch.
    epoch = documents[:len(own_texts) - 1]
    assert len(set(epoch)) == len(epoch)
  # The validation shard (named so) never reaches training.
  assert "<v0:" not in tokenizer_lib.ByteTokenizer().decode(batches).decode()


def test_c4_eval_batches_come_from_validation_files_in_order(tmp_path):
  texts = _write_c4(tmp_path)
  evaluation = sources.make_eval_batches(_data_config(path=str(tmp_path)),
                                         batch_size=2, num_batches=3)
  assert evaluation.shape == (3, 2, 16) and evaluation.dtype == np.int32
  expected = np.concatenate([
      np.append(tokenizer_lib.ByteTokenizer().encode(text), EOS)
      for text in texts["c4-validation.00000-of-00001.json.gz"]])
  np.testing.assert_array_equal(evaluation.ravel(), expected[:6 * 16])
  with pytest.raises(ValueError, match="validation split holds only"):
    sources.make_eval_batches(_data_config(path=str(tmp_path)),
                              batch_size=64, num_batches=10)


def test_read_texts_skips_blank_lines_but_keeps_line_numbers(tmp_path):
  path = tmp_path / "shard.jsonl"
  path.write_text('{"text": "a"}\n\n{"text": ""}\n{"text": "b"}\n')
  assert list(c4_files.read_texts(path)) == [(0, "a"), (3, "b")]
  assert list(c4_files.read_texts(path, start_line=1)) == [(3, "b")]
  (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"url": 1}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
    list(c4_files.read_texts(tmp_path / "bad.jsonl"))


def test_split_by_hash_without_validation_names(tmp_path):
  for index in range(6):
    _write_shard(tmp_path / f"part-{index}.jsonl", [f"doc {index}"])
  (tmp_path / "README.txt").write_text("not a shard")
  train, validation = c4_files.split_shards(str(tmp_path), 0.3,
                                            hold_out=True)
  assert train and validation and not set(train) & set(validation)
  assert sorted(train + validation) == c4_files.list_shards(str(tmp_path))
  assert all(path.suffix == ".jsonl" for path in train + validation)


@pytest.mark.parametrize("resume_after", [0, 3, 7, 20])
def test_c4_resume_gives_the_uninterrupted_batches(tmp_path, resume_after):
  _write_c4(tmp_path, num_train=4, docs_per_shard=5)  # epochs of ~5 steps
  config = _data_config(path=str(tmp_path))
  uninterrupted = sources.make_batch_source(config, 2, 2, seed=3)
  for _ in range(resume_after):
    uninterrupted.next_batch()
  state = uninterrupted.state()
  expected = [uninterrupted.next_batch() for _ in range(8)]
  for saved in (state, json.loads(json.dumps(state))):
    resumed = sources.make_batch_source(config, 2, 2, seed=3)
    resumed.restore(saved)
    assert resumed.state() == state
    for batch in expected:
      np.testing.assert_array_equal(resumed.next_batch(), batch)


def test_c4_epochs_reorder_shards_and_repeat_documents(tmp_path):
  _write_c4(tmp_path, num_train=6, docs_per_shard=2)
  source = sources.make_batch_source(_data_config(path=str(tmp_path)), 1, 1,
                                     seed=0)
  stream = np.concatenate([source.next_batch().ravel() for _ in range(60)])
  documents = _decoded_documents(stream)[:-1]  # the stream starts whole
  first_epoch = documents[:12]  # 6 train shards x 2 documents
  assert len(set(first_epoch)) == 12
  shard_orders = [
      [doc[1:3] for doc in documents[start:start + 12:2]]
      for start in range(0, 36, 12)]
  assert all(sorted(order) == sorted(shard_orders[0])
             for order in shard_orders)
  assert len({tuple(order) for order in shard_orders}) > 1
  assert source.state()["islands"][0]["epoch"] >= 2


def test_c4_restore_rejects_a_state_of_other_islands(tmp_path):
  _write_c4(tmp_path)
  config = _data_config(path=str(tmp_path))
  state = sources.make_batch_source(config, 2, 2, seed=0).state()
  with pytest.raises(ValueError, match="expected 4"):
    sources.make_batch_source(config, 4, 2, seed=0).restore(state)


@pytest.mark.parametrize("setup, overrides, message", [
    ("empty", {}, r"config\.data\.path: no C4 shards"),
    ("validation_only", {}, r"config\.data\.path: every shard .* no train"),
    ("one_shard", {}, r"config\.data\.path: none of the 1 C4 shard"),
    ("one_shard", {"hold_out_shards": True},
     r"config\.data\.path: 1 C4 shard"),
    ("c4", {"tokenizer": "wordpiece"}, r"config\.data\.tokenizer='wordpiece'"),
    ("c4", {"island_split": "random"}, r"config\.data\.island_split='random'"),
])
def test_c4_config_errors_name_the_field(tmp_path, setup, overrides, message):
  if setup == "empty":
    (tmp_path / "notes.txt").write_text("no shards here")
  elif setup == "validation_only":
    _write_shard(tmp_path / "c4-validation.00000-of-00001.json", ["x"])
  elif setup == "one_shard":
    _write_shard(tmp_path / "c4-train.00000-of-00001.json", ["x"])
  else:
    _write_c4(tmp_path)
  config = _data_config(path=str(tmp_path), **overrides)
  with pytest.raises(ValueError, match=message):
    data_settings.validate_data_config(config)
  with pytest.raises(ValueError, match=message):
    sources.make_batch_source(config, 2, 2, seed=0)


def test_c4_needs_a_shard_per_island(tmp_path):
  _write_c4(tmp_path, num_train=2)
  with pytest.raises(ValueError, match=r"2 train shard\(s\) for 3 islands"):
    sources.make_batch_source(_data_config(path=str(tmp_path)), 3, 2, seed=0)


def test_build_corpus_refuses_the_streamed_corpus(tmp_path):
  _write_c4(tmp_path)
  with pytest.raises(ValueError, match="streamed"):
    corpus_lib.build_corpus(_data_config(path=str(tmp_path)))


# TFDS, without network: tiny datasets prepared locally by TFDS builders
# (array_record, read by tfds.data_source: no TensorFlow needed), one of them
# laid out as "c4/en" itself, and "c4/en" under tfds.testing.mock_data.


class TinyC4Test(tfds.core.GeneratorBasedBuilder):
  """Registered as "tiny_c4_test": C4's features, a few documents."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            "text": tfds.features.Text(),
            "timestamp": tfds.features.Text(),
            "url": tfds.features.Text(),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing is downloaded
    return {"train": self._generate_examples("t", 40),
            "validation": self._generate_examples("v", 20)}

  def _generate_examples(self, tag, count):
    for index in range(count):
      yield f"{tag}{index}", {"text": _document(tag, index),
                              "timestamp": "2019-04-25T12:57:54Z",
                              "url": f"https://example.com/{index}"}


@pytest.fixture(scope="module")
def tfds_data_dir(tmp_path_factory) -> str:
  data_dir = tmp_path_factory.mktemp("tfds")
  TinyC4Test(data_dir=str(data_dir),
             file_format="array_record").download_and_prepare()
  return str(data_dir)


def test_tfds_split_streams_batches_and_resumes(tfds_data_dir, monkeypatch):
  # Small virtual shards give each island several of them.
  monkeypatch.setattr(sources.tfds_documents, "RECORDS_PER_SHARD", 7)
  config = _data_config(tfds_name="tiny_c4_test", path=tfds_data_dir)
  source = sources.make_batch_source(config, num_islands=2, batch_size=2,
                                     seed=0)
  batches = [source.next_batch() for _ in range(6)]
  state = source.state()
  following = [source.next_batch() for _ in range(4)]
  text = tokenizer_lib.ByteTokenizer().decode(np.stack(batches)).decode()
  assert "<t" in text and "<v" not in text
  island_documents = [
      set(_decoded_documents(np.stack(batches)[:, island].ravel())[1:-1])
      for island in range(2)]
  assert island_documents[0] and island_documents[1]
  assert not island_documents[0] & island_documents[1]
  resumed = sources.make_batch_source(config, 2, 2, seed=0)
  resumed.restore(json.loads(json.dumps(state)))
  for batch in following:
    np.testing.assert_array_equal(resumed.next_batch(), batch)
  evaluation = sources.make_eval_batches(config, batch_size=2, num_batches=2)
  eval_text = tokenizer_lib.ByteTokenizer().decode(evaluation).decode()
  assert eval_text.startswith("<v") and "<t" not in eval_text


def test_tfds_c4_name_under_mock_data():
  # Registers TFDS's C4 builder class, which mock_data needs in place of
  # prepared files (a real data_dir needs no class: TFDS reads its metadata).
  importlib.import_module("tensorflow_datasets.text.c4")
  documents = [{"text": _document("m", index).encode()} for index in range(30)]

  def as_data_source(self, split, **kwargs):
    del self, kwargs
    assert split in ("train", "validation")
    return documents

  config = _data_config(tfds_name="c4/en", path="/nonexistent/tfds")
  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    source = sources.make_batch_source(config, 2, 1, seed=0)
    batch = source.next_batch()
  text = tokenizer_lib.ByteTokenizer().decode(batch).decode()
  assert "<m:" in text
  # TFDS's own random mock records go through the same reader.
  with tfds.testing.mock_data(num_examples=8):
    source = sources.make_batch_source(config, 2, 1, seed=0)
    assert source.next_batch().shape == (2, 1, 16)


class C4OnDisk(TinyC4Test, skip_registration=True):
  """TFDS's "c4/en" as `tfds build c4/en` leaves it in a data_dir (its
  name, config, version and text feature; array_record files under
  c4/en/3.1.0/), holding a few documents. Not registered: TFDS reads it by
  the metadata in the data_dir, or through its own C4 builder once that is
  imported (the mock_data test imports it), as it reads a real C4."""

  name = "c4"
  VERSION = tfds.core.Version("3.1.0")
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en")]

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing is downloaded
    return {"train": self._generate_examples("c", 60),
            "validation": self._generate_examples("w", 40)}


@pytest.fixture(scope="module")
def c4_data_dir(tmp_path_factory) -> str:
  data_dir = tmp_path_factory.mktemp("tfds_c4")
  C4OnDisk(config="en", data_dir=str(data_dir),
           file_format="array_record").download_and_prepare()
  assert (data_dir / "c4" / "en" / "3.1.0" / "dataset_info.json").exists()
  return str(data_dir)


def test_c4_en_prepared_on_disk_is_read_as_a_run_reads_it(c4_data_dir,
                                                         tmp_path):
  data = {"data.corpus": "c4", "data.tfds_name": "c4/en",
          "data.path": c4_data_dir}
  config = helpers.with_overrides(tiny.get_config(), {
      **data, "model.vocab_size": 257, "total_steps": 4,
      "eval.num_batches": 1})
  # The batches the run's data setup makes: train documents only, each
  # island its own, and the eval set the validation split's.
  source = sources.make_batch_source(config.data, num_islands=2,
                                     batch_size=4, seed=config.data.seed)
  batches = np.stack([source.next_batch() for _ in range(4)])
  island_documents = [
      set(_decoded_documents(batches[:, island].ravel())[1:-1])
      for island in range(2)]
  train_documents = {_document("c", index) for index in range(60)}
  for documents in island_documents:
    assert documents and documents <= train_documents
  assert not island_documents[0] & island_documents[1]
  evaluation = sources.make_eval_batches(config.data, batch_size=8,
                                         num_batches=1)
  eval_documents = _decoded_documents(evaluation.ravel())[1:-1]
  assert eval_documents and set(eval_documents) <= {
      _document("w", index) for index in range(40)}
  # And a run on it, configured as a user configures one.
  summary = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["corpus"] == "c4"
  assert summary["tokens_seen"] == (
      config.total_steps * config.diloco.islands * config.data.batch_size
      * config.data.sequence_length)
  assert np.isfinite(summary["final_eval_loss"])


def test_tfds_missing_dataset_names_the_field(tmp_path):
  config = _data_config(tfds_name="tiny_c4_test", path=str(tmp_path))
  with pytest.raises(ValueError, match=r"config\.data\.tfds_name="):
    sources.make_batch_source(config, 2, 2, seed=0)
