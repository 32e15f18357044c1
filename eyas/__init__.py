"""eyas: EAGLE-style tree speculative decoding for Llama-family models."""
from eyas.engine.llm import LLM, CompletionOutput
from eyas.sampling_params import GuidedDecoding, SamplingParams

__all__ = ["LLM", "SamplingParams", "GuidedDecoding", "CompletionOutput"]
__version__ = "0.1.0"
