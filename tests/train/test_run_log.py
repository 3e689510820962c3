"""Readable runs (issue #21, item 7), the trainer's side: the GRPO metric for groups with all-equal rewards,
the step line (brackets kept, seconds per step, time left), ``RUN_DIR/train.log``, and plots whose axes
carry labels with units, with smoothing and panels for grad norm, learning rate and phase times."""

import logging

import pytest
import torch


@pytest.fixture
def console_at_info():
    from reporting import run_log

    run_log.configure_console(logging.INFO)
    yield run_log
    run_log.configure_console(logging.INFO)


def test_zero_variance_group_frac_counts_the_groups_that_give_no_gradient():
    from train.losses import group_advantages, zero_variance_group_frac

    groups = [torch.tensor([1.0, 1.0, 1.0, 1.0]),       # all solved: no signal
              torch.tensor([0.0, 1.0, 0.0, 0.5]),
              torch.tensor([0.25, 0.25, 0.25, 0.25]),   # all equal partial credit: no signal
              torch.tensor([0.0, 0.0, 0.0, 1e-6])]      # one sample differs: a signal
    assert zero_variance_group_frac(groups) == 0.5
    for g in groups:
        flat = bool((g == g[0]).all())
        assert bool((group_advantages(g) == 0).all()) == flat    # exactly the groups without advantage
    assert zero_variance_group_frac([]) == 0.0
    assert zero_variance_group_frac([torch.tensor([3.0])]) == 1.0


def _row(step, **kw):
    row = dict(step=step, loss=0.5, reward_mean=0.25, zero_variance_group_frac=0.5,
               train_rollout_logprob_abs_diff=1e-7, train_rollout_kl=0.0, grad_norm=2.0, tokens_per_s=100.0,
               time_rollout=0.5, time_logprobs=0.25, time_train=1.0, time_update_weights=0.125, time_step=2.0,
               lr=1e-4)
    row.update(kw)
    return row


def test_step_line_keeps_the_phase_timings_and_says_why_a_step_did_not_learn(console_at_info, capsys):
    run_log = console_at_info
    bar = run_log.StepProgress(total=4)
    for step, t in ((1, 9.0), (2, 2.0), (3, 4.0)):   # the first step (warm-up) is left out of the rate
        bar.step(_row(step, time_step=t, zero_variance_group_frac=1.0 if step == 3 else 0.5))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    assert "[rollout 0.50s logprobs 0.25s train 1.00s sync 0.12s]" in err[0]   # not eaten as markup
    assert "zero-var groups 50%" in err[0]
    assert err[0].endswith("9.00 s/step  ETA 0:00:27")                         # 3 steps left at 9 s
    assert err[1].endswith("2.00 s/step  ETA 0:00:04")
    assert err[2].endswith("3.00 s/step  ETA 0:00:03")                         # mean of steps 2 and 3
    assert "zero-var groups 100%  (no learning signal: every group's rewards are equal)" in err[2]


def test_quiet_console_shows_errors_only(capsys):
    from reporting import run_log

    run_log.configure_console(logging.ERROR)
    try:
        run_log.log.info("step 1/1")
        run_log.log.error("boom")
    finally:
        run_log.configure_console(logging.INFO)
    assert capsys.readouterr().err == "error: boom\n"


def test_file_log_holds_the_lines_and_a_failure_on_the_file_only(tmp_path, console_at_info, capsys):
    run_log = console_at_info
    with run_log.file_log(tmp_path):
        run_log.log.info("config: train lr=0.0001")
    with pytest.raises(RuntimeError):
        with run_log.file_log(tmp_path):
            run_log.log.info("step 1/2  [rollout 0.10s]")
            raise RuntimeError("diverged\nsecond line")
    text = (tmp_path / run_log.LOG_FILE).read_text()
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("INFO    config: train lr=0.0001")
    assert lines[1].endswith("step 1/2  [rollout 0.10s]")
    assert lines[2].endswith("ERROR   run failed: RuntimeError: diverged")
    assert "run failed" not in capsys.readouterr().err          # the launcher prints its own error line
    assert not any(isinstance(h, logging.FileHandler) for h in run_log.log.handlers)


def test_plots_have_labelled_axes_smoothing_and_the_new_panels(tmp_path):
    import json

    import matplotlib.pyplot as plt

    from launchers.plot import PHASES, ema, figures, plot_run

    rows = [_row(s, loss=1.0 / s, grad_norm=float(s % 3)) for s in range(1, 13)]
    figs = figures(rows, smoothing=0.6, title="run")
    try:
        assert {"reward_mean", "loss", "grad_norm", "lr", "zero_variance_group_frac", "phase_times",
                "summary"} <= set(figs)
        for name, fig in figs.items():
            for ax in (a for a in fig.axes if a.get_visible()):
                assert ax.get_xlabel().startswith("step"), name
                assert ax.get_ylabel(), (name, ax.get_title())
        assert figs["loss"].axes[0].get_ylabel() == "loss (per response token)"
        assert figs["tokens_per_s"].axes[0].get_ylabel() == "tokens / s"
        phase = figs["phase_times"].axes[0]
        assert phase.get_ylabel() == "seconds"
        assert [t.get_text() for t in phase.get_legend().get_texts()] == [label for _, label in PHASES]
        loss_lines = figs["loss"].axes[0].get_lines()
        assert len(loss_lines) == 2                                   # raw (faint) + smoothed
        assert list(loss_lines[1].get_ydata()) == pytest.approx(ema([1.0 / s for s in range(1, 13)], 0.6))
        panels = [a.get_ylabel() for a in figs["summary"].axes if a.get_visible()]
        assert len(panels) == len(figs) - 1 and "seconds" in panels and "L2 norm" in panels
    finally:
        for fig in figs.values():
            plt.close(fig)
    assert ema([1.0, 0.0], 0.5) == pytest.approx([1.0, 1 / 3])        # debiased: starts at the first value
    raw = figures(rows[:5], smoothing=0.0)
    assert len(raw["loss"].axes[0].get_lines()) == 1
    for fig in raw.values():
        plt.close(fig)

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in plot_run(run)}
    assert {"grad_norm.png", "lr.png", "phase_times.png", "summary.png"} <= names
    assert all((run / "plots" / n).stat().st_size > 0 for n in names)


def _fake_knobs(previous=None):
    """An object shaped like ``triton.knobs`` (its ``runtime.jit_cache_hook``)."""
    import types
    return types.SimpleNamespace(runtime=types.SimpleNamespace(jit_cache_hook=previous))


def _compile(knobs, name):
    """What Triton's JIT does before compiling a kernel it has not compiled in this process: call the hook."""
    import types
    return knobs.runtime.jit_cache_hook(key=(name,), repr=name, fn=types.SimpleNamespace(name=name),
                                        compile={}, is_manual_warmup=False, already_compiled=False)


def test_a_step_counts_the_triton_kernels_it_compiled_and_keeps_an_installed_hook(caplog):
    from reporting import kernel_compiles

    seen = []
    knobs = _fake_knobs(previous=lambda **kw: seen.append(kw["repr"]) or True)
    with caplog.at_level(logging.DEBUG, logger="dsv4"):
        with kernel_compiles.counted("step 4", knobs=knobs) as outer:
            assert _compile(knobs, "_experts_kernel") is True        # the earlier hook's answer is Triton's
            with kernel_compiles.counted(knobs=knobs) as inner:
                _compile(knobs, "_rope_kernel")
        _compile(knobs, "_after_kernel")                             # outside every block: not counted
    assert (outer.count, inner.count) == (2, 1)
    assert outer.metrics() == {"triton_compiles": 2}
    assert seen == ["_experts_kernel", "_rope_kernel", "_after_kernel"]
    assert "step 4: 2 Triton kernel(s) compiled: _experts_kernel, _rope_kernel" in caplog.text
    with kernel_compiles.counted(knobs=knobs) as quiet:
        pass
    assert quiet.metrics() == {"triton_compiles": 0}


def test_without_triton_the_metric_is_absent(monkeypatch):
    import sys

    from reporting import kernel_compiles

    monkeypatch.setitem(sys.modules, "triton", None)                 # import triton fails
    with kernel_compiles.counted() as c:
        pass
    assert not c.enabled and c.metrics() == {}

