"""Flax NNX models: the Qwen target families and the DFlash drafter.

`target_family(config)` is the one place that maps a parsed target config to its module (the contract
every family meets is in `models/contract.py`); engine, checkpoint loading and the benchmark use it.
"""

from __future__ import annotations

from types import ModuleType

from ddtree_jax.models import qwen3, qwen3_5

TARGET_FAMILIES: dict[str, ModuleType] = {"qwen3": qwen3, "qwen3_5": qwen3_5}  # by the config's model_type


def target_family(config) -> ModuleType:
    """The module of a parsed target config (`Qwen3Config.model_type` "qwen3", `Qwen3_5Config` "qwen3_5")."""
    try:
        return TARGET_FAMILIES[config.model_type]
    except (AttributeError, KeyError):
        raise ValueError(f"not a target config: {type(config).__name__}") from None


def is_recurrent(config) -> bool:
    """Whether the target keeps recurrent states beside its K/V (a Qwen3.5/3.6 hybrid)."""
    return target_family(config).RECURRENT
