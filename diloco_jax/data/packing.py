"""Packing documents into fixed-length training sequences."""
from collections.abc import Iterable

import numpy as np


def pack_documents(documents: Iterable[np.ndarray], eos_id: int,
                   sequence_length: int) -> np.ndarray:
  """Packs documents into [num_sequences, sequence_length + 1] uint16 rows.

  The documents are concatenated, each followed by `eos_id`, and cut into
  non-overlapping chunks of sequence_length + 1 tokens: a chunk gives the
  inputs chunk[:-1] and the next-token targets chunk[1:]. The incomplete tail
  is dropped. Sequences cross document boundaries; the EOS separator tells the
  model where one document ends.
  """
  if sequence_length < 1:
    raise ValueError(f"sequence_length must be positive, got {sequence_length}")
  if not 0 <= eos_id <= np.iinfo(np.uint16).max:
    raise ValueError(f"eos_id {eos_id} does not fit uint16")
  documents = [np.asarray(document).ravel() for document in documents]
  chunk_length = sequence_length + 1
  if not documents:
    return np.empty((0, chunk_length), dtype=np.uint16)
  # Interleave the separators and concatenate once: one pass over the tokens
  # however many documents there are.
  separator = np.array([eos_id], dtype=np.uint16)
  pieces = []
  for document in documents:
    pieces.append(document)
    pieces.append(separator)
  tokens = np.concatenate(pieces).astype(np.uint16, copy=False)
  num_sequences = tokens.size // chunk_length
  return tokens[:num_sequences * chunk_length].reshape(num_sequences,
                                                       chunk_length)
