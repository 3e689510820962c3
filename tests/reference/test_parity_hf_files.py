"""Parity with transformers through real checkpoint files in the official layout.

test_parity_hf.py compares in memory. Here weights travel through disk:
transformers' random weights are written by our writer in the official layout
(transformers' own save_pretrained writes its own names, not that layout) and
read back by our validated reader; and our prepared checkpoints are loaded
into transformers. Checkpoints with and without an MTP layer are covered
(transformers has no MTP block, so it ignores `mtp.*`; the MTP path is checked
against its parts in test_model.py).

Files hold bf16 weights, so both models load the same (rounded) values and are
compared in fp32: max |log-prob diff| <= 1e-4. The tiny preset gets 32 indexer heads (``TIE_FREE``,
test_parity_hf.py says why: no exact score ties, so transformers' ``torch.topk`` picks our entries).
"""

import pytest
import torch
import transformers

from core.checkpoint import load_into, open_checkpoint, prepare_checkpoint, write_checkpoint
from core.config import preset
from kernels.reference.model import DeepseekV4Model, init_weights
from tests.reference.hf_mapping import hf_config_from, hf_to_official, official_to_hf
from tests.reference.test_parity_hf import TIE_FREE, _randomize_hf

TOL = 1e-4
SEQ_LENS = (9, 131, 263)


def _config(n_mtp_layers):
    cfg = preset("tiny").replace(**TIE_FREE)
    if n_mtp_layers == 0:
        cfg = cfg.replace(n_mtp_layers=0, compress_ratios=cfg.compress_ratios[: cfg.n_layers])
    return cfg


def _hf_model(cfg):
    hcfg = hf_config_from(cfg)
    hcfg._attn_implementation = "eager"
    return transformers.DeepseekV4ForCausalLM(hcfg).eval()


def _assert_same_logprobs(hf, ours, cfg, seed):
    g = torch.Generator().manual_seed(seed)
    for S in SEQ_LENS:
        ids = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
        with torch.no_grad():
            logits = hf(ids).logits.float()
            theirs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            mine = ours.logprobs(ids)
        err = (theirs - mine).abs().max().item()
        assert err <= TOL, f"S={S}: max |log-prob diff| {err}"


@pytest.mark.parametrize("n_mtp_layers", [0, 1])
def test_transformers_weights_written_in_official_layout_load_into_ours(tmp_path, n_mtp_layers):
    cfg = _config(n_mtp_layers)
    hf = _hf_model(cfg)
    _randomize_hf(hf, cfg, seed=21)  # sinks, ape, hc base, router bias too (HF inits them to constants)
    official = hf_to_official(hf.state_dict())
    if n_mtp_layers:  # transformers has no MTP block: take ours for mtp.* so the checkpoint is complete
        donor = DeepseekV4Model(cfg)
        init_weights(donor, 7)
        official.update({k: v for k, v in donor.state_dict().items() if k.startswith("mtp.")})
    ckpt = write_checkpoint(tmp_path / "from_hf", cfg, official, weight_format="bf16", quantize=True)

    ours = DeepseekV4Model(cfg)
    load_into(ours, open_checkpoint(ckpt))
    ours.eval()
    # transformers gets exactly what the file holds (bf16-rounded), read back through our reader
    stored = dict(open_checkpoint(ckpt).iter_tensors(dequantize=True, dtype=torch.float32))
    missing, unexpected = hf.load_state_dict(official_to_hf({k: v for k, v in stored.items() if not k.startswith("mtp.")}), strict=False)
    assert missing == [] and unexpected == []
    _assert_same_logprobs(hf, ours, cfg, seed=n_mtp_layers)


@pytest.mark.parametrize("n_mtp_layers", [0, 1])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_our_checkpoints_load_into_transformers(tmp_path, n_mtp_layers, dtype):
    cfg = _config(n_mtp_layers)
    ckpt = prepare_checkpoint(tmp_path / "tiny", cfg, dtype=dtype, seed=11)
    reader = open_checkpoint(ckpt)
    tensors = dict(reader.iter_tensors(dequantize=True, dtype=torch.float32))
    assert any(k.startswith("mtp.") for k in tensors) == bool(n_mtp_layers)

    hf = _hf_model(cfg)
    missing, unexpected = hf.load_state_dict(official_to_hf({k: v for k, v in tensors.items() if not k.startswith("mtp.")}), strict=False)
    assert missing == [] and unexpected == []
    ours = DeepseekV4Model(cfg)
    load_into(ours, open_checkpoint(ckpt))
    ours.eval()
    _assert_same_logprobs(hf, ours, cfg, seed=5)
