"""SFT on the built-in task lowers the loss over a few dozen steps, for both implementations (``miles``:
BSHD, ``megatron``: THD packed; fp32, built from a run config); the last step's checkpoint, and none with
``save_at_end=False``."""

import math

import pytest


@pytest.mark.parametrize("impl", ("miles", "megatron"))
def test_sft_lowers_the_loss_on_the_builtin_data(tmp_path, impl):
    from core.config import preset
    from core.run_config import Choices, normalize
    from launchers.builtin_plugins import make_host
    from reporting.metrics import read_metrics
    from orchestration import run_training

    c = preset("tiny").replace(n_layers=2, compress_ratios=(0, 0, 0), n_hash_layers=1)
    rc = normalize(Choices(impl=impl, model=c), make_host(third_party=False), model_name="small")
    # 15 steps: the mean of the last three losses is 0.39 of the first three's for both implementations (0.34-0.36
    # after 30 steps, which this ran before; 0.43 after 10), against the bound of 0.6
    run_training(rc, c, mode="sft", steps=15, run_dir=tmp_path / "run", batch_size=8, lr=2e-3,
                 save_every=100, save_at_end=impl == "miles", export_at_end=False, mtp_coef=0.3, progress=False)
    rows = read_metrics(tmp_path / "run")
    # save_every=100 is past the run: the one checkpoint is the last step's, and save_at_end=False skips it
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == (["step_000015"] if impl == "miles" else []), saved
    assert len(rows) == 15
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    assert rows[0]["reward_mean"] is None and rows[0]["time_rollout"] == 0.0
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 5.0                  # ~log(1024) for an untrained model
    assert last < 0.6 * first, (first, last)


def test_builtin_data_file_is_the_generator_output_and_validates():
    import json

    import pytest

    from train import data as D

    rows = [json.loads(x) for x in D.BUILTIN_DATA.read_text().splitlines()]
    assert rows == [json.loads(json.dumps(r, sort_keys=True)) for r in D.make_arith_examples()]
    for mode in ("sft", "grpo"):
        assert len(D.load_data(None, mode)) == D.BUILTIN_SIZE
    ex = D.load_data(None, "grpo")[0]
    assert ex.response == "77" and ex.reward["type"] == "char_closeness"
    assert D.compute_reward(ex.response, [57, 57], ex.reward) == 1.0
    # "770" for "77" (ids 57 57 50, no stop at 2 tokens): both positions exact -> 0.8 x 1
    assert D.compute_reward("770", [57, 57, 50], ex.reward) == pytest.approx(0.8)
    # "6" then eos for "77": 1 - 1/128 at the first position, nothing at the second -> 0.8 x (127/128) / 2
    assert D.compute_reward("6", [56], ex.reward) == pytest.approx(0.8 * (127 / 128) / 2)
    # "76" then eos: right length (0.2) + (1 + 127/128) / 2 x 0.8
    assert D.compute_reward("76", [57, 56], ex.reward) == pytest.approx(0.2 + 0.8 * (1 + 127 / 128) / 2)
    # padding ids (>= 258) are far from every byte: no credit
    assert D.compute_reward("", [900, 900], ex.reward) == pytest.approx(0.2)
    assert D.compute_reward("", [900, 900, 900], ex.reward) == 0.0
    assert D.compute_reward("\x00", [], {"type": "exact_match", "answer": "77"}) == 0.0


def test_bad_data_is_reported_with_file_and_line(tmp_path):
    import pytest

    from train import data as D

    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    with pytest.raises(D.DataError, match=r"d.jsonl:2"):
        D.load_jsonl(p)
    p.write_text('{"prompt": "a"}\n')
    with pytest.raises(D.DataError, match=r"d.jsonl:1: SFT data needs a 'response'"):
        D.load_jsonl(p, "sft")
    p.write_text('{"prompt": "a", "reward": {"type": "nope"}}\n')
    with pytest.raises(D.DataError, match="unknown reward type"):
        D.load_jsonl(p)


def test_tokenization_of_the_byte_tokenizer():
    from core.checkpoint import ByteTokenizer
    from train import data as D

    tok = ByteTokenizer(1024)
    assert D.encode_prompt(tok, "1+1=") == [0, 51, 45, 51, 63]
    assert D.encode_response(tok, "2") == [52, 1]
    assert D.decode_response(tok, [52, 1, 53]) == "2"
    assert D.decode_response(tok, [52, 900, 53]) == "23"       # padding ids are dropped
