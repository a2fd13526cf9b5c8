"""Run an exported EAGLE-3 draft through SGLang 0.5.23's own model runner on the CPU: the oracle of
tests/eagle3/draft/test_sglang_oracle.py. Runs in the CPU SGLang venv (infra/install-sglang-cpu.sh), imports
nothing of eagleops.

    python sglang_draft_oracle.py DRAFT_DIR INPUTS.safetensors OUT.safetensors

The draft folder is loaded as SGLang's server loads a draft: `--model-path` picks the class from
config.json's architectures (Eagle3DeepseekV2ForCausalLM or LlamaForCausalLMEagle3), SGLang's loader feeds
model.safetensors through that class's `load_weights`, the KV pool is the one SGLang allocates for it (MLA
latent pool for the MLA draft), attention is SGLang's `torch_native` backend (the CPU one). Each forward is a
DRAFT_EXTEND_V2 forward, the mode SGLang's EAGLE worker runs the draft in, so the MLA draft takes the
absorbed-MLA path (`forward_absorb_prepare`/`core`: w_kc/w_vc split from kv_b_proj by `post_load_weights`)
over the latent KV cache, as it does on a GPU; only the attention kernel is the CPU backend's SDPA. With
`select_index` None the logits processor keeps every row, and full capture returns the aux output each row
hands to the next draft step (pre-norm, or normed with norm_output).

INPUTS holds input_ids [T], aux [T, k*H_t] and embedding [V, H] (the target's: SGLang's EAGLE worker
gives the draft the target's embedding, `set_embed`; here it is loaded as the draft's `embed_tokens`).
OUT gets logits_0 [T, Vd] and hidden_0 [T, H] (first draft step: fc over aux), logits_1 [T, Vd] (a second
step over hidden_0: fc skipped, as SGLang skips it for H-wide input), hot_token_id [Vd], and in
loading.json the checkpoint names `load_weights` skipped (`unexpected`) and the parameters it left unwritten
(`missing`: every parameter is filled with NaN before the load, so any NaN left after it was never loaded).
"""

import json
import logging
import os
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


class SkippedNames(logging.Handler):
    """The names SGLang's MLA loader warns it skipped ("Eagle3 MLA: skipping unexpected weight %s")."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "skipping unexpected weight" in record.msg:
            self.names.append(str(record.args[0]))


def watch_loading(model_class, skipped: SkippedNames, report: dict) -> None:
    """Wrap `model_class.load_weights`: NaN-fill every parameter first, record the names fed, and after it the
    parameters still holding NaN (the rows past a vocab padding excepted: SGLang pads embedding rows)."""
    original = model_class.load_weights

    def load_weights(self, weights):
        with torch.no_grad():
            for param in self.parameters():
                param.fill_(float("nan"))
        fed = []
        original(self, ((fed.append(name), (name, tensor))[1] for name, tensor in weights))
        report["fed"], report["missing"] = fed, unwritten_parameters(self)
        report["unexpected"] = list(skipped.names)

    model_class.load_weights = load_weights


def unwritten_parameters(model) -> list[str]:
    padded = {f"{name}.weight": module.org_vocab_size for name, module in model.named_modules()
              if hasattr(module, "org_vocab_size")}
    return [name for name, param in model.named_parameters()
            if torch.isnan(param[: padded[name]] if name in padded else param).any()]


def load_runner(draft_dir: str):
    """SGLang's ModelRunner for the draft folder, set up as `sglang.benchmark.one_batch.load_model` does."""
    from sglang.benchmark import one_batch
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, prepare_server_args

    server_args = prepare_server_args(["--model-path", draft_dir, "--device", "cpu", "--tp-size", "1", "--dtype",
                                       "float32", "--skip-tokenizer-init", "--disable-radix-cache",
                                       "--disable-cuda-graph", "--max-total-tokens", "512",
                                       "--attention-backend", "torch_native"])
    server_args.resolve_once()
    one_batch._set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), gpu_id=0))
    one_batch._init_process_global_configs()
    one_batch.get_tokenizer = lambda *args, **kwargs: None  # a draft folder has no tokenizer; nothing here tokenizes
    bench_runner, _ = one_batch.load_model(server_args, port_args, 0, 0)
    return bench_runner.torch_runner


def draft_request(row: list[int]):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid="oracle", origin_input_text="", origin_input_ids=array("q", row),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.logprob_start_len = -1
    req.extend_end = len(row)
    return req


@torch.no_grad()
def draft_forward(runner, row: list[int], hidden: torch.Tensor):
    """One DRAFT_EXTEND_V2 forward of the draft over `row` with `hidden` as spec_info.hidden_states."""
    from sglang.benchmark.one_batch import TreeCacheNamespace
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    tree = TreeCacheNamespace(page_size=get_schedule().page_size, device=runner.device,
                              token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
    batch = ScheduleBatch.init_new(reqs=[draft_request(row)], req_to_token_pool=runner.req_to_token_pool,
                                   token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=tree,
                                   model_config=runner.model_config, enable_overlap=False,
                                   spec_algorithm=SpeculativeAlgorithm.NONE)
    try:
        batch.prepare_for_extend()
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
            batch.prefill_input_ids_cpu = None
        forward = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                        return_hidden_states_before_norm=False)
        forward.forward_mode = ForwardMode.DRAFT_EXTEND_V2
        forward.spec_info = SimpleNamespace(hidden_states=hidden, select_index=None)  # None: logits of every row
        return runner.forward(forward).logits_output
    finally:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()


def main(draft_dir: str, inputs_path: str, out_path: str) -> None:
    inputs = load_file(inputs_path)
    architecture = json.loads((Path(draft_dir) / "config.json").read_text())["architectures"][0]
    from sglang.srt.models.registry import ModelRegistry

    skipped, report = SkippedNames(), {}
    logging.getLogger("sglang.srt.models.kimi_k25_eagle3").addHandler(skipped)
    watch_loading(ModelRegistry.resolve_model_cls([architecture])[0], skipped, report)
    runner = load_runner(draft_dir)
    report["class"] = type(runner.model).__name__
    ids = inputs["input_ids"].tolist()
    out0 = draft_forward(runner, ids, inputs["aux"])
    out1 = draft_forward(runner, ids, out0.hidden_states)
    save_file({"logits_0": out0.next_token_logits.contiguous(), "hidden_0": out0.hidden_states.contiguous(),
               "logits_1": out1.next_token_logits.contiguous(),
               "hot_token_id": runner.model.hot_token_id.long().contiguous()}, out_path)
    Path(out_path).with_name("loading.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
