"""Native checkpoints (DCP): atomic writes, cross-implementation loads, and the
refusal of pre-contract checkpoints."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch

from core import native_checkpoint as nc
from core import weight_contract as wc
from core.checkpoint.io import open_checkpoint
from core.checkpoint.tiny import prepare_checkpoint
from core.config import preset

TINY = preset("tiny")


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    path = prepare_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", TINY, dtype="bf16", seed=7)
    reader = open_checkpoint(path)
    return reader.config, dict(wc.hf_to_native(reader.iter_tensors(), reader.config))


def _write_legacy_dcp(path, state):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_miles_save_megatron_load_round_trip(native, tmp_path):
    cfg, state = native
    out = nc.save_native(tmp_path / "ckpt", state, impl="miles", config=cfg)
    assert nc.is_native_checkpoint(out)
    assert not any(p.name.startswith(".ckpt") for p in tmp_path.iterdir())  # temp dir renamed away
    meta = json.loads((out / nc.META_FILE).read_text())
    assert meta["contract_version"] == wc.CONTRACT_VERSION and meta["impl"] == "miles"
    assert meta["model_config"] == cfg.to_hf_dict()

    loaded, md = nc.load_native(out, impl="megatron")
    assert md["impl"] == "miles" and md["loaded_by"] == "megatron"
    assert loaded.keys() == state.keys()
    for n, t in state.items():
        assert loaded[n].dtype == t.dtype and torch.equal(loaded[n], t), n
    assert loaded["decoder.layers.0.mlp.router.tid2eid"].dtype == torch.int64
    assert loaded["decoder.layers.1.self_attention.core_attention.compressor.norm.weight"].dtype == torch.float32
    # and the other way round, then back to HF bit-identically
    nc.save_native(tmp_path / "ckpt2", loaded, impl="megatron", config=cfg)
    again, md2 = nc.load_native(tmp_path / "ckpt2", impl="miles", config=cfg)
    assert md2["impl"] == "megatron"
    hf = dict(wc.native_to_hf(again.items(), cfg, official_dtypes=True))
    ref = dict(wc.native_to_hf(state.items(), cfg, official_dtypes=True))
    assert all(torch.equal(hf[n], ref[n]) and hf[n].dtype == ref[n].dtype for n in ref)


def test_parameters_and_overwrite(native, tmp_path):
    cfg, state = native
    params = {n: torch.nn.Parameter(t, requires_grad=t.is_floating_point()) for n, t in state.items()}
    nc.save_native(tmp_path / "c", params, impl="megatron", config=cfg)
    with pytest.raises(nc.NativeCheckpointError, match="not empty"):
        nc.save_native(tmp_path / "c", state, impl="megatron", config=cfg)
    changed = dict(state)
    changed["decoder.final_layernorm.weight"] = torch.full_like(state["decoder.final_layernorm.weight"], 2.0)
    nc.save_native(tmp_path / "c", changed, impl="miles", config=cfg, overwrite=True)
    loaded, md = nc.load_native(tmp_path / "c")
    assert md["impl"] == "miles" and bool((loaded["decoder.final_layernorm.weight"] == 2).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_save_rejects_bad_state_and_leaves_nothing(native, tmp_path):
    cfg, state = native
    bad = dict(state)
    bad["decoder.layers.0.self_attention.wq_a.weight"] = bad.pop("decoder.layers.0.self_attention.linear_q_down_proj.weight")
    with pytest.raises(wc.WeightContractError, match=r"self_attention\.wq_a\.weight"):
        nc.save_native(tmp_path / "x", bad, impl="miles", config=cfg)
    short = dict(state)
    short.pop("decoder.layers.0.mlp.router.tid2eid")
    with pytest.raises(wc.WeightContractError, match="missing"):
        nc.save_native(tmp_path / "x", short, impl="miles", config=cfg)
    wrong = dict(state)
    wrong["decoder.final_layernorm.weight"] = torch.zeros(3)
    with pytest.raises(nc.NativeCheckpointError, match="final_layernorm"):
        nc.save_native(tmp_path / "x", wrong, impl="miles", config=cfg)
    with pytest.raises(nc.NativeCheckpointError, match="impl"):
        nc.save_native(tmp_path / "x", state, impl="", config=cfg)
    assert list(tmp_path.iterdir()) == []


def test_pre_contract_names_are_refused(native, tmp_path):
    cfg, state = native
    legacy = {("decoder.layers.0.self_attention.wq_a.weight" if n.endswith("linear_q_down_proj.weight") and
               n.startswith("decoder.layers.0.") else n): t for n, t in state.items()}
    # written by an old tool: plain DCP, no dsv4_native.json
    _write_legacy_dcp(tmp_path / "old", legacy)
    assert not nc.is_native_checkpoint(tmp_path / "old")
    with pytest.raises(nc.StaleCheckpointError, match=r"dsv4 convert --impl megatron --hf DIR --out DIR"):
        nc.load_native(tmp_path / "old", impl="megatron")
    # with current metadata but old names inside
    (tmp_path / "old" / nc.META_FILE).write_text(json.dumps(
        {"contract_version": wc.CONTRACT_VERSION, "impl": "miles", "model_config": cfg.to_hf_dict()}))
    with pytest.raises(nc.StaleCheckpointError) as ei:
        nc.load_native(tmp_path / "old", impl="megatron")
    msg = str(ei.value)
    assert "decoder.layers.0.self_attention.wq_a.weight" in msg and "dsv4 convert --impl megatron" in msg


def _v1_name(n: str) -> str:
    """Contract v1's spelling of a v2 name (before the names became upstream Megatron's)."""
    n = n.replace(".mtp_model_layer.", ".transformer_layer.")
    return n[:-len("_hyper_connection.bias")] + "_hyper_connection.mapping_proj.bias" \
        if n.endswith("_hyper_connection.bias") else n


def test_a_contract_v1_checkpoint_is_refused_naming_the_fix(native, tmp_path):
    cfg, state = native
    out = nc.save_native(tmp_path / "v2", state, impl="megatron", config=cfg)
    meta = json.loads((out / nc.META_FILE).read_text())
    _write_legacy_dcp(tmp_path / "v1", {_v1_name(n): t for n, t in state.items()})
    (tmp_path / "v1" / nc.META_FILE).write_text(json.dumps({**meta, "contract_version": 1}))
    with pytest.raises(nc.StaleCheckpointError, match=r"older weight contract.*dsv4 convert --impl megatron"):
        nc.load_native(tmp_path / "v1")
    # v1 names under a v2 stamp: each old spelling is named with the upstream name that replaced it
    (tmp_path / "v1" / nc.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(nc.StaleCheckpointError, match=r"mtp_model_layer|_hyper_connection\.bias"):
        nc.load_native(tmp_path / "v1")


def test_bridge_local_experts_names_load_under_contract_names(native, tmp_path):
    cfg, state = native
    out = nc.save_native(tmp_path / "c", state, impl="megatron", config=cfg)
    meta = (out / nc.META_FILE).read_text()
    rx = __import__("re").compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")

    def bridge(n):
        m = rx.match(n)
        return f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}.weight" if m else n

    renamed = {bridge(n): t for n, t in state.items()}
    assert any(".local_experts.7.linear_fc1.weight" in n for n in renamed)
    _write_legacy_dcp(tmp_path / "bridge", renamed)
    (tmp_path / "bridge" / nc.META_FILE).write_text(meta)
    got, _ = nc.load_native(tmp_path / "bridge", config=cfg)
    assert got.keys() == state.keys()
    for n, t in state.items():
        assert torch.equal(got[n], t), n


@pytest.mark.parametrize("version", [None, 0, wc.CONTRACT_VERSION + 1, "1"])
def test_other_or_missing_contract_version_is_refused(native, tmp_path, version):
    cfg, state = native
    out = nc.save_native(tmp_path / "c", state, impl="miles", config=cfg)
    meta = json.loads((out / nc.META_FILE).read_text())
    if version is None:
        del meta["contract_version"]
    else:
        meta["contract_version"] = version
    (out / nc.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(nc.StaleCheckpointError, match=r"re-convert.*dsv4 convert --impl miles"):
        nc.load_native(out)


def test_config_mismatch_and_missing_folder(native, tmp_path):
    cfg, state = native
    out = nc.save_native(tmp_path / "c", state, impl="miles", config=cfg)
    with pytest.raises(nc.NativeCheckpointError, match="different model config"):
        nc.load_native(out, config=cfg.replace(norm_eps=1e-5))
    with pytest.raises(nc.NativeCheckpointError, match="does not exist"):
        nc.load_native(tmp_path / "nope")
    assert not nc.is_native_checkpoint(tmp_path / "nope")


def test_metadata_is_read_without_arbitrary_unpickling(native, tmp_path):
    cfg, state = native
    out = nc.save_native(tmp_path / "c", state, impl="miles", config=cfg)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (out / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(nc.NativeCheckpointError, match="metadata"):
        nc.load_native(out)
    assert not (tmp_path / "pwned").exists()
