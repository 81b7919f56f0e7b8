"""diloco_jax: low-communication (DiLoCo-family) LM training in JAX/Flax."""

import setuptools

# What the extras add; `pip install -e .` alone runs `python -m
# diloco_jax.main` on the built-in corpora (embedded, synthetic,
# text_files, tokens with the byte tokenizer).
_C4 = [
    # SentencePiece tokenizers (config.data.tokenizer='sentencepiece',
    # python -m diloco_jax.data.train_tokenizer).
    "sentencepiece>=0.2",
    # C4 through TFDS data sources (array_record; no TensorFlow needed).
    "tensorflow-datasets>=4.9.10",
    "importlib_resources",
]
# Elastic islands (python -m diloco_jax.elastic): Ray runs them.
_ELASTIC = ["ray>=2.60"]
# experiments/ plots; the tests also run the colabs/ notebooks.
_EXPERIMENTS = ["matplotlib>=3.8"]

setuptools.setup(
    name="diloco_jax",
    version="0.1.0",
    description=("DiLoCo-family low-communication training of language "
                 "models across islands of accelerators, in JAX/Flax."),
    packages=setuptools.find_packages(include=["diloco_jax", "diloco_jax.*"]),
    python_requires=">=3.11",
    # Ranges the code is written against; requirements.txt pins the tested
    # set of these, requirements-dev.txt of these and every extra.
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "chex>=0.1.90",
        "numpy>=2.0",
        "tensorboardX>=2.6",
    ],
    extras_require={
        "c4": _C4,
        "elastic": _ELASTIC,
        "experiments": _EXPERIMENTS,
        # The whole test suite: every extra, the notebooks' kernel, pytest.
        "test": [*_C4, *_ELASTIC, *_EXPERIMENTS, "pytest>=8",
                 "pytest-xdist>=3.2", "nbclient>=0.10", "nbformat>=5.10",
                 "ipykernel>=6.29"],
    },
)
