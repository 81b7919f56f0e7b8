"""The `[Gloo] Rank ...` lines of a run of several CPU processes: the gloo
inside jaxlib prints them to stdout with no switch to turn them off, so
docs/running.md says what they are. If a jaxlib drops the line or makes it
switchable (newer gloo logs it only under GLOO_LOG_LEVEL=INFO), this
fails: silence it, and say so in the page.
"""

import mmap
import pathlib

import jaxlib
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# What gloo's printConnectivityInfo writes with std::cout (the rank and
# counts between the parts).
PARTS = (b"[Gloo] Rank ", b" is connected to ", b" peer ranks. ",
         b"Expected number of connected peer ranks is : ")


def _jaxlib_library() -> pathlib.Path | None:
  """The jaxlib shared library that holds gloo's line, or None."""
  for path in sorted(pathlib.Path(jaxlib.__file__).parent.glob("*.so")):
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                          access=mmap.ACCESS_READ) as data:
      if data.find(PARTS[-1]) >= 0:
        return path
  return None


def test_the_running_page_explains_the_gloo_lines():
  library = _jaxlib_library()
  if library is None:
    pytest.fail("this jaxlib no longer prints gloo's connection line: drop "
                "its paragraph from docs/running.md")
  with open(library, "rb") as f, mmap.mmap(f.fileno(), 0,
                                           access=mmap.ACCESS_READ) as data:
    assert all(data.find(part) >= 0 for part in PARTS)
    # No log level gates it in this gloo.
    assert data.find(b"GLOO_LOG_LEVEL") < 0
  page = " ".join((REPO / "docs" / "running.md").read_text().split())
  assert ("`[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
          "connected peer ranks is : 1`") in page
  assert "no flag, environment variable or JAX setting turns it off" in page
