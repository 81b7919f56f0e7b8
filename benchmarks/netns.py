"""The namespaces the benchmarks run their processes in: the package's
(diloco_jax/elastic/netns.py), which elastic runs behind shaped links use
too."""

from diloco_jax.elastic.netns import LoopbackNamespace, Network  # pylint: disable=unused-import
