"""Test setup: force several host CPU devices before JAX initializes.

Mesh tests need islands x data devices; XLA's CPU backend provides them when
the device count is set before the first backend use.

Many tests train the same tiny configs, compiling identical programs again;
a persistent compilation cache for the session (inherited by the training
subprocesses some tests start) compiles each once. Results do not change:
a cached executable is the one XLA would build.
"""
import os
import tempfile

import jax

# pytest-xdist's test processes share one cache: each program compiles
# once per run, whichever process meets it first.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN_ID:
  _CACHE_DIR = os.path.join(tempfile.gettempdir(),
                            f"diloco_jax_test_jit_cache_{_RUN_ID}")
  os.makedirs(_CACHE_DIR, exist_ok=True)
else:
  _CACHE_DIR = tempfile.mkdtemp(prefix="diloco_jax_test_jit_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
