"""Where a transformers causal LM keeps what capture and placement need: its architecture name, its
decoder layer count and the ModuleList that holds the layers (`model.layers` for Llama,
`model.language_model.layers` for a vision-language model's text model).
"""

from __future__ import annotations

from torch import nn


def architecture_of(model: nn.Module) -> str:
    """`config.architectures[0]`, or the class name for a model built in code."""
    archs = getattr(model.config, "architectures", None)
    return archs[0] if archs else type(model).__name__


def num_layers_of(model: nn.Module) -> int:
    """Decoder layer count of the (text) model."""
    return model.config.get_text_config().num_hidden_layers


def decoder_layers_path(model: nn.Module) -> str:
    """Dotted name of the decoder layers' ModuleList (`model.layers` for Llama; the first `*layers` of length L)."""
    count = num_layers_of(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith("layers") and len(module) == count:
            return name
    raise ValueError(f"{type(model).__name__}: no ModuleList '*layers' with {count} decoder layers found")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers (see decoder_layers_path)."""
    return model.get_submodule(decoder_layers_path(model))
