"""Programmatic dependent launch of the triton kernels (``kernels/triton/pdl.py``), read from their sources (no
triton needed: the CPU suite runs it): every kernel that takes the ``PDL`` flag waits for the kernels before it
first thing, and every launch that asks for PDL launches such a kernel; the decode step's kernels are among them."""

import ast
from pathlib import Path

TRITON_DIR = Path(__file__).resolve().parents[2] / "kernels" / "triton"


def _jit_kernels(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                (isinstance(d, ast.Attribute) and d.attr == "jit") or
                (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "jit")
                for d in node.decorator_list):
            yield node


def _takes_pdl(fn: ast.FunctionDef) -> bool:
    return any(a.arg == "PDL" for a in fn.args.args + fn.args.kwonlyargs)


def _first_statement(fn: ast.FunctionDef):
    body = fn.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if docstring and len(body) > 1 else body[0]


MEMORY = ("load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min", "atomic_and",
          "atomic_or", "atomic_xor", "inline_asm_elementwise", "last_ticket", "release")


def _touches_memory(node, helpers: dict, seen=()) -> bool:
    """Whether the expression ``node`` loads, stores or takes a ticket, following the calls of this file's jit
    helpers (``helpers``: name -> FunctionDef)."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if name in MEMORY:
            return True
        if name in helpers and name not in seen and _touches_memory(helpers[name], helpers, seen + (name,)):
            return True
    return False


def _waits_first(fn: ast.FunctionDef, helpers: dict) -> bool:
    """The kernel's first statement is ``pdl.wait_prior(PDL)``, or ``pdl.wait_prior_after_prefetch(PDL, PREFETCH,
    lines)`` whose ``lines`` are pointer arithmetic (no load, store or ticket on the way)."""
    first = _first_statement(fn)
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)):
        return False
    call = ast.unparse(first.value)
    if call == "pdl.wait_prior(PDL)":
        return True
    args = first.value.args
    return (ast.unparse(first.value.func) == "pdl.wait_prior_after_prefetch" and len(args) == 3
            and [ast.unparse(a) for a in args[:2]] == ["PDL", "PREFETCH"] and not _touches_memory(args[2], helpers))


def test_every_kernel_with_the_flag_waits_first_and_every_pdl_launch_has_the_flag():
    """Read from the sources of ``kernels/triton``: a kernel that takes ``PDL`` calls ``pdl.wait_prior(PDL)`` before
    anything else (a load before it could read what the kernel before has not written yet; the one thing allowed
    ahead of the wait is an L2 prefetch of pointers computed without touching memory), and a launch that passes
    ``**pdl.launch(...)`` launches such a kernel."""
    with_flag, launched = set(), {}
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        helpers = {fn.name: fn for fn in _jit_kernels(tree)}
        for fn in _jit_kernels(tree):
            if not _takes_pdl(fn) or fn.name in ("wait_prior", "wait_prior_after_prefetch"):
                continue
            with_flag.add(fn.name)
            assert _waits_first(fn, helpers), (path.name, fn.name, ast.unparse(_first_statement(fn)))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)
                    and any(k.arg is None and "pdl.launch" in ast.unparse(k.value) for k in node.keywords)):
                launched[node.func.value.id] = path.name
    assert launched and with_flag
    assert not set(launched) - with_flag, {k: launched[k] for k in set(launched) - with_flag}
    # the decode step's kernels of one sequence that runs (mHC, projections, norms, router, compressors, indexer
    # picks, sampler) are among them
    assert {"_linear_group_kernel", "_grouped_kernel", "_pre_norm_kernel", "_post_fwd_kernel", "_norm_rope_kernel",
            "_route_part_kernel", "_compress_kernel", "_decode_topk_kernel",
            "_draw_kernel"} <= set(launched)
