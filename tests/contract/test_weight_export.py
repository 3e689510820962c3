"""Rollout export buckets (atomic groups never split) and the weight checker."""

from __future__ import annotations

import random

import pytest
import torch

from core import weight_contract as wc
from core.checkpoint.io import open_checkpoint
from core.checkpoint.tiny import prepare_checkpoint
from core.config import preset
from core.export import ExportError, check_weights, export_buckets, tensor_nbytes

TINY = preset("tiny")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, official tensors as read in bf16, native tensors)."""
    path = prepare_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", TINY, dtype="bf16", seed=5)
    reader = open_checkpoint(path)
    official = dict(reader.iter_tensors())
    native = dict(wc.hf_to_native(official.items(), reader.config))
    return reader.config, official, native


def _groups_of(config, hf_name):
    """The official members of every atomic group, by official name."""
    for nat in wc.official_to_native_names(hf_name, config):
        yield wc.export_unit(nat, config)[2]


def _assert_no_group_split(config, buckets):
    where = {}
    for i, b in enumerate(buckets):
        for n, _ in b:
            assert n not in where, f"{n} exported twice"
            where[n] = i
    for n, i in where.items():
        for members in _groups_of(config, n):
            assert {where[m] for m in members} == {i}, f"group {members} split across buckets"


@pytest.mark.parametrize("limit", [1, 4096, 200_000, 1 << 30])
def test_buckets_cover_everything_and_never_split_a_group(tiny, limit):
    cfg, official, native = tiny
    items = list(native.items())
    random.Random(limit).shuffle(items)  # group members arrive far apart
    buckets = list(export_buckets(items, cfg, max_bucket_bytes=limit))
    _assert_no_group_split(cfg, buckets)
    got = {n: t for b in buckets for n, t in b}
    assert got.keys() == official.keys()
    for b in buckets:
        if sum(tensor_nbytes(t) for _, t in b) > limit:  # only a single unit may exceed the limit
            units = {wc.export_unit(wc.official_to_native_names(n, cfg)[0], cfg)[0] for n, _ in b}
            assert len(units) == 1, [n for n, _ in b]
    if limit == 1 << 30:
        assert len(buckets) == 1
    rep = check_weights(got, {n: official[n].to(got[n].dtype) if wc.keeps_fp32(n) else official[n] for n in official})
    assert rep.ok, rep.summary()


def test_limit_smaller_than_one_group_sends_the_group_whole_in_its_own_bucket(tiny):
    cfg, official, native = tiny
    p = "decoder.layers.1.self_attention."
    names = [p + "linear_q_down_proj.weight", "decoder.final_layernorm.weight", p + "linear_kv_proj.weight",
             "decoder.layers.1.mlp.experts.linear_fc1.weight2"]
    limit = 64  # far below any of these
    buckets = list(export_buckets([(n, native[n]) for n in names], cfg, max_bucket_bytes=limit))
    assert [[n for n, _ in b] for b in buckets] == [
        ["norm.weight"],
        ["layers.1.attn.wq_a.weight", "layers.1.attn.wkv.weight"],
        ["layers.1.ffn.experts.2.w1.weight", "layers.1.ffn.experts.2.w3.weight"],
    ]
    for b in buckets:
        for n, t in b:
            assert torch.equal(t, official[n])


def test_packed_alphas_and_fp32_tensors_stay_fp32_when_the_rest_goes_bf16(tiny):
    cfg, official, native = tiny
    master = {n: (t.float() if t.is_floating_point() else t) for n, t in native.items()}  # fp32 master weights
    out = {n: t for b in export_buckets(master.items(), cfg, max_bucket_bytes=1 << 16, dtype=torch.bfloat16)
           for n, t in b}
    for n, t in out.items():
        if wc.keeps_fp32(n):
            assert t.dtype == torch.float32, n
        elif n.endswith("tid2eid"):
            assert t.dtype == torch.int64 and torch.equal(t, official[n]), n
        else:
            assert t.dtype == torch.bfloat16, n
    assert out["layers.2.hc_attn_scale"].shape == (3,)
    assert torch.equal(out["layers.2.hc_attn_scale"], torch.cat([
        native[f"decoder.layers.2.self_attention_hyper_connection.alpha_{s}"] for s in ("pre", "post", "res")]))
    assert torch.equal(out["layers.1.attn.compressor.norm.weight"], official["layers.1.attn.compressor.norm.weight"].float())


def test_tid2eid_is_exported(tiny):
    cfg, official, native = tiny
    tids = [n for n in official if n.endswith("ffn.gate.tid2eid")]
    assert tids == ["layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.tid2eid"]
    model = torch.nn.Module()
    p = torch.nn.Parameter(native["decoder.layers.0.mlp.router.tid2eid"], requires_grad=False)
    model.register_parameter("tid2eid", p)
    (bucket,) = export_buckets([("decoder.layers.0.mlp.router.tid2eid", p)], cfg, max_bucket_bytes=1 << 20)
    assert bucket[0][0] == "layers.0.ffn.gate.tid2eid" and torch.equal(bucket[0][1], official[tids[0]])
    # a caller that only walks named_parameters and misses a tensor is caught with expect_complete
    partial = [(n, t) for n, t in native.items() if not n.endswith("tid2eid")]
    with pytest.raises(ExportError, match="tid2eid"):
        list(export_buckets(partial, cfg, max_bucket_bytes=1 << 20, expect_complete=True))


def test_incomplete_group_raises_naming_the_missing_members(tiny):
    cfg, _, native = tiny
    p = "decoder.layers.3.self_attention_hyper_connection."
    items = [(p + "alpha_pre", native[p + "alpha_pre"]), (p + "alpha_res", native[p + "alpha_res"]),
             ("decoder.final_layernorm.weight", native["decoder.final_layernorm.weight"])]
    with pytest.raises(ExportError, match=r"missing decoder\.layers\.3\.self_attention_hyper_connection\.alpha_post"):
        list(export_buckets(items, cfg, max_bucket_bytes=1 << 20))
    c = "decoder.layers.2.self_attention.core_attention.compressor."
    with pytest.raises(ExportError, match=r"linear_wgate\.weight.*layers\.2\.attn\.compressor\.wkv\.weight"):
        list(export_buckets([(c + "linear_wkv.weight", native[c + "linear_wkv.weight"])], cfg, max_bucket_bytes=1))


def test_export_errors(tiny):
    cfg, _, native = tiny
    n = "decoder.layers.0.self_attention.core_attention.attn_sink"
    with pytest.raises(ExportError, match=r"layers\.0\.attn\.attn_sink.*fp32"):
        list(export_buckets([(n, native[n].to(torch.bfloat16))], cfg, max_bucket_bytes=1 << 20))
    with pytest.raises(wc.WeightContractError, match=r"decoder\.layers\.0\.self_attention\.wq_a\.weight"):
        list(export_buckets([("decoder.layers.0.self_attention.wq_a.weight", torch.zeros(1))], cfg,
                            max_bucket_bytes=1 << 20))
    with pytest.raises(ExportError, match="twice"):
        list(export_buckets([(n, native[n]), (n, native[n])], cfg, max_bucket_bytes=1 << 20))


# ------------------------------------------------------------------ checker
def test_checker_accepts_identical_weights(tiny):
    _, official, _ = tiny
    rep = check_weights(dict(official), official)
    assert rep.ok and rep.checked == len(official), rep.summary()


def test_checker_flags_each_problem(tiny):
    _, official, _ = tiny
    got = dict(official)
    del got["layers.3.attn.wq_b.weight"]
    got["layers.3.attn.bogus"] = torch.zeros(2)
    got["layers.0.attn_norm.weight"] = torch.zeros(TINY.dim + 1, dtype=torch.bfloat16)
    got["layers.0.ffn.gate.tid2eid"] = torch.zeros_like(official["layers.0.ffn.gate.tid2eid"])      # the bug
    got["layers.1.ffn.gate.tid2eid"] = torch.full_like(official["layers.1.ffn.gate.tid2eid"], -1)
    got["layers.2.hc_ffn_fn"] = official["layers.2.hc_ffn_fn"].to(torch.bfloat16)                  # downcast
    got["mtp.0.attn.attn_sink"] = official["mtp.0.attn.attn_sink"].to(torch.bfloat16)
    w = official["layers.2.attn.wo_b.weight"].clone()
    w[0, 0] += 1
    got["layers.2.attn.wo_b.weight"] = w
    e = official["embed.weight"].clone()
    e[3, 4] = float("nan")
    got["embed.weight"] = e
    rep = check_weights(got, official)
    assert not rep.ok
    assert rep.names("missing") == ["layers.3.attn.wq_b.weight"]
    assert rep.names("extra") == ["layers.3.attn.bogus"]
    assert rep.names("shape") == ["layers.0.attn_norm.weight"]
    assert rep.names("tid2eid_degenerate") == ["layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.tid2eid"]
    assert set(rep.names("fp32_downcast")) == {"layers.2.hc_ffn_fn", "mtp.0.attn.attn_sink"}
    assert {"layers.2.hc_ffn_fn", "mtp.0.attn.attn_sink"} <= set(rep.names("dtype"))
    assert set(rep.names("value")) >= {"layers.2.attn.wo_b.weight", "layers.0.ffn.gate.tid2eid",
                                       "layers.1.ffn.gate.tid2eid", "embed.weight"}
    assert rep.names("nonfinite") == ["embed.weight"]
    assert "all entries are 0" in str(rep.of_kind("tid2eid_degenerate")[0])
    with pytest.raises(ExportError, match="tid2eid"):
        rep.raise_if_bad()


def test_checker_flags_degenerate_tid2eid_even_against_a_degenerate_reference():
    t = torch.zeros(8, 2, dtype=torch.int64)
    rep = check_weights({"layers.0.ffn.gate.tid2eid": t}, {"layers.0.ffn.gate.tid2eid": t.clone()})
    assert rep.names() == ["layers.0.ffn.gate.tid2eid"] and rep.issues[0].kind == "tid2eid_degenerate"
    bad = torch.tensor([[0, 1], [-1, 2]])
    rep = check_weights({"layers.0.ffn.gate.tid2eid": bad}, {"layers.0.ffn.gate.tid2eid": bad})
    assert rep.issues[0].kind == "tid2eid_invalid"


def test_checker_tolerance():
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([1.0, 2.001])
    assert not check_weights({"norm.weight": a}, {"norm.weight": b}).ok
    assert check_weights({"norm.weight": a}, {"norm.weight": b}, atol=1e-2).ok
