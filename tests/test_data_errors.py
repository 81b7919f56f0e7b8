"""Bad data files fail as one DataError line naming the file and the problem."""
import gzip
import json
import pathlib
import subprocess
import sys

import ml_collections
import pytest
import sentencepiece as spm

from tests import helpers
from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import sources
from diloco_jax.data import tokenizer as tokenizer_lib

DataError = errors.DataError
_REPO = pathlib.Path(__file__).resolve().parents[1]


def _jsonl(num_lines: int) -> str:
  """JSON lines of varied text, so that gzip output is long enough to cut."""
  lines = (json.dumps({"text": f"document {i} " + f"word{i * 7} " * (i % 13)})
           for i in range(num_lines))
  return "".join(line + "\n" for line in lines)


def _write_gzip(path: pathlib.Path, text: str) -> bytes:
  data = gzip.compress(text.encode("utf-8"))
  path.write_bytes(data)
  return data


def _truncated_gzip(path: pathlib.Path, num_lines: int = 2000) -> None:
  data = _write_gzip(path, _jsonl(num_lines))
  path.write_bytes(data[:len(data) // 2])


def _one_line(error: pytest.ExceptionInfo) -> str:
  message = str(error.value)
  assert "\n" not in message
  return message


# C4 shards.


def test_truncated_gzip_shard_names_the_file_and_line(tmp_path):
  path = tmp_path / "c4-train.00000-of-00001.json.gz"
  _truncated_gzip(path)
  with pytest.raises(DataError, match=r"truncated gzip file") as error:
    list(c4_files.read_texts(path))
  message = _one_line(error)
  assert message.startswith(f"{path}: ")
  line = int(message.rsplit("(line ", 1)[1].rstrip(")"))
  assert 1 < line <= 2000  # some lines were read before the data ran out
  assert isinstance(error.value.__cause__, EOFError)


def test_a_file_that_is_not_gzip_names_the_file(tmp_path):
  path = tmp_path / "c4-train.00000-of-00001.json.gz"
  path.write_text('{"text": "plain JSON, not gzip"}\n')
  with pytest.raises(DataError, match=r"not a valid gzip file") as error:
    list(c4_files.read_texts(path))
  assert _one_line(error).startswith(f"{path}: ")
  assert _one_line(error).endswith("(line 1)")


def test_corrupt_deflate_data_names_the_file(tmp_path):
  path = tmp_path / "shard.jsonl.gz"
  data = bytearray(_write_gzip(path, _jsonl(200)))
  data[20:60] = b"\xff" * 40  # inside the deflate stream, past the header
  path.write_bytes(bytes(data))
  with pytest.raises(DataError, match=r"corrupt gzip data|not a valid gzip"
                     ) as error:
    list(c4_files.read_texts(path))
  assert _one_line(error).startswith(f"{path}: ")


@pytest.mark.parametrize("bad_line, problem", [
    ("{not json", r"not a JSON object with a 'text' field"),
    ('["text"]', r"not a JSON object with a 'text' field"),
    ('{"url": "x"}', r"not a JSON object with a 'text' field"),
    ('{"text": 5}', r"the 'text' field is not a string \(int\)"),
])
def test_a_malformed_json_line_names_file_and_line(tmp_path, bad_line,
                                                   problem):
  path = tmp_path / "shard.json.gz"
  lines = _jsonl(3).splitlines()
  _write_gzip(path, "\n".join(lines + ["", bad_line]) + "\n")
  with pytest.raises(DataError, match=problem) as error:
    list(c4_files.read_texts(path))
  assert _one_line(error).startswith(f"{path}:5: ")


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
  path = tmp_path / "shard.jsonl.gz"
  path.write_bytes(gzip.compress(b'{"text": "caf\xe9 ok"}\n'))
  assert list(c4_files.read_texts(path)) == [(0, "caf\ufffd ok")]


def test_the_pipeline_entry_point_raises_data_error_naming_the_shard(
    tmp_path):
  for shard in range(2):
    _write_gzip(tmp_path / f"c4-train.{shard:05d}-of-00002.json.gz",
                _jsonl(40))
  _write_gzip(tmp_path / "c4-validation.00000-of-00001.json.gz", _jsonl(40))
  bad = tmp_path / "c4-train.00001-of-00002.json.gz"
  _truncated_gzip(bad, num_lines=100)
  config = helpers.small_data_config(corpus="c4", path=str(tmp_path),
                                     sequence_length=15,
                                     validation_fraction=0.3)
  with pytest.raises(DataError, match=r"truncated gzip file") as error:
    # Reading the first batch at construction may already hit the cut.
    source = sources.make_batch_source(config, num_islands=2, batch_size=4,
                                       seed=0)
    for _ in range(500):  # enough to read past the cut, about line 50
      source.next_batch()
  assert _one_line(error).startswith(f"{bad}: ")


def test_a_shard_that_is_not_gzip_fails_when_the_source_is_built(tmp_path):
  for shard in range(2):
    (tmp_path / f"c4-train.{shard:05d}-of-00002.json.gz").write_text(
        "version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer
  _write_gzip(tmp_path / "c4-validation.00000-of-00001.json.gz", _jsonl(40))
  config = helpers.small_data_config(corpus="c4", path=str(tmp_path),
                                     sequence_length=15,
                                     validation_fraction=0.3)
  with pytest.raises(DataError, match=r"c4-train\.0000[01]-of-00002\.json\.gz:"
                     r" not a valid gzip file"):
    sources.make_batch_source(config, num_islands=2, batch_size=4, seed=0)


# SentencePiece model files.


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
  """A real, tiny SentencePiece model (vocab 60)."""
  directory = tmp_path_factory.mktemp("spm")
  corpus = directory / "train.txt"
  corpus.write_text("\n".join(f"The river ran past the mill in spring {i}. "
                              f"def f{i}(x): return x + {i}"
                              for i in range(100)))
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(directory / "tiny"), vocab_size=60,
      num_threads=1, minloglevel=2)
  return (directory / "tiny.model").read_bytes()


def _sentencepiece_config(path: pathlib.Path) -> ml_collections.ConfigDict:
  return helpers.small_data_config(corpus="embedded",
                                   tokenizer="sentencepiece",
                                   tokenizer_path=str(path))


def test_the_real_model_loads(tmp_path, model_bytes):
  path = tmp_path / "tiny.model"
  path.write_bytes(model_bytes)
  tokenizer = tokenizer_lib.build_tokenizer(_sentencepiece_config(path))
  assert tokenizer.vocab_size == 60


@pytest.mark.parametrize("kind, problem", [
    ("empty", r"the file is empty \(0 bytes\); expected a SentencePiece "
              r"\.model file"),
    ("garbage", r"not a SentencePiece model"),
    ("truncated", r"not a SentencePiece model"),
    ("directory", r"Is a directory"),
    ("missing", r"No such file or directory"),
])
def test_a_bad_model_file_is_a_data_error_naming_the_path(
    tmp_path, model_bytes, kind, problem):
  path = tmp_path / f"{kind}.model"
  if kind == "empty":
    path.write_bytes(b"")
  elif kind == "garbage":
    path.write_bytes(b"<html>404 Not Found</html>\n")
  elif kind == "truncated":
    path.write_bytes(model_bytes[:len(model_bytes) // 2])
  elif kind == "directory":
    path.mkdir()
  with pytest.raises(DataError, match=problem) as error:
    tokenizer_lib.build_tokenizer(_sentencepiece_config(path))
  assert _one_line(error).startswith(
      f"config.data.tokenizer_path: cannot load SentencePiece model "
      f"{str(path)!r}: ")


@pytest.mark.parametrize("kind", ["empty", "garbage", "truncated"])
def test_a_bad_model_file_exits_cleanly_in_a_fresh_process(
    tmp_path, model_bytes, kind):
  # sentencepiece used to segfault on an empty model (rc 139), which would
  # take pytest down with it: load it in a child process.
  path = tmp_path / f"{kind}.model"
  path.write_bytes({"empty": b"", "garbage": b"\x00\x01 not a model",
                    "truncated": model_bytes[:len(model_bytes) - 1]}[kind])
  script = (
      "import ml_collections\n"
      "from diloco_jax.data import tokenizer\n"
      "tokenizer.build_tokenizer(ml_collections.ConfigDict(\n"
      f"    {{'tokenizer': 'sentencepiece', 'tokenizer_path': {str(path)!r}}}"
      "))\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=_REPO,
                          capture_output=True, text=True, timeout=60,
                          check=False)
  assert result.returncode == 1, (result.returncode, result.stderr)
  last_line = result.stderr.strip().splitlines()[-1]
  assert last_line.startswith("diloco_jax.data.errors.DataError: "
                              "config.data.tokenizer_path: cannot load "
                              f"SentencePiece model {str(path)!r}: ")
