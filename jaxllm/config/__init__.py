"""What a run is configured by: the model's architecture (`model`) and the runtime's choices
(`runtime`: backend, kernels, scan, caches), each a frozen object built once at the edge."""

from jaxllm.config.model import GLOBAL, KIND_NAMES, SLIDING, AttnSpec, ModelConfig, RopeSpec

__all__ = ["GLOBAL", "KIND_NAMES", "SLIDING", "AttnSpec", "ModelConfig", "RopeSpec"]
