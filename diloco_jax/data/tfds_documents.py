"""A TFDS text dataset (e.g. "c4/en") as the document collection of a stream.

config.data.tfds_name names the dataset and config.data.path is its TFDS
data_dir. Reading goes through `tfds.data_source`, which needs no TensorFlow:
it reads datasets prepared in the array_record format by random access, so a
split of N records is cut into contiguous "virtual shards" of at most
RECORDS_PER_SHARD records, and a document's offset is its record index inside
its shard. Islands then own shards exactly as they own C4 JSON shards.

A data_dir prepared in the tfrecord format (TFDS's older default) is read
with `builder.as_dataset` over the same virtual shards, as split slices
"train[a:b]"; that path needs TensorFlow installed (`tfds.load` does too).

Google Cloud Storage: config.data.path may be a gs:// data_dir (TFDS resolves
it through etils.epath, which needs gcsfs or TensorFlow for gs://). TFDS's
public bucket is gs://tfds-data (`tfds.load(name, try_gcs=True)` looks for
datasets there; their files live under gs://tfds-data/datasets); a prepared
C4 usually lives in the user's own bucket, read as
`tfds.load("c4/en", data_dir="gs://BUCKET/tensorflow_datasets",
split="train")` or `tfds.data_source(...)` with the same arguments. For
array_record files on GCS, mounting the bucket with gcsfuse and giving the
mount point as the data_dir is the dependable route.
"""
from collections.abc import Iterator
import importlib.util

from diloco_jax.data import errors

RECORDS_PER_SHARD = 8192
TEXT_FEATURE = "text"


def tfds_available() -> bool:
  """Whether tensorflow_datasets can be imported (without importing it)."""
  return importlib.util.find_spec("tensorflow_datasets") is not None


def _text(record) -> str:
  text = record[TEXT_FEATURE]
  if isinstance(text, bytes):
    return text.decode("utf-8", errors="replace")
  return str(text)


def _shard_bounds(num_records: int, num_shards: int, shard: int
                  ) -> tuple[int, int]:
  return (shard * num_records // num_shards,
          (shard + 1) * num_records // num_shards)


class TfdsRecords:
  """One split of a TFDS dataset, cut into contiguous virtual shards.

  There are ceil(N / RECORDS_PER_SHARD) shards, but at least `min_shards`
  (when N allows) so that every island owns one.
  """

  def __init__(self, name: str, data_dir: str, split: str,
               min_shards: int = 1):
    # Imported here: runs on other corpora need no TFDS installed.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    self._name = name
    self._split = split
    self._builder = None
    try:
      self._records = tfds.data_source(name, split=split,
                                       data_dir=data_dir or None,
                                       download=False)
    except Exception as error:  # pylint: disable=broad-except
      # TFDS raises many types (not found, not prepared, wrong format); only
      # the tfrecord case has a fallback, and every other one a clear message.
      builder = _tfrecord_builder(tfds, name, data_dir)
      if builder is None:
        first_line = str(error).strip().splitlines()[0] if str(error) else ""
        raise errors.DataError(
            f"config.data.tfds_name={name!r}: cannot read split {split!r} "
            f"from data_dir config.data.path={data_dir!r}: "
            f"{type(error).__name__}: {first_line}") from error
      self._builder = builder
      self._records = None
      self._num_records = builder.info.splits[split].num_examples
    else:
      self._num_records = len(self._records)
    per_size = -(-self._num_records // RECORDS_PER_SHARD)
    self._num_shards = min(self._num_records, max(per_size, min_shards))

  @property
  def num_shards(self) -> int:
    return self._num_shards

  @property
  def num_records(self) -> int:
    return self._num_records

  def read(self, shard: int, start: int = 0) -> Iterator[tuple[int, str]]:
    """(offset, text) of the shard's records from offset `start`.

    Empty texts are skipped but keep their offsets.
    """
    begin, end = _shard_bounds(self._num_records, self._num_shards, shard)
    if self._builder is not None:
      yield from self._read_tfrecord(begin + start, end, begin)
      return
    # One record at a time: tokenizing costs far more than a random read.
    for index in range(begin + start, end):
      text = _text(self._records[index])
      if text:
        yield index - begin, text

  def _read_tfrecord(self, first: int, end: int, begin: int
                     ) -> Iterator[tuple[int, str]]:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    # A split slice read in file order (no shuffling) is deterministic.
    dataset = self._builder.as_dataset(split=f"{self._split}[{first}:{end}]",
                                       shuffle_files=False)
    for index, record in enumerate(tfds.as_numpy(dataset), start=first):
      text = _text(record)
      if text:
        yield index - begin, text


def _tfrecord_builder(tfds, name: str, data_dir: str):
  """The builder when the data is prepared as tfrecord and TF is present."""
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
    file_format = builder.info.file_format
  except Exception:  # pylint: disable=broad-except
    return None
  if getattr(file_format, "value", file_format) != "tfrecord":
    return None
  if importlib.util.find_spec("tensorflow") is None:
    raise errors.DataError(
        f"config.data.tfds_name={name!r}: the data in config.data.path="
        f"{data_dir!r} is stored as tfrecord, which needs TensorFlow "
        f"(pip install tensorflow); array_record data needs none")
  return builder
