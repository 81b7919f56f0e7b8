"""The XLA settings every test process runs under, in one place: the
suite's conftest.py applies them, and benchmarks/outer_numerics.py runs
its cells under the same (its fixture's numbers are the ones the tests
see). Importing this module starts nothing.

The tests' models are tiny: compiling is most of their time and running
is little of it, so XLA's CPU backend compiles for speed (the training
subprocesses inherit it): no LLVM optimizations, and the older loop
emitters for fusions (the two together compile a tiny run's programs
~2.4x faster, measured). Numbers change only by rounding: tests that
compare two different programs allow a few ulps, saying why. A flag this
XLA does not know would abort every process, so they are tried once in a
subprocess first.
"""
import os
import subprocess
import sys

NUM_CPU_DEVICES = 8
FAST_COMPILE = ("--xla_backend_optimization_level=0 "
                "--xla_cpu_use_fusion_emitters=false")


def xla_accepts(flags: str) -> bool:
  """Whether this XLA knows the flags (an unknown one aborts a process)."""
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  probe = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
  return subprocess.run([sys.executable, "-c", probe], env=env,
                        capture_output=True, check=False).returncode == 0
