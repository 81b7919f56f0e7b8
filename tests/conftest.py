"""Test setup: force several host CPU devices before JAX initializes.

Mesh tests need islands x data devices; XLA's CPU backend provides them when
the device count is set before the first backend use.
"""
import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
