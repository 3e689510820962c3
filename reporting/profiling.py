"""Where a training step's time goes: ``torch.profiler`` over the last ``profile_steps`` steps of ``dsv4 train``.

Why here and not in a benchmark harness: the step that is measured must be the step users run (optimizer, data
parallel buckets, checks, metrics and all). ``profile_steps=N`` (a training option) profiles the run's last N
steps on global rank 0 and writes ``RUN_DIR/profile/budget.json``: device time per category (forward, backward
and outside the model), the kernels and host synchronisations per step, and the host gaps (step wall time the
device sat idle). ``bench.train_cli --profile N`` reads it into its rows.

How a kernel finds its category, without touching the model code:

* While profiling, every module of the model opens a ``torch.profiler`` range named after its role
  (:func:`module_scope`: ``indexer``, ``compressor``, ``core_attention``, ``router``, ``experts``, ...) on entry
  and closes it on exit (forward hooks). A forward op belongs to its innermost range.
* A backward op runs under autograd's ``evaluate_function: <Node>`` event, whose sequence number is the one the
  forward op that made the node recorded on the forward thread: the backward op takes that forward op's range.
* The trainer opens ``optimizer`` and ``zero_grad`` ranges itself (:func:`scope`; a no-op when not profiling).
* Within a range the op's name refines the row (:func:`category`): the grouped GEMM of the experts, their
  permutation, the custom ops of the kernel backends (``dsv4_triton::sparse_attention_fwd``, ...).

On a GPU a row's time is the summed duration of its CUDA kernels (an op's kernels are linked to it by the
profiler's correlation ids); on the CPU it is the ops' own CPU time, so the same attribution is tested on the CPU.
Compiled blocks (``--compile``) fuse across modules, so a profiled compiled run has no module ranges and rows come
from op names only (``budget.json``'s ``module_scopes`` says which).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from core.atomic import write_text_atomically

RANGE_PREFIX = "dsv4::"
# each profiled step runs inside this range; the host gaps are counted within it (not a module scope)
STEP_RANGE = RANGE_PREFIX + "profiled step"
STEP_START, STEP_END = "step start (host work before the first kernel)", "step end (host work after the last kernel)"
BUDGET_FILE = "budget.json"

# module name (its last dotted component) -> scope; checked in order, first match wins
_MODULE_SCOPES: Tuple[Tuple[str, str], ...] = (
    (r"^indexer$", "indexer"),
    (r"^compressor$", "compressor"),
    (r"^core_attention$", "sparse attention"),
    (r"^self_attention$", "attention"),
    (r"^router$", "moe router"),
    (r"^experts$", "moe experts"),
    (r"^shared_experts$", "moe shared expert"),
    (r"^mlp$", "moe other"),
    (r"hyper_connection$|^mapping_proj$", "mhc"),
    (r"layernorm$|^enorm$|^hnorm$|norm$", "norms"),
    (r"^embedding$", "embedding"),
    (r"^output_layer$", "output head"),
    (r"^(decoder|mtp)$", "mhc (torch ops) and block glue"),
)
_GEMM = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$")
_PERMUTE = re.compile(r"^aten::(sort|argsort|index_select|index_copy_?|index_add_?|searchsorted|gather|scatter"
                      r"|scatter_add_?|index|index_put_?|_index_put_impl_|nonzero|bincount|cumsum)$")
# the project's own Triton kernels, by kernel name (kernels/triton/*): a launch from Python is linked to whatever
# torch op was open when it ran, so their names place them more surely than the op around them
_KERNELS: Tuple[Tuple[str, str], ...] = (
    (r"^(_fwd_kernel|_delta_kernel|_bwd_dq_kernel|_bwd_dkv_kernel)$", "sparse attention (kernel)"),
    (r"^_indexer_kernel$", "indexer"),
    (r"^(_mix_kernel|_pre_fwd_kernel|_pre_bwd_kernel|_dx_kernel|_dfn_kernel|_post_fwd_kernel|_post_bwd_kernel"
     r"|_sinkhorn_fwd_kernel|_sinkhorn_bwd_kernel|_mix_part_kernel|_mix_finish_kernel)$", "mhc"),
    (r"^_adamw_chunks$", "optimizer: adam"),
    (r"^_logprob_(stats|grad)_kernel$", "log-probs (fused with the output head)"),
)
_ACTIVE = False


def kernel_category(kernel: str) -> Optional[str]:
    """The budget row of one of the project's Triton kernels by its name, else None."""
    for pattern, row in _KERNELS:
        if re.match(pattern, kernel):
            return row
    return None


def module_scope(name: str) -> Optional[str]:
    """The profiler scope of a module from its qualified name (``decoder.layers.3.mlp.experts`` -> ``moe
    experts``); None for modules that only group others (layers, ModuleLists, linears inside a scope)."""
    last = name.rsplit(".", 1)[-1]
    for pattern, scope_name in _MODULE_SCOPES:
        if re.search(pattern, last):
            return scope_name
    return None


def category(scope_name: Optional[str], op: str, within: str = "") -> str:
    """The budget row of one op (``op``: the profiler's name, e.g. ``aten::mm``, ``dsv4_triton::hc_pre``) in its
    innermost scope (None: outside the model and the trainer's ranges); ``within``: the names of the ranges
    around it (``Optimizer.step#AdamW.step``, ...), joined."""
    if "sparse_attention" in op:
        return "sparse attention (kernel)"
    if "indexer_scores" in op:
        return "indexer"
    if re.search(r"::(hc_pre|hc_post|hc_head|sinkhorn)", op):
        return "mhc"
    if "::logprob_" in op:
        return "log-probs (fused with the output head)"
    if scope_name == "optimizer":
        if "norm" in op:
            return "optimizer: gradient norm"
        if re.search(r"adam", op + within, re.I):
            return "optimizer: adam"
        if "copy" in op or "_to_copy" in op:
            return "optimizer: master/model copies"
        return "optimizer: other"
    if scope_name == "zero_grad":
        return "zero_grad"
    if scope_name == "gradient accumulation":
        return "gradient accumulation (fp32 main grads)"
    if scope_name == "indexer":
        return "indexer top-k" if re.search(r"topk|sort", op) else "indexer"
    if scope_name == "moe experts":
        if "grouped_mm" in op or _GEMM.match(op):
            return "moe expert GEMMs"
        if re.search(r"::(stack|cat)$", op):
            return "moe expert weight stacking"
        if _PERMUTE.match(op):
            return "moe permute/unpermute"
        return "moe experts elementwise (swiglu, combine)"
    if scope_name in ("attention", "sparse attention"):
        return "attention projections" if _GEMM.match(op) else "attention other (rope, indices, elementwise)"
    if scope_name == "model top":
        return "output head (logits GEMM)" if _GEMM.match(op) else "model glue (embedding mix, heads, casts)"
    if scope_name is None:
        return "outside the model (loss, log-probs, metrics)"
    return scope_name


@contextlib.contextmanager
def scope(name: str):
    """A named range of the trainer's own work (``optimizer``, ``zero_grad``) while a profile runs; else nothing."""
    if not _ACTIVE:
        yield
        return
    with torch.profiler.record_function(RANGE_PREFIX + name):
        yield


class _ModuleRanges:
    """Forward hooks that open a profiler range per scoped module (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.handles = []
        self.open: Dict[int, List[Any]] = defaultdict(list)
        for name, mod in model.named_modules():
            s = module_scope(name) if name else "model top"   # the root: the logits GEMM and the heads' glue
            if s is None:
                continue
            self.handles.append(mod.register_forward_pre_hook(self._enter(RANGE_PREFIX + s)))
            self.handles.append(mod.register_forward_hook(self._exit, always_call=True))

    def _enter(self, label: str):
        def hook(mod, _args):
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            self.open[id(mod)].append(rf)
        return hook

    def _exit(self, mod, _args, _out):
        stack = self.open.get(id(mod))
        if stack:
            stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _innermost_scope(ev) -> Optional[str]:
    e = ev
    while e is not None:
        if e.name.startswith(RANGE_PREFIX) and e.name != STEP_RANGE:
            return e.name[len(RANGE_PREFIX):]
        e = e.cpu_parent
    return None


def _ancestors(ev) -> str:
    names, e = [], ev.cpu_parent
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return "|".join(names)


def _backward_node(ev):
    e = ev
    while e is not None:
        if e.name.startswith("autograd::engine::evaluate_function"):
            return e
        e = e.cpu_parent
    return None


def _is_leaf_op(ev) -> bool:
    """An event whose own time (CPU) or kernels (GPU) count: every op, range and autograd node (a kernel
    launched with no op open is linked to the range or node around it)."""
    return ev.name not in _NOT_OPS


# CUDA runtime notes that the profiler lists among the host events: when the launch queue is full, CUPTI links
# kernels to a "Command Buffer Full" event too, so counting it would count those kernels twice (seen on an H200:
# 4.9 s of "kernels" in a 474 ms step of the unfused optimizer's 91,000 launches)
_NOT_OPS = frozenset({"Command Buffer Full"})


def attribute(events: Iterable, *, device: str) -> Dict[str, Any]:
    """``{rows: {category: {"fwd": us, "bwd": us, "other": us}}, kernels, syncs, busy_us}`` from the profiler's
    function events (``prof.events()``): each op's device time (CUDA: its kernels; CPU: its own CPU time) in
    the row of its scope, backward ops in the scope of the forward op that made their autograd node."""
    events = list(events)
    cpu_ops = [e for e in events if str(getattr(e, "device_type", "")).endswith("CPU")]
    fwd_scope: Dict[Tuple[int, int], Optional[str]] = {}
    for e in cpu_ops:
        seq = getattr(e, "sequence_nr", -1)
        if seq is not None and seq >= 0 and _backward_node(e) is None:
            s = _innermost_scope(e)
            if s is not None or (e.thread, seq) not in fwd_scope:
                fwd_scope[(e.thread, seq)] = s
    rows: Dict[str, Dict[str, float]] = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0, "other": 0.0})
    kernels = 0
    syncs: Dict[str, int] = defaultdict(int)
    top: Dict[Tuple[str, str], float] = defaultdict(float)
    linked: Dict[str, float] = defaultdict(float)
    linked_n: Dict[str, int] = defaultdict(int)
    for e in cpu_ops:
        if not _is_leaf_op(e) or e.name == STEP_RANGE:
            continue
        if _SYNC.search(e.name):     # the host waits for the device here (on the CPU: reads a tensor's value)
            syncs[_row_of(e, fwd_scope)] += 1
            continue
        if device == "cuda":
            timed = [(k.name, float(k.duration)) for k in (getattr(e, "kernels", []) or [])]
            kernels += len(timed)
        else:
            timed = [(e.name, float(e.self_cpu_time_total))]
        timed = [(n, us) for n, us in timed if us > 0]
        if not timed:
            continue
        row, phase = _row_of(e, fwd_scope, with_phase=True)
        for name, us in timed:
            r = kernel_category(name) or row
            rows[r][phase] += us
            linked[name] += us
            linked_n[name] += 1
            top[(r, f"{e.name} > {name}"[:160] if device == "cuda" else name)] += us
    if device == "cuda":
        kernels += _unlinked_kernels(events, linked, linked_n, rows, top)
    busy = _busy_us(events) if device == "cuda" else sum(sum(r.values()) for r in rows.values())
    return {"rows": dict(rows), "kernels": kernels, "syncs": dict(syncs), "busy_us": busy,
            "top": sorted(((r, n, us) for (r, n), us in top.items()), key=lambda t: -t[2])[:40],
            "gaps": host_gaps(events, cpu_ops, fwd_scope) if device == "cuda" else None}


def _unlinked_kernels(events, linked: Dict[str, float], linked_n: Dict[str, int], rows, top) -> int:
    """Count the device time that the profiler linked to no host op (a launch outside any torch op: the
    optimizer's one-pass AdamW was seen so, even inside a ``record_function`` range), kernel by kernel: the time
    of every kernel of a name less what the ops' kernels already hold. The project's own Triton kernels go to
    their kernel category; anything else to :data:`UNLINKED`, named in ``top``, so a budget whose device time
    outgrows its rows says which kernels make the difference."""
    total: Dict[str, float] = defaultdict(float)
    count: Dict[str, int] = defaultdict(int)
    for e in _device_kernels(events):
        total[e.name] += float(e.time_range.end - e.time_range.start)
        count[e.name] += 1
    added = 0
    for name, us in total.items():
        rest = us - linked.get(name, 0.0)
        if rest > 0.01 * us:
            r = kernel_category(name) or UNLINKED
            rows[r]["other"] += rest
            top[(r, f"(no host op) > {name}"[:160])] += rest
            added += max(count[name] - linked_n.get(name, 0), 0)
    return added


# the budget row of device time no host op holds and no kernel category names
UNLINKED = "device time with no host op"


_SYNC = re.compile(r"Synchronize|^aten::_local_scalar_dense$|^cudaMemcpy$")


def _row_of(e, fwd_scope, with_phase: bool = False):
    """The budget row of leaf op ``e`` (and its phase: fwd, bwd, or other for the trainer's own ranges)."""
    node = _backward_node(e)
    s = _innermost_scope(e)
    if node is not None and s is None:
        if "AccumulateGrad" in node.name:
            s = "gradient accumulation"
        else:
            s = fwd_scope.get((getattr(node, "fwd_thread", None) or node.thread, node.sequence_nr))
    name = e.name[len(RANGE_PREFIX):] if e.name.startswith(RANGE_PREFIX) else e.name
    row = category(s, name, _ancestors(e))
    if not with_phase:
        return row
    return row, ("bwd" if node is not None else ("other" if s in ("optimizer", "zero_grad") else "fwd"))


def _device_kernels(events):
    """The profiler's device-side events that are kernels (or copies). A ``record_function`` range, and a custom
    op's name, also appear on the GPU timeline as a *user annotation* spanning the kernels run inside it; counting
    those as kernels counted the whole model twice (seen on an H200: "device time with no host op" 242 ms of a
    182 ms step, ``dsv4::model top`` alone 61 ms) and filled the host gaps inside a range as busy time."""
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CUDA") and not getattr(e, "is_user_annotation", False):
            yield e


def _busy_us(events) -> float:
    """Microseconds in which at least one CUDA kernel ran (the union of their intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in _device_kernels(events))
    busy, end = 0.0, None
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    return busy


def host_gaps(events, cpu_ops, fwd_scope) -> Dict[str, Any]:
    """Where the device sat idle inside the profiled steps (:data:`STEP_RANGE`), and what the host was doing:
    each idle interval between kernels is charged to the budget row (and phase) of the host op that launched
    the kernel ending it (the profiler links a kernel to its launching op by correlation id), so a row's gap
    time is how long the device waited for the host to reach that op: a synchronisation before it, Python
    between launches, a launch queue that ran dry. Idle time before a step's first kernel and after its last
    is :data:`STEP_START` / :data:`STEP_END`. Returns ``{rows: {"row (phase)": us}, largest: [(us, row, op)],
    counted_us}``."""
    windows = sorted((e.time_range.start, e.time_range.end) for e in cpu_ops if e.name == STEP_RANGE)
    launcher = {getattr(e, "id", None): e for e in cpu_ops}
    spans = sorted(((k.time_range.start, k.time_range.end, getattr(k, "linked_correlation_id", 0), k.name)
                    for k in _device_kernels(events)), key=lambda t: t[0])
    rows: Dict[str, float] = defaultdict(float)
    largest: List[Tuple[float, str, str]] = []

    def charge(us: float, row: str, op: str) -> None:
        if us > 0:
            rows[row] += us
            largest.append((us, row, op))

    i = 0
    for w0, w1 in windows:
        while i < len(spans) and spans[i][0] < w0:
            i += 1
        end = w0
        first = True
        while i < len(spans) and spans[i][0] < w1:
            start, stop, corr, name = spans[i]
            if first:
                charge(start - w0, STEP_START, name)
                first = False
            elif start > end:
                op = launcher.get(corr) if corr else None
                row, phase = _row_of(op, fwd_scope, with_phase=True) if op is not None else (UNLINKED, "other")
                charge(start - end, f"{row} ({phase})", f"{op.name if op is not None else '(no host op)'} > {name}")
            end = max(end, stop)
            i += 1
        charge(w1 - end, STEP_END, "")
    largest.sort(key=lambda t: -t[0])
    return {"rows": dict(rows), "largest": largest[:12], "counted_us": sum(rows.values())}


def budget(attributed: Dict[str, Any], *, steps: int, wall_s: float, device: str, module_scopes: bool) -> Dict:
    """The per-step table written to ``budget.json`` (milliseconds per step, largest row first)."""
    per = 1e3 * steps
    rows = []
    total = sum(sum(v.values()) for v in attributed["rows"].values())
    for name, v in attributed["rows"].items():
        t = sum(v.values())
        rows.append({"category": name, "fwd_ms": v["fwd"] / per, "bwd_ms": v["bwd"] / per,
                     "other_ms": v["other"] / per, "total_ms": t / per, "share": t / total if total else 0.0})
    rows.sort(key=lambda r: -r["total_ms"])
    step_ms = 1e3 * wall_s / steps
    busy_ms = attributed["busy_us"] / per
    gaps = attributed.get("gaps")
    gap_rows = {} if not gaps else {
        "host_gaps_by_row": {k: v / per for k, v in sorted(gaps["rows"].items(), key=lambda kv: -kv[1])},
        "host_gaps_counted_ms": gaps["counted_us"] / per,
        "largest_host_gaps": [{"ms": us / 1e3, "row": r, "op": op[:160]} for us, r, op in gaps["largest"]]}
    return {**gap_rows, "device": device, "profiled_steps": steps, "module_scopes": module_scopes,
            # attributed op time over the device's busy time: about 1 when every kernel is counted once
            # (kernels on several streams may overlap and push it above 1)
            "attributed_over_busy": (total / attributed["busy_us"]) if attributed["busy_us"] else None,
            "step_ms": step_ms, "device_busy_ms": busy_ms, "host_gap_ms": max(0.0, step_ms - busy_ms),
            "op_time_ms": total / per, "kernels_per_step": attributed["kernels"] / steps,
            "host_syncs_per_step": sum(attributed["syncs"].values()) / steps,
            "host_syncs_per_step_by_category": {k: v / steps for k, v in sorted(
                attributed["syncs"].items(), key=lambda kv: -kv[1])}, "rows": rows,
            "top_ops": [{"category": r, "name": n, "ms_per_step": us / per} for r, n, us in attributed["top"]]}


class StepProfiler:
    """Profiles steps ``first .. last`` of a run (``profile_steps``) and writes the budget after the last."""

    def __init__(self, model: torch.nn.Module, run_dir: Path, *, first: int, last: int, module_scopes: bool):
        self.model, self.dir = model, Path(run_dir) / "profile"
        self.first, self.last = first, last
        self.module_scopes = module_scopes
        self.device = "cuda" if torch.cuda.is_available() and any(
            p.is_cuda for p in model.parameters()) else "cpu"
        self.prof = None
        self.ranges: Optional[_ModuleRanges] = None
        self.wall = 0.0

    @contextlib.contextmanager
    def step(self, step: int):
        """Profile this step if it is one of the last ``profile_steps``."""
        global _ACTIVE
        if not self.first <= step <= self.last:
            yield
            return
        if self.prof is None:
            self._start()
        _ACTIVE = True
        self._sync()
        t0 = time.perf_counter()
        window = torch.profiler.record_function(STEP_RANGE)    # the host gaps are counted inside it
        window.__enter__()
        try:
            yield
        finally:
            self._sync()
            window.__exit__(None, None, None)
            self.wall += time.perf_counter() - t0
            _ACTIVE = False

    def after_step(self, step: int) -> None:
        """Write the budget after the last profiled step (outside its measured time)."""
        if step == self.last and self.prof is not None:
            self._finish()

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        if self.module_scopes:
            self.ranges = _ModuleRanges(self.model)
        self.prof = profile(activities=acts)
        self.prof.__enter__()

    def _finish(self) -> None:
        self.prof.__exit__(None, None, None)
        if self.ranges is not None:
            self.ranges.remove()
        steps = self.last - self.first + 1
        result = budget(attribute(self.prof.events(), device=self.device), steps=steps, wall_s=self.wall,
                        device=self.device, module_scopes=self.module_scopes)
        result["steps"] = [self.first, self.last]
        self.dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.dir / BUDGET_FILE, json.dumps(result, indent=1) + "\n")
        self.prof = None

    def close(self) -> None:
        """A run that ends before the last profiled step: stop the profiler, write nothing."""
        global _ACTIVE
        _ACTIVE = False
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None
        if self.ranges is not None:
            self.ranges.remove()
            self.ranges = None


def read_budget(run_dir: Path) -> Optional[Dict]:
    p = Path(run_dir) / "profile" / BUDGET_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def format_budget(b: Dict, top: int = 14) -> List[str]:
    """The budget as aligned text lines (the log and the benchmark print these)."""
    lines = [f"step {b['step_ms']:.1f} ms: device busy {b['device_busy_ms']:.1f} ms, host gaps "
             f"{b['host_gap_ms']:.1f} ms, {b['kernels_per_step']:.0f} kernels, "
             f"{b['host_syncs_per_step']:.0f} host syncs per step"]
    lines.append(f"{'category':48s} {'fwd ms':>8s} {'bwd ms':>8s} {'other ms':>8s} {'total':>8s} {'share':>6s}")
    for r in b["rows"][:top]:
        lines.append(f"{r['category']:48s} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['other_ms']:8.2f} "
                     f"{r['total_ms']:8.2f} {r['share']:6.1%}")
    if b.get("host_gaps_by_row"):
        lines.append(f"host gaps ({b['host_gaps_counted_ms']:.1f} ms a step), by the host op that ended them:")
        lines += [f"  {ms:8.2f} ms  {row}" for row, ms in list(b["host_gaps_by_row"].items())[:8]]
    return lines
