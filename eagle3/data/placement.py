"""Where the HF engine puts a target's layers (`target.placement`): one device, or several in order.

A target past one GPU in bf16 (Llama-3.1-70B: 141 GB) is split by whole *units*: the modules
before the decoder layers (embeddings, rotary tables, a vision tower), each decoder layer, and
the ones after (final norm, lm_head). Units fill the first device up to its share of memory
(`memory_fraction` of a GPU's total, of the CPU's available RAM), then the next: a pipeline in
layer order, as transformers' device_map="sequential" places it, so a target that fits one GPU
stays on one. Each unit of a split target gets a forward pre-hook that moves its inputs to its
own device, so the hidden states hop devices between layers; captured states are gathered on the
output device by `eagle3.data.capture`.

The plan is made from the weights' sizes on the meta device, before any weight is read: a target
that cannot fit fails at once with what it needs and what each device offers. The weights are
then read into RAM and moved unit by unit (the host needs the target's size in free RAM while
loading: a GPU host that serves a 70B target has it).

Simulating a host with several GPUs on a CPU machine (tests, rehearsals):
`EAGLEOPS_SIMULATED_DEVICES=3x40MB` makes the inventory three CPU "devices" of 40 MB each when no
GPU is visible; the plan, the hooks and the gathering then run exactly as over three GPUs.

Risk: a unit on the wrong device fails loudly (a device mismatch); a tied lm_head moved apart from
the embeddings would silently untie them -- it is pinned to the embeddings' device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle3.config import PlacementConfig
from eagle3.data.structure import decoder_layers_path

SIMULATED_DEVICES_ENV = "EAGLEOPS_SIMULATED_DEVICES"
_SIZE = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)(KB|MB|GB)$")
_UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9}


class PlacementError(ValueError):
    """The target does not fit the devices it may use; the message names both sides."""


@dataclass(frozen=True)
class DeviceSlot:
    """One device the target may use: its name in the plan, the torch device, the bytes it may hold."""

    label: str
    device: str
    capacity: int


@dataclass(frozen=True)
class Unit:
    """A module moved as a whole: its dotted name, its weights' bytes, where it must go."""

    name: str
    nbytes: int
    position: str  # "head" (before the layers), "layer", "tail" (after them) or "tied" (with the embeddings)


# --------------------------------------------------------------------------- the devices


def device_inventory(placement: PlacementConfig) -> list[DeviceSlot]:
    """The devices placement may use, in order, each with the bytes the target's weights may take there."""
    simulated = os.environ.get(SIMULATED_DEVICES_ENV)
    if simulated and not torch.cuda.is_available():
        return _simulated_slots(simulated)
    names = placement.devices or (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"])
    return [DeviceSlot(name, name, int(_device_memory(name) * placement.memory_fraction)) for name in names]


def _simulated_slots(spec: str) -> list[DeviceSlot]:
    match = _SIZE.match(spec.strip())
    if not match:
        raise ValueError(f"{SIMULATED_DEVICES_ENV}={spec!r}: expected COUNTxSIZE, e.g. 3x40MB")
    count, size, unit = int(match[1]), float(match[2]), match[3]
    return [DeviceSlot(f"simulated:{i}", "cpu", int(size * _UNITS[unit])) for i in range(count)]


def _device_memory(name: str) -> int:
    """A GPU's memory as placement counts it (its total, but never more than is free now); the CPU's available RAM."""
    if name == "cpu":
        import psutil

        return psutil.virtual_memory().available
    if not torch.cuda.is_available() or int(name.split(":")[1]) >= torch.cuda.device_count():
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise PlacementError(f"target.placement.devices names {name}, but this machine has {visible} visible GPU(s)")
    free, total = torch.cuda.mem_get_info(torch.device(name))
    return min(total, free)


# --------------------------------------------------------------------------- the units and the plan


def placement_units(model: nn.Module, layers_path: str) -> list[Unit]:
    """The model's units in forward order; `layers_path` is the decoder layers' ModuleList (e.g. model.layers).

    Head: every module beside the path from the root to the layers (embeddings, rotary tables, a vision
    tower). Layers: one unit each. Tail: the layers' sibling `norm` (the final norm) and the root's other
    children (lm_head) -- except an lm_head tied to the embeddings, which stays with them.
    """
    parts = layers_path.split(".")
    head, tail, tied = [], [], []
    for depth in range(len(parts)):
        parent = _module(model, ".".join(parts[:depth]))
        prefix = ".".join(parts[:depth])
        for child_name, child in parent.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if child_name == parts[depth]:
                continue
            if depth == 0 and _is_tied_head(model, child):
                tied.append(Unit(name, 0, "tied"))
            elif (depth == 0) or (depth == len(parts) - 1 and child_name == "norm"):
                tail.append(Unit(name, _nbytes(child), "tail"))
            else:
                head.append(Unit(name, _nbytes(child), "head"))
        _refuse_loose_weights(parent, prefix)
    layers = _module(model, layers_path)
    return head + [Unit(f"{layers_path}.{i}", _nbytes(layer), "layer") for i, layer in enumerate(layers)] + tail + tied


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _is_tied_head(model: nn.Module, child: nn.Module) -> bool:
    """`child` is the output head whose weight is the input embedding's (tie_word_embeddings)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(child, "weight", None)
    return embeddings is not None and child is not embeddings and weight is embeddings.weight


def _refuse_loose_weights(module: nn.Module, name: str) -> None:
    """Weights held directly by a module on the path to the layers belong to no unit: placing them is a guess."""
    loose = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if loose:
        raise PlacementError(f"{name or type(module).__name__} holds weights outside its submodules ({loose}); "
                             "eagleops cannot place this architecture over several devices")


def plan_placement(units: list[Unit], slots: list[DeviceSlot], what: str = "the target") -> dict[str, int]:
    """Unit name -> index into `slots`: units in order, each device filled up to its capacity before the next.

    Head units start on the first device, tail units follow the last layer, a tied head goes with the first
    unit. Worked example: slots of 10 and 10 GB, units head 2, layers 4, 4, 4, tail 1 -> head, layer 0, layer 1
    on slot 0 (10 GB), layer 2 and the tail on slot 1 (5 GB). Raises PlacementError, naming the bytes needed
    and offered, when they cannot fit.
    """
    total = sum(u.nbytes for u in units)
    offered = sum(s.capacity for s in slots)
    if total > offered:
        raise PlacementError(f"{what} needs {_gb(total)} for its weights, but {_describe(slots)} offer {_gb(offered)}: "
                             "add devices (target.placement.devices), raise target.placement.memory_fraction or use "
                             "target.engine sglang")
    plan, slot, used = {}, 0, 0
    for unit in units:
        if unit.position == "tied":
            continue
        while used + unit.nbytes > slots[slot].capacity:
            slot, used = slot + 1, 0
            if slot == len(slots):
                raise PlacementError(f"{what} needs {_gb(total)} for its weights; {_describe(slots)} offer "
                                     f"{_gb(offered)} in all, but not in whole units: {unit.name} ({_gb(unit.nbytes)}) "
                                     "fits no device's remaining share; raise target.placement.memory_fraction or "
                                     "add devices")
        plan[unit.name], used = slot, used + unit.nbytes
    first = plan[units[0].name] if units and units[0].position != "tied" else 0
    plan.update({u.name: first for u in units if u.position == "tied"})
    return plan


def _gb(nbytes: int) -> str:
    """Bytes as people read them: GB for a real target, MB or KB for the small ones of a test."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= size / 10:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 1e3:.1f} KB"


def _describe(slots: list[DeviceSlot]) -> str:
    return ", ".join(f"{s.label} ({_gb(s.capacity)})" for s in slots)


# --------------------------------------------------------------------------- placing a loaded model


def place_model(model: nn.Module, units: list[Unit], plan: dict[str, int], slots: list[DeviceSlot]) -> dict[str, str]:
    """Move each unit to its device; with more than one slot in use, hook every unit to move its inputs there.

    Returns the device map {unit: slot label} (recorded in the shard manifest).
    """
    for unit in units:
        module = model.get_submodule(unit.name)
        if unit.position != "tied":  # a tied head's weight is the embeddings': it moved with them
            module.to(slots[plan[unit.name]].device)
    if len(set(plan.values())) > 1:
        for unit in units:
            device = torch.device(slots[plan[unit.name]].device)
            model.get_submodule(unit.name).register_forward_pre_hook(_inputs_to(device), with_kwargs=True)
    return {unit.name: slots[plan[unit.name]].label for unit in units}


def _inputs_to(device: torch.device):
    def hook(module, args, kwargs):
        return _moved(args, device), _moved(kwargs, device)

    return hook


def _moved(value, device: torch.device):
    """`value` with every tensor in it (through tuples, lists and dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def output_device(model: nn.Module, layers_path: str) -> torch.device:
    """Where a placed model's final hidden states land: the last decoder layer's device."""
    last = _module(model, layers_path)[-1]
    return next(last.parameters()).device


# --------------------------------------------------------------------------- the entry


def load_placed_model(target_dir: Path | str, dtype: torch.dtype, placement: PlacementConfig,
                      trust_remote_code: bool = False) -> tuple[nn.Module, dict[str, str]]:
    """An HF causal LM placed over `placement`'s devices (eval mode). -> (model, device map {unit: device})."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    layers_path = decoder_layers_path(skeleton)
    units = placement_units(skeleton, layers_path)
    slots = device_inventory(placement)
    plan = plan_placement(units, slots, what=f"target {Path(target_dir).name} in {str(dtype).removeprefix('torch.')}")
    _check_ram_for_loading(sum(u.nbytes for u in units), target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    device_map = place_model(model, units, plan, slots)
    return model.eval(), device_map


def _check_ram_for_loading(nbytes: int, target_dir: Path | str) -> None:
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > available:
        raise PlacementError(f"target {Path(target_dir).name}: its weights ({_gb(nbytes)}) are read into RAM before "
                             f"they are placed, and only {_gb(available)} is available")
