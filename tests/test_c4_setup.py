"""C4 as a newcomer sets it up (docs/c4.md): shards fetched, a tokenizer
trained on them, the small configs, and malformed shards refused before
anything is compiled or written.

No network: downloads come from file:// URLs and a local HTTP server on
127.0.0.1; the shards are small gzipped JSON-lines files made here.
"""

import gzip
import http.server
import importlib
import json
import os
import pathlib
import random
import subprocess
import sys
import threading

import pytest
import sentencepiece

from configs import c4_small
from diloco_jax.config import validation
from diloco_jax.data import c4_download
from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.data import train_tokenizer
from diloco_jax.model import transformer as model_lib
from diloco_jax.run import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8  # conftest forces 8 CPU devices
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du")


def _document(rng: random.Random) -> str:
  """A few lines of made-up words: enough distinct text for a few hundred
  SentencePiece pieces."""
  def word():
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
  return "\n".join(" ".join(word() for _ in range(rng.randint(4, 14))) + "."
                   for _ in range(rng.randint(2, 5)))


def _write_shard(path: pathlib.Path, texts: list[str]) -> None:
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": text, "url": "https://example.com"})
                 + "\n" for text in texts)


def _write_c4(directory: pathlib.Path, train_shards: int = 2,
              documents: int = 150, seed: int = 0) -> pathlib.Path:
  """C4-named shards (train_shards train, one validation) under directory."""
  rng = random.Random(seed)
  directory.mkdir(parents=True, exist_ok=True)
  for index in range(train_shards):
    _write_shard(directory / f"c4-train.{index:05d}-of-01024.json.gz",
                 [_document(rng) for _ in range(documents)])
  _write_shard(directory / "c4-validation.00000-of-00008.json.gz",
               [_document(rng) for _ in range(documents)])
  return directory


@pytest.fixture(scope="module")
def c4_dir(tmp_path_factory) -> pathlib.Path:
  """Shards and a 512-piece tokenizer trained on them (the quick size's),
  at _QUICK_MODEL."""
  directory = _write_c4(tmp_path_factory.mktemp("c4"))
  train_tokenizer.train(str(directory), vocab_size=512, megabytes=1,
                        output=str(directory / _QUICK_MODEL))
  return directory


_QUICK_MODEL = "spm_512.model"


def _quick_config(c4_dir: pathlib.Path, **overrides):
  config = c4_small.get_config("quick")
  config.data.path = str(c4_dir)
  config.data.tokenizer_path = str(c4_dir / _QUICK_MODEL)
  config.update_from_flattened_dict(overrides)
  return config


# 1. Malformed shards: the first lines of every shard are read up front.


def _corrupt_line(path: pathlib.Path, line: int, content: str) -> None:
  with gzip.open(path, "rt", encoding="utf-8") as f:
    lines = f.read().splitlines()
  lines[line - 1] = content
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def _long_documents_c4(directory: pathlib.Path) -> pathlib.Path:
  """Shards whose documents are longer than a quick run's first batch
  (4 x 33 tokens), so that reading that batch reaches none's 5th line."""
  _write_c4(directory)
  for path in c4_files.list_shards(str(directory)):
    with gzip.open(path, "rt", encoding="utf-8") as f:
      texts = [json.loads(line)["text"] for line in f]
    _write_shard(path, [text * 20 for text in texts])
  return directory


@pytest.mark.parametrize("shard, line, content", [
    ("c4-train.00001-of-01024.json.gz", 5, json.dumps({"url": "no text"})),
    ("c4-validation.00000-of-00008.json.gz", 3, '{"text": "cut off'),
])
def test_a_bad_line_among_the_first_of_any_shard_stops_before_the_workdir(
    c4_dir, tmp_path, shard, line, content):
  data = _long_documents_c4(tmp_path / "c4")
  _corrupt_line(data / shard, line, content)
  workdir = tmp_path / "run"
  config = _quick_config(c4_dir, **{"data.path": str(data)})
  with pytest.raises(errors.DataError) as error:
    train.train_and_evaluate(config, str(workdir))
  assert str(error.value).startswith(
      f"{data / shard}:{line}: not a JSON object with a 'text' field")
  assert "\n" not in str(error.value)
  assert not workdir.exists()


def test_the_command_line_names_the_bad_line_and_creates_nothing(
    c4_dir, tmp_path):
  data = _long_documents_c4(tmp_path / "c4")
  bad = data / "c4-train.00001-of-01024.json.gz"
  _corrupt_line(bad, 5, json.dumps({"url": "no text"}))
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "diloco_jax.main",
       "--config=configs/c4_small.py:quick", f"--workdir={workdir}",
       f"--config.data.path={data}",
       f"--config.data.tokenizer_path={c4_dir / _QUICK_MODEL}"],
      cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True,
      text=True, timeout=300, check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: {bad}:5: not a JSON object with a 'text' field ('text')")
  assert "Traceback" not in result.stderr
  assert not workdir.exists()


def test_only_the_first_lines_are_checked_up_front(tmp_path):
  """Line CHECKED_LINES is checked; the one after is found when read (a
  run then stops at it after saving: tests/test_run_safety.py)."""
  texts = [f"document {index}" for index in range(c4_files.CHECKED_LINES + 5)]
  checked, late = tmp_path / "checked.jsonl.gz", tmp_path / "late.jsonl.gz"
  for path, line in ((checked, c4_files.CHECKED_LINES),
                     (late, c4_files.CHECKED_LINES + 1)):
    _write_shard(path, texts)
    _corrupt_line(path, line, "not json")
  with pytest.raises(errors.DataError,
                     match=rf"checked.jsonl.gz:{c4_files.CHECKED_LINES}: "):
    c4_files.check_first_lines([late, checked])
  c4_files.check_first_lines([late])
  with pytest.raises(errors.DataError,
                     match=rf"late.jsonl.gz:{c4_files.CHECKED_LINES + 1}: "):
    list(c4_files.read_texts(late))


# 2. The tokenizer: trained on the first megabytes of the train shards,
# cached beside them.


def test_a_tokenizer_is_trained_on_the_train_shards_and_cached(tmp_path):
  data = _write_c4(tmp_path / "c4")
  # Letters only the validation shard holds, and letters only a train
  # shard holds (the documents are made of others).
  for name, word in (("c4-validation.00000-of-00008.json.gz", "zyxw"),
                     ("c4-train.00000-of-01024.json.gz", "qjqj")):
    with gzip.open(data / name, "rt", encoding="utf-8") as f:
      texts = [json.loads(line)["text"] for line in f]
    _write_shard(data / name, [f"{text} {word}" for text in texts])
  path, trained = train_tokenizer.train(str(data), vocab_size=400,
                                        megabytes=1)
  # The shards hold less than 1 MB of text: the name says how much.
  held = train_tokenizer.sample_bytes(
      c4_files.split_shards(str(data), 0.05)[0], 1) / 10**6
  assert 0 < held < 1
  assert trained and path == train_tokenizer.model_path(str(data), 400, held)
  assert path.name == (
      f"spm_400_{train_tokenizer.megabytes_name(held)}mb.model")
  tokenizer = tokenizer_lib.SentencePieceTokenizer(str(path))
  assert tokenizer.vocab_size == 400
  # Train letters are pieces; validation letters were never read, so only
  # byte fallback spells them.
  processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
  assert not any(map(processor.is_byte, processor.encode("qjqj")))
  assert sum(map(processor.is_byte, processor.encode("zyxw"))) == 4
  # Byte fallback: text the shards never held round-trips exactly.
  text = "kalo é 漢字 ✓"
  assert tokenizer.decode(tokenizer.encode(text)).decode() == text
  # The shards are still shards only: the model is not read as one.
  assert all(p.name.endswith(".json.gz")
             for p in c4_files.list_shards(str(data)))
  before = path.read_bytes()
  assert train_tokenizer.train(str(data), 400, 1) == (path, False)
  assert path.read_bytes() == before


def test_the_sample_stops_after_its_megabytes(tmp_path):
  data = _write_c4(tmp_path / "c4", train_shards=2)
  shards, _ = c4_files.split_shards(str(data), 0.05)
  every_line = list(train_tokenizer.sample_lines(shards, megabytes=100))
  budget = 2_000  # bytes
  sample = list(train_tokenizer.sample_lines(shards, budget / 10**6))
  sizes = [len(line.encode()) for line in sample]
  assert sum(sizes) >= budget > sum(sizes[:-1])
  assert sample == every_line[:len(sample)]  # the first lines, in order
  assert all(line and "\n" not in line for line in every_line)


@pytest.mark.parametrize("arguments, message", [
    ({"path": "MISSING"}, r"^--path: '.*MISSING' does not exist$"),
    ({"vocab_size": 100}, r"^--vocab_size=100 must be in \[260, 65536\]"),
    ({"megabytes": 0}, r"^--megabytes=0 must be >= 1$"),
    ({"vocab_size": 60_000},
     r"^--vocab_size=60000 is more pieces than all 0\.\d+ MB of text of "
     r"the train shards at .* \(less than --megabytes=1\) can fill: at "
     r"most (\d+); pass --vocab_size=\1 or less"),
    ({"output": "no_such_dir/spm.model"},
     r"^cannot write .*no_such_dir/spm.model: its directory is missing"),
])
def test_tokenizer_mistakes_are_one_line_and_write_nothing(
    tmp_path, arguments, message):
  data = _write_c4(tmp_path / "c4", documents=40)
  before = sorted(os.listdir(data))
  arguments = {"path": str(data), "vocab_size": 300, "megabytes": 1,
               **arguments}
  for key in ("path", "output"):
    if key in arguments and not arguments[key].startswith("/"):
      arguments[key] = str(tmp_path / arguments[key])
  with pytest.raises(errors.DataError, match=message) as error:
    train_tokenizer.train(**arguments)
  assert "\n" not in str(error.value)
  assert sorted(os.listdir(data)) == before


def test_a_run_without_a_tokenizer_says_how_to_get_one(c4_dir, tmp_path):
  config = _quick_config(c4_dir, **{"data.tokenizer_path": ""})
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.data\.tokenizer_path is required .* "
                     r"python -m diloco_jax\.data\.train_tokenizer"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  config = _quick_config(c4_dir, **{"data.path": str(tmp_path / "none")})
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.data\.path: '.*none' does not exist$"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


# 3. Shards fetched as allenai/c4 serves them.


def test_fetch_names_and_keeps_shards_as_c4_does(tmp_path):
  hub = _write_c4(tmp_path / "hub", train_shards=2, documents=5)
  reported = []
  paths = c4_download.fetch(str(tmp_path / "c4"), train_shards=2,
                            base_url=hub.as_uri() + "/",
                            report=reported.append)
  assert [p.name for p in paths] == [
      "c4-train.00000-of-01024.json.gz", "c4-train.00001-of-01024.json.gz",
      "c4-validation.00000-of-00008.json.gz"]
  assert all(p.read_bytes() == (hub / p.name).read_bytes() for p in paths)
  assert len(reported) == 3
  assert c4_files.list_shards(str(tmp_path / "c4")) == paths
  # What is there is kept: a second fetch reads nothing from the source.
  for path in hub.iterdir():
    path.unlink()
  assert c4_download.fetch(str(tmp_path / "c4"), 2,
                           base_url=hub.as_uri() + "/") == paths
  assert c4_download.shard_name("train", 1023) == (
      "c4-train.01023-of-01024.json.gz")


def test_a_failed_fetch_is_one_line_and_leaves_no_shard(tmp_path):
  hub = _write_c4(tmp_path / "hub", train_shards=1, documents=5)
  target = tmp_path / "c4"
  with pytest.raises(errors.DataError,
                     match=r"^cannot fetch file://.*c4-train.00001-of-01024"
                     r".json.gz: \[Errno 2\] No such file"):
    c4_download.fetch(str(target), train_shards=2,
                      base_url=hub.as_uri() + "/")
  assert [p.name for p in c4_files.list_shards(str(target))] == [
      "c4-train.00000-of-01024.json.gz"]
  assert sorted(os.listdir(target)) == ["c4-train.00000-of-01024.json.gz"]
  with pytest.raises(errors.DataError, match=r"^--train_shards=0 must be"):
    c4_download.fetch(str(target), train_shards=0)


class _CutShort(http.server.BaseHTTPRequestHandler):
  """Announces 1,000 bytes and closes the connection after 10."""

  def do_GET(self):  # pylint: disable=invalid-name
    self.send_response(200)
    self.send_header("Content-Length", "1000")
    self.end_headers()
    self.wfile.write(b"x" * 10)
    self.close_connection = True

  def log_message(self, *args):
    del args  # quiet


def test_a_download_cut_short_is_refused_not_kept(tmp_path):
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutShort)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    with pytest.raises(errors.DataError,
                       match=r"the connection closed after 10 of 1000 bytes"):
      c4_download.fetch(str(tmp_path / "c4"),
                        base_url=f"http://127.0.0.1:{server.server_port}/")
  finally:
    server.shutdown()
    server.server_close()
  assert os.listdir(tmp_path / "c4") == []


# 4. The configs: the paper's protocol at each size.


def test_the_paper_c4_configs_pretrain_as_the_paper_did():
  for name in ("c4_60m", "c4_150m", "c4_400m"):
    config = importlib.import_module(f"configs.{name}").get_config()
    assert (config.pretrain_steps, config.total_steps) == (24_000, 88_000)
    rounds = ((config.total_steps - config.pretrain_steps)
              // config.diloco.inner_steps)
    assert rounds == 128 and config.diloco.islands == 8


@pytest.mark.parametrize("size", c4_small.SIZES)
def test_each_small_size_validates_and_keeps_the_protocol(c4_dir, size):
  config = c4_small.get_config(size)
  with pytest.raises(validation.ConfigError, match=r"config\.data\.path"):
    validation.validate_config(config, num_devices=NUM_DEVICES)
  config.data.path = str(c4_dir)
  config.data.tokenizer_path = str(c4_dir / _QUICK_MODEL)
  run_config = validation.validate_config(config, num_devices=NUM_DEVICES)
  assert run_config.data.corpus == "c4"
  assert config.model.vocab_size == c4_small.VOCAB_SIZES[size]
  # Pretraining first, about the paper's share (24k of 88k), then whole
  # rounds.
  share = config.pretrain_steps / config.total_steps
  assert 0.2 <= share <= 0.3, share
  assert (config.total_steps - config.pretrain_steps) % (
      config.diloco.inner_steps) == 0
  params = model_lib.count_params(model_lib.param_shapes(config.model))
  if size == "gpu":
    assert 20e6 <= params <= 60e6
    assert config.diloco.islands == 8 and config.model.dtype == "bfloat16"
  elif size == "colab":
    assert params < 10e6 and config.diloco.islands == 4
