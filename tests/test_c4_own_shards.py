"""C4 as a newcomer meets it with shards of their own: shards none of which
is named '*validation*' are refused in one line, unless the run is told to
hold some out; the tokenizer's file says what it holds and a vocabulary
its text cannot fill is one line naming the largest it can; docs/c4.md's
commands for the `quick` size work as written.
"""

import gzip
import json
import os
import pathlib
import random
import re
import shlex
import subprocess
import sys

from absl import logging
import numpy as np
import pytest

from configs import c4_small
from diloco_jax.config import validation
from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import prepare_plan
from diloco_jax.data import settings as data_settings
from diloco_jax.data import sources
from diloco_jax.data import train_tokenizer
from diloco_jax.run import train
from tests import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du")


def _document(rng: random.Random) -> str:
  def word():
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
  return "\n".join(" ".join(word() for _ in range(rng.randint(4, 14))) + "."
                   for _ in range(rng.randint(2, 5)))


def _write_shards(directory: pathlib.Path, names, documents: int = 60,
                  seed: int = 0) -> pathlib.Path:
  """Shards of made-up words, each document tagged with its shard's name
  (<NAME>)."""
  rng = random.Random(seed)
  directory.mkdir(parents=True, exist_ok=True)
  for name in names:
    with gzip.open(directory / name, "wt", encoding="utf-8") as f:
      f.writelines(json.dumps({"text": f"<{name}> {_document(rng)}"}) + "\n"
                   for _ in range(documents))
  return directory


def _train_names(count: int) -> list[str]:
  return [f"c4-train.{index:05d}-of-01024.json.gz" for index in range(count)]


def _data_config(path, **overrides):
  return helpers.small_data_config(**{"corpus": "c4", "path": str(path),
                                      "sequence_length": 15, **overrides})


# 1. No '*validation*' shard: refused, unless asked to hold shards out.


def test_shards_without_a_validation_one_are_refused_in_one_line(tmp_path):
  data = _write_shards(tmp_path / "c4", _train_names(2))
  with pytest.raises(errors.DataError) as error:
    data_settings.validate_data_config(_data_config(data))
  assert str(error.value) == (
      f"config.data.path: none of the 2 C4 shard(s) at {str(data)!r} "
      "(c4-train.00000-of-01024.json.gz, c4-train.00001-of-01024.json.gz) "
      "is named '*validation*', so there is no eval split: add a validation "
      "shard there (C4's is c4-validation.00000-of-00008.json.gz, which "
      "python -m diloco_jax.data.c4_download fetches), or pass "
      "--config.data.hold_out_shards=true to evaluate on train shards held "
      "out by a hash of their names")
  # A run stops on it before anything is compiled or written.
  config = c4_small.get_config("quick")
  config.data.path = str(data)
  workdir = tmp_path / "run"
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.data\.path: none of the 2 C4 shard"):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()
  # So does a prepare, naming its own flags.
  with pytest.raises(errors.DataError,
                     match=r"^--path: none of the 2 C4 shard.* pass "
                     r"--hold_out_shards to"):
    prepare_plan.make_plan("c4", str(data), str(tmp_path / "tokens"))


def test_many_shards_are_listed_in_part(tmp_path):
  data = _write_shards(tmp_path / "c4", _train_names(5), documents=2)
  with pytest.raises(errors.DataError,
                     match=r"none of the 5 C4 shard\(s\) at .* \("
                     r"c4-train.00000-of-01024.json.gz, "
                     r"c4-train.00001-of-01024.json.gz, "
                     r"c4-train.00002-of-01024.json.gz, \.\.\.\) is named"):
    c4_files.split_shards(str(data), 0.05)


def test_held_out_shards_are_said_and_never_trained_on(tmp_path,
                                                       monkeypatch):
  data = _write_shards(tmp_path / "c4", _train_names(3))
  config = _data_config(data, hold_out_shards=True, sequence_length=128)
  said = []
  monkeypatch.setattr(logging, "info",
                      lambda message, *args: said.append(message % args))
  settings = data_settings.from_config(config)
  assert settings.hold_out_shards
  train_shards, held = c4_files.split_shards(str(data), 0.05, hold_out=True)
  assert len(held) == 1 and len(train_shards) == 2
  assert said == [
      "config.data.path: no shard is named '*validation*': 1 of the 3 "
      "shards held out for evaluation (config.data.hold_out_shards): "
      f"{held[0].name}"]
  # Two islands train on the other two; evaluation reads the held-out one.
  source = sources.make_batch_source(settings, num_islands=2, batch_size=2,
                                     seed=0)
  trained = bytes(np.concatenate([source.next_batch().ravel()
                                  for _ in range(40)]).astype(np.uint8))
  sources.close(source)
  evaluated = bytes(sources.make_eval_batches(
      settings, batch_size=2, num_batches=2).ravel().astype(np.uint8))
  for shard in train_shards:
    assert f"<{shard.name}>".encode() in trained
    assert f"<{shard.name}>".encode() not in evaluated
  assert f"<{held[0].name}>".encode() in evaluated
  assert f"<{held[0].name}>".encode() not in trained
  # A prepare holds out the same shard.
  plan = prepare_plan.make_plan("c4", str(data), str(tmp_path / "tokens"),
                                hold_out_shards=True)
  assert [task.source for task in plan.tasks if task.split == "validation"
          ] == [held[0].name]


def test_a_validation_shard_needs_no_flag(tmp_path):
  data = _write_shards(tmp_path / "c4", [
      *_train_names(2), "c4-validation.00000-of-00008.json.gz"])
  train_shards, held = c4_files.split_shards(str(data), 0.05)
  assert [path.name for path in held] == [
      "c4-validation.00000-of-00008.json.gz"]
  assert len(train_shards) == 2
  data_settings.validate_data_config(_data_config(data))


# 3. The tokenizer: named by what it holds; a vocabulary too large for the
# text is one line naming the largest.


def test_a_model_of_less_text_than_asked_is_named_by_what_it_holds(
    tmp_path):
  data = _write_shards(tmp_path / "c4", [
      *_train_names(2), "c4-validation.00000-of-00008.json.gz"])
  shards = c4_files.split_shards(str(data), 0.05)[0]
  held = train_tokenizer.sample_bytes(shards, 10) / 10**6
  assert 0 < held < 1
  path, trained = train_tokenizer.train(str(data), vocab_size=300,
                                        megabytes=10)
  assert trained
  assert path.name == f"spm_300_{train_tokenizer.megabytes_name(held)}mb.model"
  assert not (data / "spm_300_10mb.model").exists()
  # Asked again, the model is found by what the text holds.
  assert train_tokenizer.train(str(data), 300, 10) == (path, False)


def test_megabytes_in_a_name_never_claim_more_than_was_read():
  name = train_tokenizer.megabytes_name
  assert [name(10), name(1.83), name(1.8), name(0.0534), name(0.31),
          name(12.36), name(9.96)] == [
              "10", "1.8", "1.8", "0.053", "0.31", "12.3", "9.9"]


def test_a_vocabulary_the_text_cannot_fill_names_the_largest(tmp_path):
  data = _write_shards(tmp_path / "c4", [
      *_train_names(1), "c4-validation.00000-of-00008.json.gz"])
  result = subprocess.run(
      [sys.executable, "-m", "diloco_jax.data.train_tokenizer",
       f"--path={data}", "--vocab_size=8192", "--megabytes=10"],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 1
  line = result.stderr.strip()
  assert "\n" not in line and "Traceback" not in line
  most = re.fullmatch(
      r"error: --vocab_size=8192 is more pieces than all 0\.\d+ MB of text "
      r"of the train shards at '.*' \(less than --megabytes=10\) can fill: "
      r"at most (\d+); pass --vocab_size=(\d+) or less \(a config's "
      r"model\.vocab_size must be at least it\), or give it more text "
      r"\(more shards\)", line)
  assert most and most[1] == most[2], line
  assert not list(data.glob("*.model"))
  # The largest it names trains.
  path, trained = train_tokenizer.train(str(data), int(most[1]), 10)
  assert trained and path.exists()


def test_the_notebook_trains_the_vocabulary_its_config_takes():
  with open(REPO / "colabs" / "02_c4_repro.ipynb") as f:
    cells = ["".join(cell["source"]) for cell in json.load(f)["cells"]]
  source = next(cell for cell in cells if "train_tokenizer.train(" in cell)
  assert "VOCAB_SIZE = c4_small.VOCAB_SIZES[SIZE]" in source
  assert "train_tokenizer.train(str(data_dir), VOCAB_SIZE," in " ".join(
      source.split())
  # Whatever file the trainer names is what the runs use.
  assert "tokenizer_path=str(model_file)" in source


# 2. docs/c4.md's commands for the quick size, as written.


def _quick_commands() -> list[list[str]]:
  """The shell block of docs/c4.md that runs configs/c4_small.py:quick."""
  text = (REPO / "docs" / "c4.md").read_text()
  for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
    if "c4_small.py:quick" in block:
      return [shlex.split(line) for line in
              block.replace("\\\n", " ").splitlines() if line.strip()]
  raise AssertionError("docs/c4.md has no commands for the quick size")


def test_the_quick_size_s_commands_work_as_written(tmp_path):
  commands = _quick_commands()
  modules = [command[command.index("-m") + 1] for command in commands]
  assert modules == ["diloco_jax.data.c4_download",
                     "diloco_jax.data.train_tokenizer", "diloco_jax.main"]
  download, tokenizer, run = commands
  # The vocabulary is the one the quick size's model takes.
  assert f"--vocab_size={c4_small.VOCAB_SIZES['quick']}" in tokenizer
  # The download's shards stand in for C4: two train shards (one per
  # island of the quick size) and a validation one, with over 1 MB of
  # text, at the directory the commands name.
  assert "--train_shards=2" in download
  assert c4_small.get_config("quick").diloco.islands == 2
  home = tmp_path / "home"
  _write_shards(home / "c4", [*_train_names(2),
                              "c4-validation.00000-of-00008.json.gz"],
                documents=3200)

  def here(words):
    return [word.replace("$HOME", str(home)) for word in words]

  tokenizer = here(tokenizer)
  result = subprocess.run(
      [sys.executable, *tokenizer[tokenizer.index("-m"):]], cwd=REPO,
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  run = here(run)
  flags = dict(word.split("=", 1) for word in run if word.startswith("--"))
  # The model is where the run's command looks for it.
  assert result.stdout.splitlines()[-1] == (
      "--config.data.tokenizer_path="
      + flags["--config.data.tokenizer_path"])
  config = c4_small.get_config("quick")
  config.data.path = flags["--config.data.path"]
  config.data.tokenizer_path = flags["--config.data.tokenizer_path"]
  run_config = validation.validate_config(config, num_devices=2)
  assert run_config.data.vocab_size == c4_small.VOCAB_SIZES["quick"]
  assert os.path.isfile(config.data.tokenizer_path)
