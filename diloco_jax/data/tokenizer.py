"""Byte-level tokenizer: every byte is a token, plus one end-of-sequence id."""
import numpy as np


class ByteTokenizer:
  """Maps bytes 0..255 to ids 0..255 and reserves id 256 for EOS.

  Byte-level tokens need no vocabulary file and round-trip any input exactly,
  which keeps the default corpus self-contained.
  """

  eos_id: int = 256
  vocab_size: int = 257

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
