"""Zero-copy weight sync (rollout.shared_weights): the built-in engine in the trainer's process computes with the
trainer's own memory, the trainer's expert banks are one buffer that the grouped GEMM and the engine's decode MoE
read without a copy, and a GRPO run that shares trains exactly as one that copies (the copy path,
rollout.weight_sync, is the reference: export -> publish -> load -> check)."""

import json

import pytest
import torch

from core.config import preset


def small_config():
    # 3 trunk layers (layer 0 hash-routed, 1-2 learned; layer 1 CSA with an indexer) + 1 MTP layer (test_grpo's)
    return preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)


def run_config(impl: str):
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host

    return normalize(Choices(impl=impl, model=small_config()), make_host(third_party=False), model_name="small")


def write_data(path, n=16):
    rows = [{"prompt": f"{i}+{i}=", "reward": {"type": "valid_bytes"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _trainer():
    from train.model import build_train_model

    torch.manual_seed(0)
    return build_train_model(small_config(), run_config("miles"))


def _banks(model):
    from engine.moe import _WeightBank

    return [m for m in model.modules() if isinstance(m, _WeightBank)]


def test_an_expert_bank_is_one_buffer_and_the_grouped_gemm_reads_it_without_a_copy():
    from engine.moe import _WeightBank

    torch.manual_seed(0)
    bank = _WeightBank(4, (6, 8), torch.float32, 0, 2, 0.02)
    # registered last expert first: megatron-core's DDP lays a module's parameters out in reverse order
    assert [n for n, _ in bank.named_parameters()] == ["weight3", "weight2", "weight1", "weight0"]
    stack = bank.stacked()
    assert stack.data_ptr() == bank[0].data_ptr() and stack[3].data_ptr() == bank[3].data_ptr()
    x = torch.randn(4, 3, 8)
    (torch.bmm(x, stack.transpose(1, 2)) ** 2).sum().backward()
    shared = [bank[i].grad.clone() for i in range(4)]
    for i in range(4):
        bank[i].grad = None
    (torch.bmm(x, torch.stack(bank.experts()).transpose(1, 2)) ** 2).sum().backward()
    assert all(torch.equal(g, bank[i].grad) for i, g in enumerate(shared))   # the same gradient as a copied stack
    bank[2].data = bank[2].data.clone()          # moved apart (as module.to moves each parameter): a copy again
    assert bank.stacked().data_ptr() != bank[0].data_ptr()
    assert torch.equal(bank.stacked()[2], bank[2])


def test_the_engine_computes_with_the_trainers_memory_and_samples_as_a_copy_synced_engine():
    from rollout.reference_engine import ReferenceEngine, SamplingParams
    from rollout.shared_weights import WeightSharer
    from rollout.weight_sync import sync_weights

    model, config = _trainer(), small_config()
    shared, copied = ReferenceEngine(config), ReferenceEngine(config)
    sharer = WeightSharer(shared)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    prompts = [[1, 5, 9], [3, 4]]

    def same_samples():
        a = shared.generate(prompts, params, n=2, seed=7)
        b = copied.generate(prompts, params, n=2, seed=7)
        return all(x.response_ids == y.response_ids and
                   torch.equal(x.logprobs, y.logprobs)
                   for ga, gb in zip(a, b) for x, y in zip(ga, gb))

    first = sharer.sync(model, version=1)
    sync_weights(model, copied, version=1)
    # everything but the packed hc scales (built from three alphas each) is the trainer's memory
    not_shared = set(shared.copied_names())
    assert not_shared and all(n.endswith("_scale") for n in not_shared), sorted(not_shared)[:5]
    assert first.bytes == sum(shared.held_weights()[n].nbytes for n in not_shared)
    trunk_banks = _banks(model)
    fc1 = next(b for b in trunk_banks if b.n == config.n_routed_experts and b[0].shape[0] == 2 * config.moe_inter_dim)
    stacks = [layer.ffn._expert_stacks for layer in shared.model.layers]
    assert any(st["w13"].data_ptr() == fc1[0].data_ptr() for st in stacks)   # the decode MoE reads the bank
    assert shared.reusable_share          # no stack copied: the shared expert's gate and up too are the trainer's
    assert same_samples()

    with torch.no_grad():                        # an optimizer step: every weight changes in place
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.05)
    again = sharer.sync(model, version=2)
    sync_weights(model, copied, version=2)
    assert again.bytes == first.bytes and again.shared_bytes == first.shared_bytes and shared.version == 2
    assert same_samples()
    assert shared.held_bytes() < copied.held_bytes() / 20     # the engine holds (almost) nothing of its own

    shared.release_memory()                      # colocated mode: the next sync shares again
    sharer.sync(model, version=3)
    assert shared.version == 3 and same_samples()


def _grpo(tmp_path, weight_sync, **kw):
    from orchestration import run_training
    from reporting.metrics import read_metrics

    root = tmp_path / weight_sync
    root.mkdir()
    run_training(run_config("miles"), small_config(), mode="grpo", steps=2, run_dir=root / "run",
                 data=write_data(root / "data.jsonl"), max_new_tokens=4, prompts_per_step=2, group_size=4,
                 lr=1e-3, progress=False, weight_sync=weight_sync, **kw)
    log = "\n".join(p.read_text() for p in (root / "run").glob("*.log"))
    return read_metrics(root / "run"), log


def test_a_grpo_run_that_shares_trains_exactly_as_one_that_copies(tmp_path):
    shared, shared_log = _grpo(tmp_path, "auto")
    copied, copied_log = _grpo(tmp_path, "copy")
    assert "weight sync: shared" in shared_log and "weight sync: copy (weight_sync=copy)" in copied_log
    for a, b in zip(shared, copied):
        for key in ("loss", "grad_norm", "reward_mean", "train_rollout_logprob_abs_diff"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert a["weight_sync_shared_bytes"] > 1000 * a["weight_sync_bytes"] > 0
        assert b["weight_sync_shared_bytes"] == 0 and b["weight_sync_bytes"] > a["weight_sync_shared_bytes"]


def test_weight_sync_settings_are_checked():
    from core.config import ConfigError
    from rollout.shared_weights import weight_sync_mode
    from train.config_checks import validate
    from train.trainer import TrainConfig

    with pytest.raises(ConfigError, match="must be one of auto, shared, copy"):
        validate(TrainConfig(weight_sync="zero-copy"))
    with pytest.raises(ConfigError, match="'async_rollout' generates .* Fix: weight_sync=auto"):
        validate(TrainConfig(weight_sync="shared", async_rollout=True))

    class Ranks:                                 # one rank holding the whole model
        tp = cp = ep = pp = 1

    class ServerEngine:                          # an engine in another process (SGLang, a Ray actor)
        name = "sglang"

    cpu = torch.device("cpu")
    assert weight_sync_mode(TrainConfig(), ServerEngine(), Ranks(), "bf16", cpu)[0] == "copy"
    with pytest.raises(ConfigError, match="runs in another process .*Fix: weight_sync=auto"):
        weight_sync_mode(TrainConfig(weight_sync="shared"), ServerEngine(), Ranks(), "bf16", cpu)
    from rollout.reference_engine import ReferenceEngine

    engine = ReferenceEngine(small_config())
    assert weight_sync_mode(TrainConfig(), engine, Ranks(), "bf16", cpu) == ("shared", None)
    mode, why = weight_sync_mode(TrainConfig(), engine, Ranks(), "fp8", cpu)
    assert mode == "copy" and "quantized copies" in why
    Ranks.tp = 2
    assert "holds a shard" in weight_sync_mode(TrainConfig(), engine, Ranks(), "bf16", cpu)[1]


def test_megatron_ddp_lays_a_bank_out_in_expert_order():
    """megatron-core's DDP buffer (the GPU optimizer path) iterates a module's parameters in reverse: the bank's
    last-first registration makes every expert start where the previous one ends, so the packed stack survives
    the move into the buffer (the layout function megatron-core's DDP calls, read without a GPU)."""
    from backends.cpu.megatron_shims import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()                   # megatron-core imports triton (what the cpu target does)
    from megatron.core.distributed.param_and_grad_buffer import _compute_default_per_buffer_param_layout

    from engine.moe import _WeightBank

    bank = _WeightBank(4, (6, 8), torch.bfloat16, 0, 2, 0.02)
    layout = _compute_default_per_buffer_param_layout(list(bank.parameters()), None)
    spans = [layout.param_index_map[bank[i]][:2] for i in range(4)]
    assert all(end == nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), spans


def test_a_run_that_cannot_share_is_refused_when_configured():
    """``weight_sync=shared`` is checked with the run's layout before anything starts (no engine, no server)."""
    from core.config import ConfigError
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from train.config_checks import check_train_options
    from train.trainer import TrainConfig

    host = make_host(third_party=False)
    fp8 = normalize(Choices(impl="miles", model=small_config(), quant="fp8"), host, model_name="small")
    with pytest.raises(ConfigError, match="--quant publishes fp8 weights.*Fix: weight_sync=auto"):
        check_train_options(fp8, TrainConfig(weight_sync="shared"), host)
    check_train_options(fp8, TrainConfig(), host)                      # auto: copies
    check_train_options(run_config("miles"), TrainConfig(weight_sync="shared"), host)
