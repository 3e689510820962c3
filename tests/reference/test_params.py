"""Parameter counts of the presets (from the official tensor list): exact reference numbers, and the same
counts as the model's own parameters on the meta device."""

from __future__ import annotations

import pytest

from core.config import preset
from kernels.reference.params import COMPONENTS
from kernels.reference.params import count_parameters as _count

_cache: dict = {}


def count_parameters(cfg):
    if cfg not in _cache:
        _cache[cfg] = _count(cfg)
    return _cache[cfg]


@pytest.mark.parametrize("name,total", [
    ("flash-4layer", 27_390_526_557),
    ("flash", 284_334_557_271),
    ("pro", 1_572_999_506_531),
])
def test_preset_totals(name, total):
    c = count_parameters(preset(name))
    assert c["total"] == total
    assert sum(c[k] for k in COMPONENTS if k != "mtp") == c["total"]
    assert c["total_with_mtp"] == c["total"] + c["mtp"]


def test_flash_breakdown():
    c = count_parameters(preset("flash"))
    assert c["embed"] == c["head"] == 129280 * 4096
    assert c["hash_tables"] == 3 * 129280 * 6          # tid2eid counted (Parameter); gate.bias is a buffer
    assert c["routed_experts"] == 43 * 256 * 3 * 2048 * 4096
    assert c["shared_experts"] == 43 * 3 * 2048 * 4096
    assert c["router"] == 43 * 256 * 4096
    assert c["mhc"] == 43 * 2 * (24 * 16384 + 24 + 3) + 4 * 16384 + 4 + 1
    assert c["attention"] == 43 * 106_956_352
    assert c["compressor"] == 21 * 8_393_216 + 20 * 4_260_352
    assert c["indexer"] == 21 * 10_749_056
    assert c["norms"] == 43 * 2 * 4096 + 4096
    assert round(c["mtp"] / 1e9, 2) == 6.61              # architecture.md 1.3
    assert round(c["active_per_token"] / 1e9, 2) == 13.80


def test_flash_4layer_layout():
    cfg = preset("flash-4layer")
    assert cfg.n_mtp_layers == 0 and cfg.compress_ratios == (0, 0, 4, 128) and cfg.n_hash_layers == 3
    assert count_parameters(cfg)["mtp"] == 0


def test_pro_mtp():
    c = count_parameters(preset("pro"))
    assert round(c["mtp"] / 1e9, 2) == 25.84
    assert round(c["active_per_token"] / 1e9, 2) == 49.78


@pytest.mark.parametrize("name", ["tiny", "flash-4layer", "tiny-wide-heads"])
def test_the_tensor_list_counts_the_models_parameters(name):
    """The count from the official tensor list is the model's: every parameter of the meta-device model, by
    component (the routers' bias, a buffer, is left out of both)."""
    from kernels.reference.model import DeepseekV4Model
    from kernels.reference.params import component_of

    cfg = preset(name)
    want = {k: 0 for k in COMPONENTS}
    for pname, p in DeepseekV4Model(cfg, device="meta").named_parameters():
        want[component_of(pname)] += p.numel()
    got = count_parameters(cfg)
    assert {k: got[k] for k in COMPONENTS} == want
