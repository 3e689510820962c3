"""Every built-in record's factory fits its axis's protocol (core/protocols.py); every hook and record is
documented; the table is honest about what cannot run; the assembly is the only caller of record.load()."""

import ast
import inspect
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from core import hookspecs
from core.combinations import supported_combinations
from core.protocols import FACTORY_PROTOCOLS, KernelOps, Scheme, Target
from core.records import AXES, AXIS_OPTION, KERNEL
from launchers.builtin_plugins import make_host
from launchers.cli import main

ROOT = Path(__file__).resolve().parents[1]
HOST = make_host(third_party=False)
RECORDS = [r for axis in AXES for r in HOST.records(axis)]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r.axis}:{r.name}")
def test_factory_fits_its_protocol(record):
    factory = record.load()
    loaded_protocol, made_protocol = FACTORY_PROTOCOLS[record.axis]
    if loaded_protocol is not None:
        assert isinstance(factory, loaded_protocol)
        params = inspect.signature(factory).parameters
        wanted = {"ops", "params_dtype"} if record.axis == "attention_impl" else {"config"}
        assert wanted <= set(params), f"{record.name}: factory parameters {list(params)} lack {wanted - set(params)}"
        return
    if record.not_runnable is not None or record.unavailable_reason() is not None:
        pytest.skip(f"{record.name} cannot be built on this machine: "
                    f"{record.not_runnable or record.unavailable_reason()}")
    handle = factory()
    assert isinstance(handle, made_protocol), f"{record.name}: {type(handle).__name__} is not a {made_protocol.__name__}"


def test_the_cpu_built_handles_are_what_they_claim():
    from core.kernel_ops import OP_NAMES

    ops = HOST.get(KERNEL, "none").load()()
    assert isinstance(ops, KernelOps) and ops.backend == "none" and ops.dtypes is None
    assert set(OP_NAMES) <= set(ops.names()) and set(ops.provider.values()) == {"none"}
    assert isinstance(HOST.get("hardware_target", "cpu").load()(), Target)
    for name in ("bf16", "fp8", "mxfp4-fp8", "nvfp4", "qat"):
        scheme = HOST.get("quant_scheme", name).load()()
        assert isinstance(scheme, Scheme)
        assert scheme.publish_format == HOST.get("quant_scheme", name).publish_format


def test_a_rules_only_target_does_not_pass_for_a_runnable_one():
    """rocm declares rules only: its target has no setup or process groups, and its record says so."""
    rocm = HOST.get("hardware_target", "rocm")
    assert rocm.not_runnable and not isinstance(rocm.load()(), Target)


def test_every_hook_and_record_is_documented():
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    for hook in [*hookspecs.HOOK_AXIS, hookspecs.RULES_HOOK]:
        assert (getattr(hookspecs, hook).__doc__ or "").strip(), f"hook {hook} has no docstring"
        assert f"`{hook}`" in docs, f"hook {hook} appears nowhere in README.md or docs/"
    for record in RECORDS:
        assert record.description.strip(), record.name
        assert f"`{record.name}`" in docs or f"{AXIS_OPTION[record.axis]} {record.name}" in docs, \
            f"{record.axis} {record.name!r} appears nowhere in README.md or docs/"


def test_plugins_json_marks_what_cannot_run_and_why():
    out = CliRunner().invoke(main, ["plugins", "--json", "--no-probe", "--no-third-party-plugins"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    entries = {(axis, e["name"]): e for axis in AXES for e in data[axis]}
    for key in (("kernel_backend", "cudnn"), ("hardware_target", "rocm")):
        assert entries[key]["runnable"] is False and entries[key]["not_runnable_reason"], key
    assert all(e["runnable"] for k, e in entries.items() if k not in (("kernel_backend", "cudnn"),
                                                                      ("hardware_target", "rocm")))
    names = {(c.kernel_backend, c.hardware) for c in supported_combinations(HOST)}
    assert not any(k == "cudnn" or h == "rocm" for k, h in names), "a not-runnable record has a test row"


def _load_calls(path: Path) -> list[int]:
    """Lines of ``<record>.load()`` calls: no arguments, on an expression naming a record or a selection."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "load"
            and not n.args and not n.keywords
            and any(word in ast.unparse(n.func.value).lower() for word in ("record", "selection"))]


def test_the_assembly_is_the_only_product_caller_of_record_load():
    product = [p for pkg in ("core", "backends", "kernels", "converters", "engine", "train", "launchers", "bench")
               for p in (ROOT / pkg).rglob("*.py")]
    callers = {str(p.relative_to(ROOT)): lines for p in product if (lines := _load_calls(p))}
    assert set(callers) == {"core/assembly.py"}, callers


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
