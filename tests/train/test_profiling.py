"""The step budget of ``dsv4 train`` (``profile_steps``, reporting.profiling): every op of the profiled steps lands in
the row of the model part that ran it, backward ops included (found through autograd's sequence numbers), the
trainer's optimizer and zero_grad in their own rows, and the budget is written after the last profiled step.

On the CPU a row's time is its ops' own CPU time (on a GPU: their kernels'), so the attribution is the same code
path that the GPU budget of bench.train_cli uses."""

import json

import pytest

from ._impl_helpers import run_config, small_config, write_data


def test_module_scopes_of_both_implementations_cover_the_named_parts():
    from train.model import build_train_model
    from reporting.profiling import module_scope

    c = small_config()
    for impl in ("miles", "megatron"):
        names = [n for n, _ in build_train_model(c, run_config(impl, c), seed=0).module.named_modules()]
        scopes = {n.rsplit(".", 1)[-1]: module_scope(n) for n in names if n}
        assert scopes["experts"] == "moe experts" and scopes["router"] == "moe router"
        assert scopes["shared_experts"] == "moe shared expert" and scopes["indexer"] == "indexer"
        assert scopes["compressor"] == "compressor" and scopes["core_attention"] == "sparse attention"
        assert scopes["output_layer"] == "output head" and scopes["input_layernorm"] == "norms"
        assert scopes["self_attention_hyper_connection"] == "mhc"
        assert module_scope("decoder.layers.1.mlp.experts.linear_fc1") is None   # inside the experts' scope


def test_category_refines_a_scope_by_op_name():
    from reporting.profiling import category

    assert category("moe experts", "aten::_grouped_mm") == "moe expert GEMMs"
    assert category("moe experts", "aten::index_select") == "moe permute/unpermute"
    assert category("moe experts", "aten::stack") == "moe expert weight stacking"
    assert category("sparse attention", "dsv4_triton::sparse_attention_bwd") == "sparse attention (kernel)"
    assert category(None, "dsv4_triton::hc_pre") == "mhc"
    assert category("indexer", "aten::topk") == "indexer top-k"
    assert category("attention", "aten::mm") == "attention projections"
    assert category("optimizer", "aten::_foreach_norm") == "optimizer: gradient norm"
    assert category("optimizer", "aten::_fused_adamw_") == "optimizer: adam"
    assert category("optimizer", "aten::_foreach_mul_", "Optimizer.step#AdamW.step") == "optimizer: adam"
    assert category(None, "aten::log_softmax") == "outside the model (loss, log-probs, metrics)"


def test_the_projects_triton_kernels_are_placed_by_name():
    from reporting.profiling import kernel_category

    assert kernel_category("_bwd_dkv_kernel") == "sparse attention (kernel)"
    assert kernel_category("_post_bwd_kernel") == "mhc" and kernel_category("_sinkhorn_fwd_kernel") == "mhc"
    assert kernel_category("_indexer_kernel") == "indexer"
    assert kernel_category("_logprob_grad_kernel") == "log-probs (fused with the output head)"
    assert kernel_category("triton_poi_fused_add_0") is None


@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_profiled_steps_write_a_budget_with_backward_in_the_model_rows(tmp_path, impl):
    from reporting.profiling import read_budget
    from orchestration import run_training

    c = small_config()
    run_training(run_config(impl, c), c, mode="sft", steps=3, run_dir=tmp_path / "run", progress=False,
                 export_at_end=False, save_at_end=False, batch_size=2, data=write_data(tmp_path / "d.jsonl"),
                 profile_steps=2)
    b = read_budget(tmp_path / "run")
    assert b is not None and b["profiled_steps"] == 2 and b["steps"] == [2, 3] and b["module_scopes"]
    rows = {r["category"]: r for r in b["rows"]}
    # the backward of the experts' GEMMs and of the attention projections found their forward's scope
    assert rows["moe expert GEMMs"]["fwd_ms"] > 0 and rows["moe expert GEMMs"]["bwd_ms"] > 0
    assert rows["attention projections"]["bwd_ms"] > 0
    assert rows["output head (logits GEMM)"]["bwd_ms"] > 0       # the root module's scope
    # both attentions call their indexer as a module (megatron's through Indexer.forward), so its ops (scores and
    # top-k) are charged to the indexer rows, not to "attention other": the two implementations' budgets compare
    for name in ("compressor", "mhc (torch ops) and block glue", "norms", "moe router", "moe shared expert",
                 "indexer", "indexer top-k"):
        assert rows[name]["total_ms"] > 0, name
    # the trainer's own ranges: the optimizer outside the forward and backward
    adam = rows["optimizer: adam"]
    assert adam["other_ms"] > 0 and adam["fwd_ms"] == 0 and adam["bwd_ms"] == 0
    # most of the time is inside the model's rows: the unscoped row is the loss and metrics only
    outside = rows["outside the model (loss, log-probs, metrics)"]["total_ms"]
    assert outside < 0.5 * b["op_time_ms"]
    assert sum(r["total_ms"] for r in b["rows"]) == pytest.approx(b["op_time_ms"], rel=1e-6)
    assert b["step_ms"] > 0 and b["host_syncs_per_step"] >= 0
    json.dumps(b)


def test_profile_steps_is_range_checked():
    from core.config import ConfigError
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="'profile_steps' = -1 is out of range"):
        TrainConfig(profile_steps=-1)


def test_a_triton_kernel_linked_to_no_host_op_is_counted_in_its_row():
    """The optimizer's one-pass AdamW kernel reached the profile with no host op around it: its device time still
    lands in "optimizer: adam", and a kernel an op holds is not counted twice."""
    from types import SimpleNamespace as NS

    from reporting.profiling import UNLINKED, attribute

    def kernel(name, start, end):
        return NS(name=name, device_type="DeviceType.CUDA", time_range=NS(start=start, end=end))

    op = NS(name="dsv4_triton::hc_post", device_type="DeviceType.CPU", sequence_nr=-1, thread=1, cpu_parent=None,
            kernels=[NS(name="_post_fwd_kernel", duration=5.0)], self_cpu_time_total=0.0, fwd_thread=None)
    events = [op, kernel("_post_fwd_kernel", 0.0, 5.0), kernel("_adamw_chunks", 10.0, 50.0)]
    got = attribute(events, device="cuda")
    assert got["rows"]["optimizer: adam"]["other"] == 40.0
    assert sum(got["rows"]["mhc"].values()) == 5.0
    assert got["kernels"] == 2
    assert UNLINKED not in got["rows"]


def test_device_time_no_op_holds_gets_a_row_that_names_its_kernels():
    """A kernel of no known category that no host op holds (a launch from outside torch's ops, or one the
    profiler failed to link) is counted in its own row and named, so the budget's rows add up to the device's
    busy time and say what the rest is; a kernel an op holds is still counted once."""
    from types import SimpleNamespace as NS

    from reporting.profiling import UNLINKED, attribute

    def kernel(name, start, end):
        return NS(name=name, device_type="DeviceType.CUDA", time_range=NS(start=start, end=end))

    op = NS(name="aten::mm", device_type="DeviceType.CPU", sequence_nr=-1, thread=1, cpu_parent=None,
            kernels=[NS(name="nvjet_gemm", duration=5.0)], self_cpu_time_total=0.0, fwd_thread=None)
    # a record_function range mirrored on the GPU timeline spans all three kernels and the gaps between them: an
    # annotation, not a kernel (counted, it doubled the budget of an H200 run)
    scope_range = NS(name="dsv4::model top", device_type="DeviceType.CUDA", time_range=NS(start=0.0, end=12.0),
                     is_user_annotation=True)
    events = [op, kernel("nvjet_gemm", 0.0, 5.0), kernel("nvjet_gemm", 6.0, 9.0), kernel("memset_kernel", 10.0, 12.0),
              scope_range]
    got = attribute(events, device="cuda")
    assert got["rows"][UNLINKED]["other"] == 5.0                  # the second GEMM's 3 us and the memset's 2
    assert sum(sum(r.values()) for r in got["rows"].values()) == got["busy_us"] == 10.0
    names = {n: us for r, n, us in got["top"] if r == UNLINKED}
    assert names == {"(no host op) > nvjet_gemm": 3.0, "(no host op) > memset_kernel": 2.0}
    assert got["kernels"] == 3          # the op's GEMM, the unlinked GEMM and the memset


def test_host_gaps_are_charged_to_the_op_that_launched_the_kernel_ending_them():
    """Inside a profiled step's range the device's idle time is split by what ended it: the gap before the first
    kernel (step start), each gap between kernels charged to the row and phase of the host op that launched the
    next kernel (linked by correlation id), and the gap after the last kernel (step end); kernels outside the
    step's range and overlapping kernels add no gap. The parts add up to the window less the busy time."""
    from types import SimpleNamespace as NS

    from reporting.profiling import STEP_END, STEP_RANGE, STEP_START, attribute, budget

    def op(i, name, parent=None, seq=-1):
        return NS(id=i, name=name, device_type="DeviceType.CPU", sequence_nr=seq, thread=1, cpu_parent=parent,
                  kernels=[], self_cpu_time_total=0.0, fwd_thread=None, time_range=NS(start=0.0, end=0.0))

    def kernel(name, start, end, corr):
        return NS(name=name, device_type="DeviceType.CUDA", time_range=NS(start=start, end=end),
                  linked_correlation_id=corr)

    step = op(1, STEP_RANGE)
    step.time_range = NS(start=100.0, end=200.0)
    attn = op(2, "dsv4::attention", step)
    mm = op(3, "aten::mm", attn)                     # a forward GEMM in the attention scope
    opt = op(4, "dsv4::optimizer", step)
    adam = op(5, "aten::_fused_adamw_", opt)
    loss = op(6, "aten::sum", step)                  # outside the model
    events = [step, attn, mm, opt, adam, loss,
              kernel("warmup", 50.0, 60.0, 3),       # before the step's range: not counted
              kernel("gemm", 110.0, 130.0, 3),       # step start: 10 us
              kernel("gemm", 125.0, 135.0, 3),       # overlaps the first: no gap
              kernel("reduce", 150.0, 160.0, 6),     # 15 us idle, ended by the loss op
              kernel("adam", 170.0, 190.0, 5)]       # 10 us idle, ended by the optimizer
    gaps = attribute(events, device="cuda")["gaps"]
    assert gaps["rows"] == {STEP_START: 10.0, "outside the model (loss, log-probs, metrics) (fwd)": 15.0,
                            "optimizer: adam (other)": 10.0, STEP_END: 10.0}
    assert gaps["counted_us"] == 45.0 == (200.0 - 100.0) - (25.0 + 10.0 + 20.0)    # the window less busy time
    assert gaps["largest"][0] == (15.0, "outside the model (loss, log-probs, metrics) (fwd)", "aten::sum > reduce")
    got = budget(attribute(events, device="cuda"), steps=1, wall_s=100e-6, device="cuda", module_scopes=True)
    assert got["host_gaps_counted_ms"] == 0.045 and list(got["host_gaps_by_row"])[0].startswith("outside the model")
    # the step's range is no module scope: an op under it alone is still "outside the model" (CPU: its own time)
    loss.self_cpu_time_total, step.self_cpu_time_total = 5.0, 50.0     # the range's own time is no op's
    assert attribute([step, loss], device="cpu")["rows"] == {"outside the model (loss, log-probs, metrics)":
                                                              {"fwd": 5.0, "bwd": 0.0, "other": 0.0}}
