"""Pre-tokenized corpora: `python -m diloco_jax.data.prepare` and the
"tokens" corpus that trains from its shards.

The prepared tokens are checked against the streamed pipeline itself: the
batches of corpus "tokens" must be those corpus "c4" streams from the same
shards with the same tokenizer, bit for bit. Fixtures are small C4-format
shards, text files and a TFDS dataset made here; no network.
"""
import gzip
import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece
from sentencepiece import sentencepiece_model_pb2

from configs import tiny
from diloco_jax.config import validation
from diloco_jax.data import errors
from diloco_jax.data import file_split
from diloco_jax.data import prepare
from diloco_jax.data import prepare_plan
from diloco_jax.data import shard_files
from diloco_jax.data import sources
from diloco_jax.data import token_shards
from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.data import train_tokenizer
from diloco_jax.parallel import multihost
from diloco_jax.run import train
from tests import helpers
from tests import test_checkpoint
from tests import test_data_c4

REPO = pathlib.Path(__file__).resolve().parents[1]
_WORDS = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du")


def _stored(index, shard):
  """A shard's tokens as the run reads them (its checksum checked)."""
  return shard_files.ShardFile(index, shard).read(0, shard.tokens)


def _document(rng: random.Random) -> str:
  words = ("".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
           for _ in range(rng.randint(3, 40)))
  return " ".join(words) + "."


def _write_c4(directory: pathlib.Path, train_shards: int = 5,
              documents: int = 40, seed: int = 0) -> pathlib.Path:
  """C4-named shards, gzipped and plain; one train shard has blank lines
  and empty texts, which the readers skip."""
  rng = random.Random(seed)
  directory.mkdir(parents=True, exist_ok=True)
  names = [f"c4-train.{index:05d}-of-00099.json{'.gz' if index % 2 else ''}"
           for index in range(train_shards)]
  for name in [*names, "c4-validation.00000-of-00001.json.gz"]:
    lines = [json.dumps({"text": _document(rng)}) for _ in range(documents)]
    if name == names[0]:
      lines[3:3] = ["", json.dumps({"text": ""})]
    content = "\n".join(lines) + "\n"
    if name.endswith(".gz"):
      with gzip.open(directory / name, "wt", encoding="utf-8") as f:
        f.write(content)
    else:
      (directory / name).write_text(content, encoding="utf-8")
  return directory


@pytest.fixture(scope="module")
def c4_dir(tmp_path_factory) -> pathlib.Path:
  return _write_c4(tmp_path_factory.mktemp("c4"))


@pytest.fixture(scope="module")
def spm_model(c4_dir, tmp_path_factory) -> str:
  """A 300-piece SentencePiece model trained on the shards."""
  path = tmp_path_factory.mktemp("spm") / "spm.model"
  train_tokenizer.train(str(c4_dir), vocab_size=300, megabytes=1,
                        output=str(path), threads=1)
  return str(path)


def _prepare(path, output, processes=1, **kwargs) -> token_shards.TokenIndex:
  plan = prepare_plan.make_plan(kwargs.pop("corpus", "c4"), str(path),
                           str(output), **kwargs)
  return prepare.prepare(plan, processes)


def _data(corpus: str, path, tokenizer_path: str = "", **overrides):
  return helpers.small_data_config(
      corpus=corpus, path=str(path), sequence_length=15,
      tokenizer="sentencepiece" if tokenizer_path else "byte",
      tokenizer_path=tokenizer_path, **overrides)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
  return {path.name: path.read_bytes() for path in directory.iterdir()
          if path.name != token_shards.INDEX_FILE}


# The prepared tokens are the streamed ones.


@pytest.mark.parametrize("tokenizer", ["byte", "sentencepiece"])
def test_tokens_batches_are_the_streamed_c4_batches(c4_dir, spm_model,
                                                    tmp_path, tokenizer):
  model = spm_model if tokenizer == "sentencepiece" else ""
  index = _prepare(c4_dir, tmp_path / "tokens", tokenizer_path=model)
  streamed = sources.make_batch_source(_data("c4", c4_dir, model), 2, 3,
                                       seed=7)
  prepared = sources.make_batch_source(
      _data("tokens", tmp_path / "tokens", model), 2, 3, seed=7)
  # Through several epochs: each visits an island's 2 or 3 shards in an
  # order of its own.
  for _ in range(4 * index.tokens("train") // (2 * 3 * 16)):
    np.testing.assert_array_equal(prepared.next_batch(),
                                  streamed.next_batch())
  assert prepared.state()["islands"][0]["epoch"] >= 3
  np.testing.assert_array_equal(
      sources.make_eval_batches(_data("tokens", tmp_path / "tokens", model),
                                batch_size=2, num_batches=3),
      sources.make_eval_batches(_data("c4", c4_dir, model), 2, 3))
  built = tokenizer_lib.build_tokenizer(_data("c4", c4_dir, model))
  assert prepared.info.vocab_size == built.vocab_size == index.vocab_size
  assert index.dtype_name == "uint16" and index.eos_id == built.eos_id
  if model:
    assert index.tokenizer["model_file"] == "spm.model"
    assert len(index.tokenizer["model_sha256"]) == 64
  # 40 documents a shard, the empty text and the blank line not among them.
  assert [shard.documents for shard in index.splits["train"]] == [40] * 5


def test_processes_write_the_same_shards(c4_dir, tmp_path):
  one = _prepare(c4_dir, tmp_path / "one")
  two = _prepare(c4_dir, tmp_path / "two", processes=2)
  assert _files(tmp_path / "one") == _files(tmp_path / "two")
  assert one.splits == two.splits


def test_text_files_become_shards_of_their_files(tmp_path, spm_model):
  rng = random.Random(1)
  texts = {f"doc{index:02d}.txt": _document(rng) * 5 for index in range(20)}
  (tmp_path / "text").mkdir()
  for name, text in texts.items():
    (tmp_path / "text" / name).write_text(text)
  index = _prepare(tmp_path / "text", tmp_path / "tokens",
                   corpus="text_files", tokenizer_path=spm_model,
                   validation_fraction=0.2)
  encoder = tokenizer_lib.SentencePieceTokenizer(spm_model)
  names = sorted(texts)
  held = set(file_split.select_split(names, "validation", 0.2))
  assert 0 < len(held) < len(names)  # else the last file is held out
  for split in token_shards.SPLITS:
    files = [name for number, name in enumerate(names)
             if (number in held) == (split == "validation")]
    expected = np.concatenate([np.append(encoder.encode(texts[name]),
                                         encoder.eos_id) for name in files])
    stored = np.concatenate([_stored(index, shard)
                             for shard in index.splits[split]])
    np.testing.assert_array_equal(stored, expected)
    assert sum(shard.documents for shard in index.splits[split]) == len(files)
  assert len(index.splits["train"]) <= prepare_plan.MIN_TEXT_SHARDS


def test_a_tfds_split_becomes_the_streamed_batches(tmp_path, monkeypatch):
  data_dir = tmp_path / "tfds"
  test_data_c4.TinyC4Test(data_dir=str(data_dir),
                          file_format="array_record").download_and_prepare()
  # Small virtual shards: several per island, as the streamed test has.
  monkeypatch.setattr(sources.tfds_documents, "RECORDS_PER_SHARD", 7)
  index = _prepare(data_dir, tmp_path / "tokens", tfds_name="tiny_c4_test")
  assert len(index.splits["train"]) == 6  # 40 records, 7 a shard
  streamed = sources.make_batch_source(
      _data("c4", data_dir, tfds_name="tiny_c4_test"), 2, 2, seed=0)
  prepared = sources.make_batch_source(_data("tokens", tmp_path / "tokens"),
                                       2, 2, seed=0)
  for _ in range(40):
    np.testing.assert_array_equal(prepared.next_batch(),
                                  streamed.next_batch())


def _wide_model(directory: pathlib.Path) -> str:
  """A SentencePiece model of 66,022 ids: a small trained one plus pieces
  "▁qNx" that text can name, so ids beyond uint16 are produced."""
  text = (_document(random.Random(2)) for _ in range(200))
  model = directory / "base.model"
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=text, model_prefix=str(directory / "base"),
      vocab_size=40, hard_vocab_limit=False, minloglevel=2)
  proto = sentencepiece_model_pb2.ModelProto.FromString(model.read_bytes())
  for number in range(66_000):
    piece = proto.pieces.add()
    piece.piece, piece.score = f"\u2581q{number}x", -100.0
  wide = directory / "wide.model"
  wide.write_bytes(proto.SerializeToString())
  return str(wide)


def test_a_vocabulary_beyond_uint16_is_prepared_as_uint32(tmp_path):
  (tmp_path / "text").mkdir()
  texts = ["kalo q65900x mi q3x.", "ne q65999x ru.", "ta q70x."]
  for number, text in enumerate(texts):
    (tmp_path / "text" / f"{number}.txt").write_text(text)
  model = _wide_model(tmp_path)
  with pytest.raises(errors.DataError, match="pre-tokenize the corpus"):
    tokenizer_lib.SentencePieceTokenizer(model)  # streamed ids are uint16
  index = _prepare(tmp_path / "text", tmp_path / "tokens",
                   corpus="text_files", tokenizer_path=model)
  assert index.dtype_name == "uint32" and index.vocab_size > 2**16
  stored = np.concatenate([_stored(index, shard)
                           for split in token_shards.SPLITS
                           for shard in index.splits[split]])
  assert stored.dtype == np.dtype("<u4") and stored.max() >= 2**16
  encoder = tokenizer_lib.SentencePieceTokenizer(
      model, tokenizer_lib.MAX_WIDE_VOCAB_SIZE)
  assert encoder.dtype == np.uint32
  assert sorted(stored.tolist()) == sorted(np.concatenate(
      [np.append(encoder.encode(text), encoder.eos_id)
       for text in texts]).tolist())


# Resuming a killed prepare.


def _killed_in_the_third_shard(monkeypatch):
  """Makes the next prepare (in this process) stop as if killed while it
  writes its third shard, a few documents in."""
  real = prepare._documents  # pylint: disable=protected-access
  started = []

  def documents(reader):
    started.append(reader)
    for number, text in enumerate(real(reader)):
      if len(started) == 3 and number == 5:
        raise KeyboardInterrupt
      yield text

  monkeypatch.setattr(prepare, "_documents", documents)


def test_a_killed_prepare_redoes_only_its_unfinished_shards(
    c4_dir, tmp_path, monkeypatch):
  whole = _prepare(c4_dir, tmp_path / "whole")
  output = tmp_path / "killed"
  with monkeypatch.context() as patch:
    _killed_in_the_third_shard(patch)
    with pytest.raises(KeyboardInterrupt):
      _prepare(c4_dir, output)
  # The shard being written is only a .part; the run refuses the directory.
  (part,) = output.glob("*.part")
  assert not part.with_suffix("").exists()
  assert not (output / token_shards.INDEX_FILE).exists()
  with pytest.raises(validation.ConfigError, match="has not finished"):
    validation.validate_config(_tiny_tokens(output), 8)
  # And a finished shard lost too: it is made again, the other one kept.
  kept, lost = sorted(output.glob("*.bin"))
  lost.unlink()
  kept_inode = kept.stat().st_ino
  resumed = _prepare(c4_dir, output)
  assert kept.stat().st_ino == kept_inode  # not rewritten
  assert _files(output) == _files(tmp_path / "whole")  # no .part, no progress
  assert resumed.splits == whole.splits


def test_a_rerun_repairs_a_finished_prepare(c4_dir, tmp_path, monkeypatch):
  output = tmp_path / "tokens"
  whole = _prepare(c4_dir, output)
  before = _files(output)
  inode = (output / "train-00000.bin").stat().st_ino
  assert _prepare(c4_dir, output).splits == whole.splits  # nothing to do
  for name in ("validation-00000.bin", "train-00001.bin"):
    path = output / name
    path.write_bytes(path.read_bytes()[:-2])  # cut, as by a full disk
  # Killed after repairing one: no index until both are whole again.
  real, calls = prepare.tokenize_shard, []

  def killed_at_the_second(task, *args):
    calls.append(task.file)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(task, *args)

  with monkeypatch.context() as patch:
    patch.setattr(prepare, "tokenize_shard", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
      _prepare(c4_dir, output)
  assert not (output / token_shards.INDEX_FILE).exists()
  assert _prepare(c4_dir, output).splits == whole.splits
  assert _files(output) == before
  assert (output / "train-00000.bin").stat().st_ino == inode


# Training from the shards.


def _tiny_tokens(path, **overrides):
  return helpers.with_overrides(tiny.get_config(), {
      "data.corpus": "tokens", "data.path": str(path),
      "model.vocab_size": 257, **overrides})


@pytest.fixture(scope="module")
def tokens_dir(c4_dir, tmp_path_factory) -> pathlib.Path:
  output = tmp_path_factory.mktemp("prepared") / "tokens"
  _prepare(c4_dir, output)
  return output


def test_a_run_on_tokens_resumes_exactly(tokens_dir, tmp_path):
  config = lambda: _tiny_tokens(tokens_dir, **{
      "total_steps": 4, "diloco.inner_steps": 2,
      "checkpoint.every_steps": 1, "checkpoint.max_to_keep": 10})
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  train.train_and_evaluate(config(), whole)
  # As if killed after step 3: mid-round, islands mid-shard.
  test_checkpoint.forget_after(whole, resumed, 3)
  train.train_and_evaluate(config(), resumed)
  test_checkpoint._assert_identical_runs(whole, resumed)  # pylint: disable=protected-access


def test_a_process_reads_its_own_islands_rows(tokens_dir):
  config = _data("tokens", tokens_dir)
  every = sources.make_batch_source(config, 3, batch_size=2, seed=0)
  mine = sources.make_batch_source(config, 3, batch_size=2, seed=0,
                                   islands=range(1, 3))
  for _ in range(5):
    np.testing.assert_array_equal(mine.next_batch(), every.next_batch()[1:])
  merged = multihost.merge_island_states(every.state(), range(3), 3)
  again = sources.make_batch_source(config, 3, batch_size=2, seed=0,
                                    islands=range(1, 3))
  again.restore(json.loads(json.dumps(merged)))
  np.testing.assert_array_equal(again.next_batch(), every.next_batch()[1:])


# Bad input: one line, before anything is compiled or written.


def _break(kind: str, directory: pathlib.Path) -> None:
  """Breaks the prepared shards in `directory` as `kind` says."""
  def edit_index(edit):
    path = directory / token_shards.INDEX_FILE
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))

  if kind == "missing shard":
    (directory / "train-00001.bin").unlink()
  elif kind == "truncated shard":
    path = directory / "train-00002.bin"
    path.write_bytes(path.read_bytes()[:-3])
  elif kind == "vocabulary beyond the dtype":
    edit_index(lambda content: content["tokenizer"].update(vocab_size=70_000))
  elif kind == "another dtype":
    edit_index(lambda content: content.update(dtype="int8"))
  elif kind == "shards overwritten, same size":
    # Ids the model cannot embed, as many as before: once a NaN at step 1.
    for shard in directory.glob("train-*.bin"):
      np.full(shard.stat().st_size // 2, 65535, "<u2").tofile(shard)
  elif kind == "ids beyond the vocabulary":
    edit_index(lambda content: content["splits"]["train"][1].update(
        max_id=300))
  elif kind == "index without checksums":
    def unchecked(content):
      content["format"] = token_shards.UNCHECKED_FORMAT
      for shards in content["splits"].values():
        for shard in shards:
          del shard["sha256"], shard["max_id"]
    edit_index(unchecked)


def _other_model(spm_model: str, path: pathlib.Path) -> str:
  """The same pieces with one score changed: another model, another hash."""
  proto = sentencepiece_model_pb2.ModelProto.FromString(
      pathlib.Path(spm_model).read_bytes())
  proto.pieces[-1].score -= 1.0
  path.write_bytes(proto.SerializeToString())
  return str(path)


_BAD = {
    "missing shard": r"shard .*train-00001\.bin listed in index\.json is "
                     r"missing",
    "truncated shard": r"shard .*train-00002\.bin holds \d+ bytes, not the "
                       r"\d+ tokens x 2 bytes",
    "vocabulary beyond the dtype": r"a vocabulary of 70000 ids, which does "
                                   r"not fit its dtype uint16",
    "another dtype": r"says dtype 'int8', not one of 'uint16', 'uint32'",
    "sentencepiece shards, byte run": r"made by SentencePiece model "
                                      r"spm\.model .* but config\.data names "
                                      r"the byte tokenizer \(257 ids\)",
    "another sentencepiece model": r"made by SentencePiece model spm\.model "
                                   r"\(sha256 \w+, 300 ids\), but config\."
                                   r"data names SentencePiece model "
                                   r"other\.model",
    "shards overwritten, same size": r"shard .*train-\d+\.bin is not the "
                                     r"shard prepare wrote: its bytes' sha256 "
                                     r"is \w+\.\. and its largest id 65535, "
                                     r"where index\.json says \w+\.\. and "
                                     r"256 ",
    "ids beyond the vocabulary": r"shard .*train-00001\.bin holds token id "
                                 r"300 \(index\.json says\), beyond the 257 "
                                 r"ids",
    "index without checksums": r"was written by an older prepare, without "
                               r"the shards' checksums; add them once with "
                               r"python -m diloco_jax\.data\.prepare "
                               r"--verify --output=",
    "unfinished prepare": r"its prepare has not finished \(no index\.json "
                          r"yet\); rerun the same python -m "
                          r"diloco_jax\.data\.prepare command",
}


@pytest.mark.parametrize("kind", list(_BAD))
def test_unusable_shards_are_one_line_and_nothing_is_written(
    kind, c4_dir, spm_model, tmp_path):
  directory = tmp_path / "tokens"
  made_by_spm = "sentencepiece model" in kind or "sentencepiece shards" in kind
  _prepare(c4_dir, directory, tokenizer_path=spm_model if made_by_spm else "")
  _break(kind, directory)
  overrides = {}
  if kind == "another sentencepiece model":
    overrides = {"data.tokenizer": "sentencepiece", "data.tokenizer_path":
                 _other_model(spm_model, tmp_path / "other.model")}
  elif kind == "unfinished prepare":
    (directory / token_shards.INDEX_FILE).rename(
        directory / token_shards.PROGRESS_FILE)
  workdir = tmp_path / "run"
  config = _tiny_tokens(directory, **overrides)
  # A shard's content is read at the data's setup (DataError), the rest
  # checked with the config (ConfigError): both before the workdir.
  with pytest.raises((validation.ConfigError, errors.DataError),
                     match=_BAD[kind]) as error:
    train.train_and_evaluate(config, str(workdir))
  assert "\n" not in str(error.value)
  assert not workdir.exists()


def test_the_command_line_refuses_in_one_line_and_creates_nothing(
    c4_dir, spm_model, tmp_path):
  env = {**os.environ, "PYTHONPATH": str(REPO)}

  def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "diloco_jax.data.prepare", *args], cwd=REPO,
        env=env, capture_output=True, text=True, timeout=120, check=False)

  output = tmp_path / "out"
  cases = {
      (f"--path={tmp_path / 'nowhere'}",): "error: --path: ",
      (f"--path={c4_dir}", f"--tokenizer_path={tmp_path / 'no.model'}"):
          "error: --tokenizer_path: cannot load SentencePiece model",
  }
  for args, expected in cases.items():
    result = run(*args, f"--output={output}")
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(expected)
    assert "Traceback" not in result.stderr
    assert not output.exists()
  # An output of another prepare (bytes, then SentencePiece) is left as is.
  assert run(f"--path={c4_dir}", f"--output={output}").returncode == 0
  before = _files(output)
  result = run(f"--path={c4_dir}", f"--tokenizer_path={spm_model}",
               f"--output={output}")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith(
      f"error: --output={str(output)!r} holds tokens prepared from other "
      "input or with another tokenizer")
  assert _files(output) == before


def test_verify_checks_every_shard_and_adds_checksums_to_an_old_index(
    tokens_dir, tmp_path):
  directory = tmp_path / "tokens"
  directory.mkdir()
  for entry in tokens_dir.iterdir():
    (directory / entry.name).write_bytes(entry.read_bytes())
  written = (directory / token_shards.INDEX_FILE).read_text()
  _break("index without checksums", directory)

  def verify():
    return subprocess.run(
        [sys.executable, "-m", "diloco_jax.data.prepare", "--verify",
         f"--output={directory}"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120, check=False)

  result = verify()
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith("recorded the checksums of ")
  # The same checksums prepare records: the index is the one it wrote.
  assert (json.loads((directory / token_shards.INDEX_FILE).read_text())
          == json.loads(written))
  shard = directory / "validation-00000.bin"
  tokens = np.fromfile(shard, "<u2")
  tokens[3] ^= 1  # one bit
  tokens.tofile(shard)
  result = verify()
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"error: --output: shard {shard} is not the shard prepare wrote"), lines
