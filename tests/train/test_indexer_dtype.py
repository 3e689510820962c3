"""The indexer's input precision: one rule for every caller of ``indexer_scores``.

The op table declares the dtype its ``indexer_scores`` takes ``q`` and ``k`` in (``OpTable.indexer_inputs``) and
every caller casts by :func:`kernels.reference.indexer.indexer_input_dtype`: the reference op (``"compute"``)
scores in the compute dtype (fp32, fp64 in fp64 models); a bf16/fp16 kernel (``"activation"``, the GPU backends'
declaration) gets the model's activation dtype; ``w`` is fp32 either way.

Checked on the CPU with a GPU-like table: the reference functions under another backend name, declaring
``"activation"``, whose ``indexer_scores`` records the dtypes it is given and, like the tilelang kernel, refuses
(``ValueError``) q and k that are not bf16/fp16. A bf16 model with 2 trunk layers (a CSA layer, then a window
layer) gives it bf16 q and k and fp32 w in every forward: the reference model, miles BSHD and THD, megatron THD,
the rollout engine's prefill and its KV-cached decode step (whose probe, which decides whether the decode step
may call the table's indexer, passes exactly the decode step's dtypes: no refusal, no hand-off to the reference
op). A table declaring ``"compute"`` still gets fp32 (bf16 model) and fp64 (fp64 model) q and k."""

from __future__ import annotations

import types

import pytest
import torch

from core.config import preset

from ._impl_helpers import run_config

SMALL = preset("tiny").replace(n_layers=2, compress_ratios=(4, 0), n_hash_layers=1, n_mtp_layers=0)
BF16 = (torch.bfloat16, torch.bfloat16, torch.float32)      # (q, k, w) a bf16 kernel gets in a bf16 run
HALF = (torch.bfloat16, torch.float16)


def _table(calls: list, indexer_inputs: str):
    """The reference functions as backend ``fake`` declaring ``indexer_inputs``; its ``indexer_scores`` appends
    ``(S, q.dtype, k.dtype, w.dtype)`` to ``calls`` and, declaring ``"activation"``, takes bf16/fp16 q and k only."""
    from core.kernel_ops import OpTable
    from kernels.reference.backend import reference_functions

    fns = reference_functions()
    ref = fns["indexer_scores"]

    def indexer_scores(q, k, w):
        calls.append((q.shape[1], q.dtype, k.dtype, w.dtype))
        if indexer_inputs == "activation" and (q.dtype not in HALF or k.dtype != q.dtype):
            raise ValueError(f"the fake indexer kernel takes bf16/fp16 q and k, got {q.dtype} / {k.dtype}")
        ct = torch.promote_types(w.dtype, torch.float32)
        return ref(q.to(ct), k.to(ct), w.to(ct)).float()

    fns["indexer_scores"] = indexer_scores
    return OpTable("fake", fns, dtypes=("bf16", "fp16") if indexer_inputs == "activation" else None,
                   indexer_inputs=indexer_inputs)


def _ids(n=24, seed=0):
    return torch.randint(0, SMALL.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _reference_calls(dtype, indexer_inputs):
    from kernels.reference.model import DeepseekV4Model, init_weights, ops_in_use

    calls = []
    model = DeepseekV4Model(SMALL)
    init_weights(model, seed=0)
    model.to(dtype)
    with torch.no_grad(), ops_in_use(model, _table(calls, indexer_inputs)):
        logits = model(_ids())
    assert torch.isfinite(logits).all()
    return [c[1:] for c in calls]


@pytest.mark.parametrize("impl, fmt", [("miles", "bshd"), ("miles", "thd"), ("megatron", "thd")])
def test_an_implementations_forward_gives_a_bf16_kernel_bf16_queries_and_keys(impl, fmt):
    from core.assembly import assemble

    rc = run_config(impl, SMALL, fmt)
    assemble(rc).setup_process()
    calls = []
    torch.manual_seed(0)
    model = rc.selection.impl.load()(SMALL, rc, ops=_table(calls, "activation"), params_dtype=torch.bfloat16)
    ids = _ids()
    with torch.no_grad():
        lp = model.logprobs(ids) if fmt == "bshd" else model.logprobs(ids[0], torch.tensor([0, 10, 24]))
    assert torch.isfinite(lp).all()
    assert calls and all(c[1:] == BF16 for c in calls), calls


def test_the_reference_model_gives_a_bf16_kernel_bf16_queries_and_keys():
    got = _reference_calls(torch.bfloat16, "activation")
    assert got and all(c == BF16 for c in got), got


@pytest.mark.parametrize("dtype, want", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_the_reference_ops_keep_scoring_in_the_compute_dtype(dtype, want):
    from kernels import gpu_common
    from kernels.reference.backend import ops as reference_ops
    from kernels.reference.indexer import indexer_input_dtype

    got = _reference_calls(dtype, "compute")
    assert got and all(c == (want, want, want) for c in got), got
    assert indexer_input_dtype(None, dtype) == indexer_input_dtype(reference_ops(), dtype) == want
    # the GPU backends' tables declare the activation dtype (built here from stand-in kernel modules)
    fn = lambda *a: None  # noqa: E731
    gpu = gpu_common.make_ops("stand-in", types.SimpleNamespace(sparse_attention_with_sink=fn,
                                                                sparse_attention_with_sink_thd=fn),
                              types.SimpleNamespace(indexer_scores=fn, indexer_scores_thd=fn, indexer_topk=fn))
    assert gpu.indexer_inputs == "activation" and indexer_input_dtype(gpu, dtype) == dtype


def _engine(table, dtype=torch.bfloat16):
    from rollout.reference_engine import ReferenceEngine
    from train.model import build_train_model
    from rollout.weight_sync import sync_weights

    engine = ReferenceEngine(SMALL, dtype=dtype, ops=table)
    assert sync_weights(build_train_model(SMALL, seed=0), engine, version=1, engine_dtype=dtype).ok
    return engine


def test_the_engines_prefill_and_decode_give_a_bf16_kernel_bf16_queries_and_keys():
    from rollout.engine_ops import decode_inputs
    from rollout.reference_engine import SamplingParams

    calls = []
    table = _table(calls, "activation")
    e = _engine(table)
    assert e.decode_refusals == {} and e.decode_ops["indexer_scores"] == "fake"   # the probe took bf16
    calls.clear()
    e.generate([list(range(3, 12))], SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=()), n=1,
               seed=5)
    prefill, decode = [c[1:] for c in calls if c[0] > 1], [c[1:] for c in calls if c[0] == 1]
    assert prefill and decode, calls
    assert all(c == BF16 for c in prefill + decode), calls
    q, k, w = decode_inputs(SMALL, torch.bfloat16, "cpu", table)["indexer_scores"][0]
    assert (q.dtype, k.dtype, w.dtype) == BF16                   # the probe passes what the decode step passes
    q, k, w = decode_inputs(SMALL, torch.bfloat16, "cpu")["indexer_scores"][0]
    assert (q.dtype, k.dtype, w.dtype) == (torch.float32,) * 3   # the reference ops: the compute dtype


def test_an_indexer_handed_to_the_reference_op_in_decode_gets_its_compute_dtype():
    from core.kernel_ops import OpTable
    from kernels.reference.backend import reference_functions

    table = _table([], "activation")
    picky = table.map(lambda name, fn: fn if name != "indexer_scores" else _refuse_single_tokens(fn))
    e = _engine(picky)
    assert set(e.decode_refusals) == {"indexer_scores"} and e.decode_ops["indexer_scores"] == "none"
    assert e.ops.indexer_inputs == "activation" and e.decode_table.indexer_inputs == "compute"
    # a table cannot declare a bf16 indexer it takes from another backend, nor an unknown precision
    delegated = {n: ("none", f) for n, f in reference_functions().items()}
    with pytest.raises(TypeError, match="indexer_scores is backend 'none'"):
        OpTable("fake", {}, delegated=delegated, indexer_inputs="activation")
    with pytest.raises(ValueError, match="indexer_inputs must be one of"):
        OpTable("fake", reference_functions(), indexer_inputs="fp8")


def _refuse_single_tokens(fn):
    def indexer_scores(q, k, w):
        if q.shape[1] == 1:
            raise ValueError("the fake indexer kernel takes no single-token steps")
        return fn(q, k, w)
    return indexer_scores
