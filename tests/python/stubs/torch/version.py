"""torch.version of the metadata-only torch: a CPU build of the version vLLM 0.33.0 pins."""

__version__ = "2.14.0"
cuda = None
hip = None
xpu = None
git_version = "kvtier-metadata-stub"
