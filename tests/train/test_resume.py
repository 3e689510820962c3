"""kill -9 in the middle of a step, then --resume: the following steps' metrics equal those of an
uninterrupted run (same data order, same sampling, no optimizer step lost), for both implementations
(``miles``: BSHD, ``megatron``: THD packed; fp32 GRPO, built from a run config in the training process)."""

import json
import os
import sys

import pytest

from tests.cli_process import run_code

from ._metrics import without_timing

IMPLS = ("miles", "megatron")

CFG = dict(n_layers=3, compress_ratios=(0, 4, 0, 0), n_hash_layers=1)
KW = dict(max_new_tokens=3, prompts_per_step=2, group_size=3, save_every=2, lr=1e-3, export_at_end=False)
SCRIPT = """
import sys
import torch
from core.config import preset
from core.run_config import Choices, normalize
from launchers.builtin_plugins import make_host
from orchestration import run_training
torch.set_num_threads(1)
c = preset("tiny").replace(**{cfg})
rc = normalize(Choices(impl={impl!r}, model=c), make_host(third_party=False), model_name="small")
run_training(rc, c, mode="grpo", steps={steps}, run_dir=sys.argv[1], data=sys.argv[2], resume={resume},
             progress=False, **{kw})
"""


def _data(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"{i}*2=", "reward": {"type": "valid_bytes"}}) + "\n"
                         for i in range(8)))
    return str(p)


def _run(impl, run_dir, data, steps, resume, kill_at=None, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("DSV4_TRAIN_KILL_AT", None)
    if kill_at:
        env["DSV4_TRAIN_KILL_AT"] = kill_at
    code = SCRIPT.format(impl=impl, cfg=CFG, steps=steps, resume=resume, kw={**KW, **kw})
    return run_code(code, [run_dir, data], env=env, timeout=300)


@pytest.mark.parametrize("impl", IMPLS)
def test_kill_mid_step_then_resume_reproduces_the_uninterrupted_run(tmp_path, impl):
    from train.checkpointing import latest_checkpoint
    from reporting.metrics import read_metrics

    data = _data(tmp_path)
    ref = tmp_path / "ref"
    p = _run(impl, ref, data, 4, False)
    assert p.returncode == 0, p.stderr[-3000:]

    run = tmp_path / "run"
    p = _run(impl, run, data, 4, False, kill_at="3:train")     # dies in step 3 after rollout and logprobs
    assert p.returncode == -9, (p.returncode, p.stderr[-3000:])
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert latest_checkpoint(run)[0] == 2
    p = _run(impl, run, data, 4, True)
    assert p.returncode == 0, p.stderr[-3000:]

    got, want = without_timing(read_metrics(run)), without_timing(read_metrics(ref))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got == want
    assert latest_checkpoint(run)[0] == 4


def test_a_kill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path):
    # the checkpoint writer does not depend on the implementation: one is enough
    from train.checkpointing import latest_checkpoint

    data = _data(tmp_path)
    run = tmp_path / "run"
    p = _run("megatron", run, data, 2, False, kill_at="2:checkpoint", save_every=1)
    assert p.returncode == -9
    assert latest_checkpoint(run)[0] == 1
