"""The plugin host: built-ins, entry points, validation, isolation, switches."""

import importlib.metadata
import json
import sys
import types

import pytest
from click.testing import CliRunner

from core import plugins as plugins_module
from core.combinations import Combination, InvalidCombination, supported_combinations
from core.hookspecs import ENTRY_POINT_GROUP, hookimpl
from core.plugins import (
    DuplicateBackendError,
    PluginError,
    PluginHost,
    ThirdPartyPluginWarning,
    UnknownBackendError,
)
from core.records import ATTENTION, AXES, HARDWARE, KERNEL, QUANT, ROLLOUT, HardwareTarget, KernelBackend
from core.run_config import Choices, normalize
from launchers.builtin_plugins import BUILTIN_PLUGINS, make_host
from launchers.cli import main

BUILTIN_NAMES = {
    ATTENTION: ["megatron", "miles"],
    KERNEL: ["cuda", "cudnn", "none", "tilelang", "triton"],
    QUANT: ["bf16", "fp8", "mxfp4-fp8", "nvfp4", "qat"],
    HARDWARE: ["cpu", "nvidia", "rocm"],
    ROLLOUT: ["reference", "sglang"],
}


def _module(name, **functions):
    """A plugin module made on the fly and importable by name."""
    module = types.ModuleType(name)
    for fname, fn in functions.items():
        fn.__name__ = fname
        setattr(module, fname, hookimpl(fn))
    sys.modules[name] = module
    return module


class _Dist:
    def __init__(self, name):
        self.name = name


class _EntryPoint:
    """Stands in for importlib.metadata.EntryPoint."""

    def __init__(self, name, module_name, dist, loader=None):
        self.name, self.value, self.dist = name, module_name, _Dist(dist)
        self._loader = loader or (lambda: sys.modules[module_name])
        self.loaded = False

    def load(self):
        self.loaded = True
        return self._loader()


@pytest.fixture
def entry_points(monkeypatch):
    """Replace the entry-point lookup with a list the test fills."""
    registered = []
    real = importlib.metadata.entry_points

    def fake(group=None, **kw):
        if group != ENTRY_POINT_GROUP:  # other libraries (torch) look up their own groups
            return real(group=group, **kw)
        return list(registered)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    monkeypatch.delenv(plugins_module.STRICT_ENV, raising=False)
    monkeypatch.delenv(plugins_module.NO_THIRD_PARTY_ENV, raising=False)
    return registered


def _kernel(name, **kw):
    return KernelBackend(name=name, description="test kernel", factory="kernels.reference.backend:ops", **kw)


def test_builtins_cover_every_axis(entry_points):
    host = PluginHost(BUILTIN_PLUGINS)
    for axis in AXES:
        assert host.names(axis) == BUILTIN_NAMES[axis]
        assert {r.provider for r in host.records(axis)} == {"dsv4"}


def test_plugins_json_lists_every_builtin_with_its_distribution(entry_points):
    result = CliRunner().invoke(main, ["plugins", "--json", "--no-probe"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for axis in AXES:
        assert [e["name"] for e in data[axis]] == BUILTIN_NAMES[axis]
        assert {e["distribution"] for e in data[axis]} == {"dsv4"}
    assert data["skipped_third_party_plugins"] == []


def test_a_misspelled_hook_implementation_is_rejected(entry_points):
    _module("fake_misspelled", dsv4_kernel_backend=lambda: [_kernel("k1")])
    with pytest.raises(PluginError, match="fake_misspelled.*dsv4_kernel_backend"):
        PluginHost(["fake_misspelled"])


def test_a_record_of_the_wrong_type_is_rejected(entry_points):
    _module("fake_wrong_type", dsv4_kernel_backends=lambda: [HardwareTarget(name="x", description="d", factory="a:b")])
    with pytest.raises(PluginError, match="returned HardwareTarget, expected KernelBackend"):
        PluginHost(["fake_wrong_type"])


def test_duplicate_names_are_an_error_naming_both_providers(entry_points):
    _module("fake_dup", dsv4_kernel_backends=lambda: [_kernel("triton")])
    entry_points.append(_EntryPoint("dup", "fake_dup", "evil-kernels"))
    with pytest.raises(DuplicateBackendError) as err:
        PluginHost(BUILTIN_PLUGINS)
    assert str(err.value) == (
        "duplicate kernel_backend 'triton': provided by dsv4 and by evil-kernels (fake_dup); "
        "uninstall one of them or rename the backend"
    )


def test_an_unknown_name_lists_the_valid_choices(entry_points):
    host = PluginHost(BUILTIN_PLUGINS)
    with pytest.raises(UnknownBackendError) as err:
        host.get(QUANT, "fp4")
    assert str(err.value) == "unknown --quant 'fp4'; valid choices: bf16, fp8, mxfp4-fp8, nvfp4, qat. Did you mean 'nvfp4'?"


def _broken_loader():
    raise ImportError("No module named 'some_gpu_lib'")


def test_a_broken_third_party_plugin_is_isolated_with_a_warning(entry_points):
    entry_points.append(_EntryPoint("broken", "broken_plugin", "broken-dist", loader=_broken_loader))
    with pytest.warns(ThirdPartyPluginWarning, match="'broken' .*broken-dist.*some_gpu_lib.*skipped"):
        host = PluginHost(BUILTIN_PLUGINS)
    assert host.names(KERNEL) == BUILTIN_NAMES[KERNEL]
    assert [(s.distribution, err) for s, err in host.skipped] == [("broken-dist", "No module named 'some_gpu_lib'")]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_strict_loading_turns_a_broken_plugin_into_an_error(entry_points, monkeypatch, how):
    entry_points.append(_EntryPoint("broken", "broken_plugin", "broken-dist", loader=_broken_loader))
    kwargs = {}
    if how == "argument":
        kwargs["strict"] = True
    else:
        monkeypatch.setenv(plugins_module.STRICT_ENV, "1")
    with pytest.raises(PluginError, match="broken-dist.*strict plugin loading is on"):
        PluginHost(BUILTIN_PLUGINS, **kwargs)


def test_a_misspelled_third_party_hook_is_isolated(entry_points):
    _module("fake_tp_misspelled", dsv4_kernels=lambda: [])
    entry_points.append(_EntryPoint("typo", "fake_tp_misspelled", "typo-dist"))
    with pytest.warns(ThirdPartyPluginWarning, match="does not exist"):
        host = PluginHost(BUILTIN_PLUGINS)
    assert [s.distribution for s, _ in host.skipped] == ["typo-dist"]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_third_party_plugins_can_be_disabled(entry_points, monkeypatch, how):
    ep = _EntryPoint("k", "fake_never", "never-dist", loader=_broken_loader)
    entry_points.append(ep)
    if how == "argument":
        host = PluginHost(BUILTIN_PLUGINS, third_party=False)
    else:
        monkeypatch.setenv(plugins_module.NO_THIRD_PARTY_ENV, "1")
        host = PluginHost(BUILTIN_PLUGINS)
    assert not ep.loaded
    assert host.names(KERNEL) == BUILTIN_NAMES[KERNEL]


def test_a_third_party_backend_extends_the_table_without_core_edits(entry_points):
    _module("fake_ext", dsv4_kernel_backends=lambda: [_kernel("fast-cpu", hardware={"cpu"}, impls={"miles"})])
    entry_points.append(_EntryPoint("ext", "fake_ext", "fast-cpu-kernels"))
    host = PluginHost(BUILTIN_PLUGINS)
    combos = supported_combinations(host)
    assert Combination("miles", "fast-cpu", "bf16", "cpu", False) in combos
    assert not [c for c in combos if c.kernel_backend == "fast-cpu" and (c.impl, c.hardware) != ("miles", "cpu")]
    assert normalize(Choices(kernel_backend="fast-cpu"), host).selection.kernel.provider == "fast-cpu-kernels"
    with pytest.raises(InvalidCombination) as err:
        normalize(Choices(impl="megatron", kernel_backend="fast-cpu"), host)
    assert str(err.value) == (
        "--kernel-backend fast-cpu does not serve --impl megatron (it serves: miles). "
        "Fix: use --impl miles, or with --impl megatron on cpu choose --kernel-backend none."
    )


# Each job rule and the module it lives in, beside the code it guards (issue #33, item 4).
JOB_RULE_HOMES = {
    "train.rules": ["train-layout", "train-pipeline", "train-context-parallel-thd", "train-cuda-graphs",
                    "packing-thd", "true-on-policy"],
    "rollout.rules": ["rollout-hardware", "rollout-url", "rollout-publish-format", "async-rollout"],
    "orchestration.rules": ["orchestrator-options", "orchestrator-rollout", "rollout-num-gpus", "rollout-num-nodes",
                            "weight-transport-hardware", "weight-transport-placement", "ray-colocate"],
}


def test_the_job_rules_live_beside_their_code_and_join_the_table(entry_points):
    from core.combinations import CAPABILITY_RULES, table_rules

    host = PluginHost(BUILTIN_PLUGINS)
    homes = {}
    for rule in host.job_rules():
        homes.setdefault(rule.check.__module__, []).append(rule.name)
    assert homes == JOB_RULE_HOMES
    assert not {r.check.__module__ for r in CAPABILITY_RULES} - {"core.combinations"}
    jobs = {n for names in JOB_RULE_HOMES.values() for n in names}
    assert not jobs & {r.name for r in CAPABILITY_RULES}
    assert [r.name for r in table_rules(host)] == [*(n for names in JOB_RULE_HOMES.values() for n in names),
                                                   *(r.name for r in CAPABILITY_RULES)]
    # registered through the host: without the rules' plugin module the trainer's layout rule is not in the table
    layout = Choices(tp=2, world=3, job="train", impl="miles")
    with pytest.raises(InvalidCombination, match="3 ranks do not split into --tp 2"):
        normalize(layout, host)
    bare = PluginHost([m for m in BUILTIN_PLUGINS if m != "train.rules"], third_party=False)
    assert normalize(layout, bare).world == 3
    assert [r.name for r in normalize(Choices(), host).rules] == [r.name for r in table_rules(host)]


def test_a_plugin_adds_a_job_rule_and_cannot_take_a_rules_name(entry_points):
    from core.combinations import Rule

    def refuse_fp8(sel, host):
        return "no fp8 here. Fix: use --quant bf16." if sel.quant.name == "fp8" else None

    _module("fake_rule", dsv4_job_rules=lambda: [Rule("site-no-fp8", "this site refuses fp8", refuse_fp8)])
    entry_points.append(_EntryPoint("rule", "fake_rule", "site-rules"))
    host = PluginHost(BUILTIN_PLUGINS, strict=True)
    with pytest.raises(InvalidCombination, match=r"^no fp8 here\. Fix: use --quant bf16\.$"):
        normalize(Choices(quant="fp8"), host)
    for name in ("runnable", "train-layout"):
        _module("fake_rule_dup", dsv4_job_rules=lambda: [Rule(name, "d", refuse_fp8)])
        with pytest.raises(PluginError, match=f"rule '{name}' is already in the combination table"):
            PluginHost([*BUILTIN_PLUGINS, "fake_rule_dup"], third_party=False)
    _module("fake_rule_type", dsv4_job_rules=lambda: [("name", "d", refuse_fp8)])
    with pytest.raises(PluginError, match="returned tuple, expected core.combinations.Rule records"):
        PluginHost(["fake_rule_type"], third_party=False)


def test_make_host_reads_the_environment_switches(entry_points, monkeypatch):
    monkeypatch.setenv(plugins_module.NO_THIRD_PARTY_ENV, "yes")
    monkeypatch.setenv(plugins_module.STRICT_ENV, "1")
    host = make_host()
    assert host.third_party is False and host.strict is True


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
