"""The model: the Llama/Qwen2-family decoder, its weights in and out of transformers' format, real models
imported without a hub, the one-layer EAGLE drafter, sampling with an explicit generator, the RL training forward's
log-probabilities, CUDA graphs, and ``load`` (policy, tokenizer and drafter from local folders)."""
from .decoder import ModelConfig, Transformer, preset
from .drafter import Drafter, DrafterConfig, load_drafter, save_drafter
from .loading import load
from .sampling import SamplingConfig
from .weights import load_model, pick_device, save_model

__all__ = ["Drafter", "DrafterConfig", "ModelConfig", "SamplingConfig", "Transformer", "load", "load_drafter",
           "load_model", "pick_device", "preset", "save_drafter", "save_model"]
