"""Test setup: force several host CPU devices before JAX initializes.

Mesh tests need islands x data devices; XLA's CPU backend provides them when
the device count is set before the first backend use.

Many tests train the same tiny configs, compiling identical programs again;
a persistent compilation cache for the session (inherited by the training
subprocesses some tests start) compiles each once. Results do not change:
a cached executable is the one XLA would build.
"""
import os
import shutil
import tempfile

import jax

from tests import xla_settings

# One folder per test run, made by the first process (pytest's own, which
# starts pytest-xdist's test processes with its environment) and removed by
# it at the end: the test processes share what is in it (the compilation
# cache below, runs several tests read) and nothing is left in the temp dir.
_OWNS_SHARED = "DILOCO_JAX_TEST_SHARED" not in os.environ
if _OWNS_SHARED:
  os.environ["DILOCO_JAX_TEST_SHARED"] = tempfile.mkdtemp(
      prefix="diloco_jax_tests_")
SHARED_DIR = os.environ["DILOCO_JAX_TEST_SHARED"]
# Each program compiles once per run, whichever process meets it first.
_CACHE_DIR = os.path.join(SHARED_DIR, "jit_cache")
os.makedirs(_CACHE_DIR, exist_ok=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# XLA compiles for speed (xla_settings.py says why).
if "DILOCO_JAX_TEST_XLA_FLAGS" not in os.environ:  # once per test run
  os.environ["DILOCO_JAX_TEST_XLA_FLAGS"] = (
      xla_settings.FAST_COMPILE
      if xla_settings.xla_accepts(xla_settings.FAST_COMPILE) else "")
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    os.environ["DILOCO_JAX_TEST_XLA_FLAGS"]]).strip()

jax.config.update("jax_num_cpu_devices", xla_settings.NUM_CPU_DEVICES)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config):
  """The process that made the shared folder removes it."""
  del config
  if _OWNS_SHARED:
    shutil.rmtree(SHARED_DIR, ignore_errors=True)
