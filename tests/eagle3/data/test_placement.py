"""The HF engine's placement of a target over several devices (eagle3.data.placement).

On CPU a host with several GPUs is simulated (EAGLEOPS_SIMULATED_DEVICES=3xSIZE: three CPU "devices"
of that size): the plan, the per-unit hooks and the gathering of the captured states run as over three
GPUs, and the outputs must equal the one-device run exactly. On CUDA the same path crosses real devices
(cuda:0 and the CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.config import PlacementConfig, TargetConfig
from eagle3.data.capture import TargetFeatureExtractor
from eagle3.data.placement import (
    SIMULATED_DEVICES_ENV,
    DeviceSlot,
    PlacementError,
    Unit,
    device_inventory,
    load_placed_model,
    place_model,
    placement_units,
    plan_placement,
)
from eagle3.data.structure import decoder_layers_path
from eagle3.data.target import load_engine_target, load_target

ROWS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 1]]


def test_units_fill_each_device_in_order_then_the_next():
    units = [Unit("embed", 2, "head"), Unit("layers.0", 4, "layer"), Unit("layers.1", 4, "layer"),
             Unit("layers.2", 4, "layer"), Unit("norm", 1, "tail"), Unit("lm_head", 0, "tied")]
    slots = [DeviceSlot("cuda:0", "cuda:0", 10), DeviceSlot("cuda:1", "cuda:1", 10)]
    plan = plan_placement(units, slots)
    # embed + layer 0 + layer 1 = 10 on the first; layer 2 + norm on the second; the tied head with the embeddings
    assert plan == {"embed": 0, "layers.0": 0, "layers.1": 0, "layers.2": 1, "norm": 1, "lm_head": 0}
    assert set(plan_placement(units, [DeviceSlot("cuda:0", "cuda:0", 100)]).values()) == {0}  # fits one: stays on one


def test_a_target_that_cannot_fit_names_what_it_needs_and_what_the_devices_offer():
    units = [Unit("embed", 2_000_000_000, "head"), *(Unit(f"layers.{i}", 3_000_000_000, "layer") for i in range(4))]
    slots = [DeviceSlot("cuda:0", "cuda:0", 5_000_000_000), DeviceSlot("cuda:1", "cuda:1", 5_000_000_000)]
    with pytest.raises(PlacementError, match=r"target x needs 14.00 GB for its weights, but cuda:0 \(5.00 GB\), "
                                             r"cuda:1 \(5.00 GB\) offer 10.00 GB"):
        plan_placement(units, slots, what="target x")
    roomy = [DeviceSlot("cuda:0", "cuda:0", 7_000_000_000), DeviceSlot("cuda:1", "cuda:1", 7_000_000_000)]
    with pytest.raises(PlacementError, match=r"not in whole units: layers.3 \(3.00 GB\) fits no device"):
        plan_placement(units, roomy)  # 14 GB offered in all, but 2+3 | 3+3 | 3 needs a third device


def test_the_tiny_llamas_units_and_a_tied_head(tiny_target_dir):
    model, _ = load_target(tiny_target_dir)
    units = placement_units(model, decoder_layers_path(model))
    assert [(u.name, u.position) for u in units] == [
        ("model.embed_tokens", "head"), ("model.rotary_emb", "head"),
        *((f"model.layers.{i}", "layer") for i in range(7)), ("model.norm", "tail"), ("lm_head", "tied")]
    assert sum(u.nbytes for u in units) == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())


def three_devices(model) -> str:
    """EAGLEOPS_SIMULATED_DEVICES for three devices with room for the embeddings and two layers each: the
    7 layers of the tiny target then need all three."""
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    return f"3x{(embed_bytes + 2.5 * layer_bytes) / 1e3:.1f}KB"


def test_simulated_devices_split_the_target_and_capture_equals_one_device(tiny_target_dir, monkeypatch):
    one, _ = load_target(tiny_target_dir)
    monkeypatch.setenv(SIMULATED_DEVICES_ENV, three_devices(one))
    placed, device_map = load_engine_target(tiny_target_dir, TargetConfig(dtype="float32"))
    assert sorted(set(device_map.values())) == ["simulated:0", "simulated:1", "simulated:2"]
    by_layer = [device_map[f"model.layers.{i}"] for i in range(7)]
    assert by_layer == sorted(by_layer)  # in layer order: a device holds a run of consecutive layers
    assert device_map["model.embed_tokens"] == "simulated:0" and device_map["model.norm"] == by_layer[-1]
    hooked = [name for name, m in placed.named_modules() if m._forward_pre_hooks]
    assert set(hooked) == set(device_map)  # every unit moves its inputs to its device

    reference = TargetFeatureExtractor.from_model(one)
    split = TargetFeatureExtractor.from_model(placed, device_map=device_map)
    for want, got in zip(reference.capture_rows(ROWS), split.capture_rows(ROWS), strict=True):
        assert torch.equal(want, got)
    assert split.engine_record()["device_map"] == device_map


def test_local_regeneration_through_the_placement_generates_what_one_device_does(tiny_target_dir, monkeypatch):
    """HF generate with a KV cache over three simulated devices (data.regenerate.backend local)."""
    one, _ = load_target(tiny_target_dir)
    monkeypatch.setenv(SIMULATED_DEVICES_ENV, three_devices(one))
    placed, device_map = load_engine_target(tiny_target_dir, TargetConfig(dtype="float32"))
    assert len(set(device_map.values())) == 3
    prompt = torch.tensor([ROWS[0]])
    want = one.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(placed.generate(prompt, max_new_tokens=12, do_sample=False), want)


def test_a_target_larger_than_the_simulated_devices_is_refused_before_loading(tiny_target_dir, monkeypatch):
    monkeypatch.setenv(SIMULATED_DEVICES_ENV, "2x10KB")
    with pytest.raises(PlacementError, match=r"needs 0\.\d+ MB for its weights, but simulated:0 \(10.0 KB\), "
                                             r"simulated:1 \(10.0 KB\) offer 20.0 KB"):
        load_engine_target(tiny_target_dir, TargetConfig())


def test_training_with_online_features_through_the_placement_equals_one_device(tiny_target_dir, tmp_path, monkeypatch):
    """Online mode's features from a target split over three simulated devices train exactly like one device."""
    from eagle3.config import DataConfig, RegenerateConfig, TrainConfig
    from eagle3.data.generate import generate_dataset
    from eagle3.training.train import train_draft

    data = tmp_path / "data"
    cfg = DataConfig(num_samples=12, max_length=256, validation_fraction=0.25, draft_vocab_size=64,
                     hidden_states="online", regenerate=RegenerateConfig(max_new_tokens=16, batch_size=4))
    summary = generate_dataset(tiny_target_dir, TargetConfig(), cfg, data, log=lambda m: None)
    aux = summary["aux_layer_ids"]
    train = TrainConfig(ttt_steps=3, batch_size=3, max_steps=3, epochs=50, lr=3e-3, log_every=1, eval_every=3,
                        checkpoint_every=3, num_workers=0)
    one, _ = load_target(tiny_target_dir)
    monkeypatch.setenv(SIMULATED_DEVICES_ENV, three_devices(one))
    placed, device_map = load_engine_target(tiny_target_dir, TargetConfig(dtype="float32"))
    assert len(set(device_map.values())) == 3
    runs = {}
    for name, features in (("one", TargetFeatureExtractor.from_model(one, aux)),
                           ("placed", TargetFeatureExtractor.from_model(placed, aux, device_map))):
        rows = []
        train_draft(data, tiny_target_dir, train, tmp_path / name, aux_layer_ids=aux, draft_vocab_size=64,
                    online_features=features, on_metrics=lambda s, m: rows.append(m), log=lambda m: None)
        runs[name] = [m.get("train/loss", m.get("val/loss")) for m in rows]
    assert runs["placed"] == runs["one"] and len(runs["one"]) == 4


def test_inventory_lists_the_cpu_without_gpus_and_refuses_a_gpu_that_is_not_there(monkeypatch):
    monkeypatch.delenv(SIMULATED_DEVICES_ENV, raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: covered by the CUDA test")
    [slot] = device_inventory(PlacementConfig(memory_fraction=0.5))
    assert slot.device == "cpu" and slot.capacity > 0
    with pytest.raises(PlacementError, match="target.placement.devices names cuda:1, but this machine has 0"):
        device_inventory(PlacementConfig(devices=["cuda:1"]))


@pytest.mark.gpu
def test_a_target_split_over_cuda_and_the_cpu_captures_what_one_gpu_does(tiny_target_dir):
    """The placement's real device crossings: half the layers on cuda:0, the rest in RAM."""
    single, _ = load_target(tiny_target_dir, dtype="float32", device="cuda")
    model, _ = load_target(tiny_target_dir, dtype="float32", device="cpu")
    units = placement_units(model, decoder_layers_path(model))
    head_and_three = sum(u.nbytes for u in units[:5])  # embeddings, rotary table, layers 0-2
    slots = [DeviceSlot("cuda:0", "cuda:0", head_and_three), DeviceSlot("cpu", "cpu", 1 << 40)]
    device_map = place_model(model, units, plan_placement(units, slots), slots)
    assert device_map["model.layers.2"] == "cuda:0" and device_map["model.layers.3"] == "cpu"
    assert model.model.layers[0].mlp.up_proj.weight.is_cuda and not model.model.layers[6].mlp.up_proj.weight.is_cuda
    want = TargetFeatureExtractor.from_model(single).capture_rows(ROWS)
    got = TargetFeatureExtractor.from_model(model, device_map=device_map).capture_rows(ROWS)
    for a, b in zip(want, got, strict=True):
        assert b.device.type == "cpu"  # the last layer's device
        torch.testing.assert_close(b, a.cpu(), rtol=1e-4, atol=1e-4)
    print(json.dumps({k: v for k, v in device_map.items() if "layers" not in k}))


def test_load_placed_model_reads_trust_remote_code_from_the_config(tiny_target_dir, monkeypatch):
    seen = {}
    import transformers

    original = transformers.AutoConfig.from_pretrained

    def spy(path, **kwargs):
        seen["trust_remote_code"] = kwargs.get("trust_remote_code")
        return original(path, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    load_placed_model(tiny_target_dir, torch.float32, PlacementConfig(), trust_remote_code=True)
    assert seen["trust_remote_code"] is True
