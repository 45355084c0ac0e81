"""Single-device model code. Config and presets import no torch; the modules are loaded on first use."""

from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.core.presets import PRESETS, get_preset

__all__ = ["ModelConfig", "MoEConfig", "PRESETS", "get_preset"]
