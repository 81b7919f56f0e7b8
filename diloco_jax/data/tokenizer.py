"""Tokenizers: bytes (the default) and SentencePiece models, plus EOS ids.

`build_tokenizer(config.data)` is the one constructor the pipeline uses:
config.data.tokenizer = "byte" (default) | "sentencepiece", the latter with
config.data.tokenizer_path naming a `.model` file (the T5 C4 vocabulary, or
one train_tokenizer.py trains on the corpus).
Token ids are uint16 in the streamed and in-memory pipeline, so their
vocabularies must fit it; pre-tokenized shards (data/prepare.py) hold larger
vocabularies as uint32 (`token_dtype`).
"""
import numpy as np

from diloco_jax.data import errors

TOKENIZERS = ("byte", "sentencepiece")
_MAX_VOCAB_SIZE = int(np.iinfo(np.uint16).max) + 1
# Batches are int32, so even uint32 token ids must stay below 2**31.
MAX_WIDE_VOCAB_SIZE = 2**31


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest id type of a vocabulary: uint16 when it fits, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= _MAX_VOCAB_SIZE else np.uint32)


class ByteTokenizer:
  """Maps bytes 0..255 to ids 0..255 and reserves id 256 for EOS.

  Byte-level tokens need no vocabulary file and round-trip any input exactly,
  which keeps the default corpus self-contained.
  """

  eos_id: int = 256
  vocab_size: int = 257
  name: str = "byte"
  dtype: np.dtype = np.dtype(np.uint16)

  def encode(self, text: bytes | str) -> np.ndarray:
    """Returns the token ids (uint16) of `text`; str is encoded as UTF-8."""
    if isinstance(text, str):
      text = text.encode("utf-8")
    return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)

  def decode(self, ids) -> bytes:
    """Returns the bytes of `ids`, dropping EOS and any id outside 0..255."""
    ids = np.asarray(ids).ravel()
    is_byte = (ids >= 0) & (ids < 256)
    return ids[is_byte].astype(np.uint8).tobytes()


def import_sentencepiece():
  """The sentencepiece module, imported here: only SentencePiece tokenizers
  need it, and the run set (requirements.txt) leaves it out. DataError in
  one line naming the extra to install when it is missing."""
  try:
    import sentencepiece  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.missing_package("a SentencePiece tokenizer",
                                 "sentencepiece") from None
  return sentencepiece


class SentencePieceTokenizer:
  """A SentencePiece model read from a `.model` file.

  The vocabulary size and EOS id come from the model. A model trained without
  an EOS piece (eos_id = -1) gets one extra id after its pieces, so documents
  can still be separated; vocab_size then counts it. Ids are uint16 (the
  default `max_vocab_size` refuses larger models), or uint32 for a larger
  vocabulary where the caller allows one (pre-tokenized shards).
  """

  def __init__(self, model_path: str, max_vocab_size: int = _MAX_VOCAB_SIZE):
    sentencepiece = import_sentencepiece()
    model_proto = _read_model_proto(model_path)
    try:
      self._processor = sentencepiece.SentencePieceProcessor(
          model_proto=model_proto)
    except RuntimeError as error:  # what sentencepiece raises for a bad model
      raise _model_error(model_path, _first_line(error)) from error
    pieces = self._processor.get_piece_size()
    if pieces < 1:
      # Never reached after _read_model_proto's checks, but an uninitialized
      # processor crashes the process in eos_id() rather than raising.
      raise _model_error(model_path, "the model holds no pieces")
    model_eos = self._processor.eos_id()
    self.eos_id = model_eos if model_eos >= 0 else pieces
    self.vocab_size = pieces if model_eos >= 0 else pieces + 1
    self.name = f"sentencepiece ({model_path})"
    if self.vocab_size > max_vocab_size:
      raise _model_error(
          model_path, f"vocabulary of {self.vocab_size} ids does not fit "
          f"{token_dtype(max_vocab_size).name} token ids" + (
              "; pre-tokenize the corpus (python -m diloco_jax.data.prepare) "
              "into uint32 shards" if max_vocab_size == _MAX_VOCAB_SIZE
              else ""))
    self.dtype = token_dtype(self.vocab_size)

  def encode(self, text: bytes | str) -> np.ndarray:
    """Returns the piece ids (`dtype`) of `text`, without BOS or EOS.

    Bytes are decoded as UTF-8; invalid sequences become U+FFFD rather than
    failing a run on one bad document.
    """
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return np.asarray(self._processor.encode(text), dtype=self.dtype)

  def decode(self, ids) -> bytes:
    """Returns the UTF-8 text of `ids`, dropping EOS and out-of-range ids."""
    ids = np.asarray(ids).ravel()
    pieces = self._processor.get_piece_size()
    keep = (ids >= 0) & (ids < pieces) & (ids != self.eos_id)
    return self._processor.decode(ids[keep].tolist()).encode("utf-8")


Tokenizer = ByteTokenizer | SentencePieceTokenizer


def tokenizer_name(data_config) -> str:
  """config.data.tokenizer, "byte" when the field is absent."""
  return getattr(data_config, "tokenizer", "byte") or "byte"


def build_tokenizer(data_config, max_vocab_size: int = _MAX_VOCAB_SIZE
                    ) -> Tokenizer:
  """The tokenizer config.data names; DataError naming the field if bad.

  A SentencePiece model file is read and checked here, so a bad one fails
  when the pipeline is built, before anything is compiled. A model of more
  than `max_vocab_size` ids is refused (the default: those that fit uint16;
  MAX_WIDE_VOCAB_SIZE for pre-tokenized uint32 shards).
  """
  name = tokenizer_name(data_config)
  if name not in TOKENIZERS:
    raise errors.DataError(f"config.data.tokenizer={name!r} is not one of "
                           f"{', '.join(repr(known) for known in TOKENIZERS)}")
  if name == "byte":
    return ByteTokenizer()
  path = getattr(data_config, "tokenizer_path", "") or ""
  if not path:
    raise errors.DataError(
        "config.data.tokenizer_path is required for "
        "config.data.tokenizer='sentencepiece' (a .model file: train one "
        "on your shards with python -m diloco_jax.data.train_tokenizer "
        "--path=SHARDS, see docs/c4.md)")
  try:
    return SentencePieceTokenizer(path, max_vocab_size)
  except ImportError as error:
    raise errors.DataError(
        "config.data.tokenizer='sentencepiece' needs the sentencepiece "
        "package (pip install sentencepiece)") from error


def _model_error(path: str, problem: str) -> errors.DataError:
  return errors.DataError(f"config.data.tokenizer_path: cannot load "
                          f"SentencePiece model {path!r}: {problem}")


def _first_line(error: Exception) -> str:
  return str(error).strip().splitlines()[0] if str(error).strip() else (
      type(error).__name__)


def _read_model_proto(path: str) -> bytes:
  """The bytes of a SentencePiece model file, checked before sentencepiece.

  sentencepiece accepts an empty model (0 bytes) without an error and then
  crashes the process with a segmentation fault on first use, so the file is
  checked here: readable, non-empty, and a ModelProto with at least one piece.
  """
  try:
    with open(path, "rb") as f:
      model_proto = f.read()
  except OSError as error:
    raise _model_error(path, error.strerror or _first_line(error)) from error
  if not model_proto:
    raise _model_error(path, "the file is empty (0 bytes); expected a "
                             "SentencePiece .model file")
  problem = _model_proto_problem(model_proto)
  if problem:
    raise _model_error(path, problem)
  return model_proto


def _model_proto_problem(model_proto: bytes) -> str | None:
  """Why the bytes are no usable ModelProto, or None (also when unknown)."""
  try:
    # pylint: disable=g-import-not-at-top
    # Ships with sentencepiece but needs protobuf; without it sentencepiece's
    # own parse still refuses garbage, and the empty file is refused above.
    from google.protobuf import message
    from sentencepiece import sentencepiece_model_pb2
  except ImportError:
    return None
  try:
    model = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
  except message.DecodeError:
    # protobuf's own message ("Wire format was corrupt") adds nothing.
    return ("not a SentencePiece model: its protobuf does not parse "
            "(a truncated file, or another kind of file?)")
  if not model.pieces:
    return "not a SentencePiece model (it holds no pieces)"
  return None
