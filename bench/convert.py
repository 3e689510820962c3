"""Throughput of the quantization converters on synthetic tensors.

    python -m bench.convert --out bench.json [--device cuda] [--size-mb 64] [--min-seconds 0.5]

For each converter it reports ``bytes`` (stored bytes read + stored bytes
written by one call: the memory traffic lower bound), ``seconds`` (median of
the timed repetitions), ``gbps`` (bytes / seconds / 1e9), ``peak_rss_mb``
(process peak resident set after that converter, ``resource.getrusage``) and
on CUDA ``peak_gpu_mb`` and ``frac_of_h200_hbm`` (gbps / 4800, the H200's
4.8 TB/s HBM3e). Prints a rich table and writes a JSON list of objects.
Defaults finish in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List

import torch

H200_HBM_GBPS = 4800.0


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux


def _time(fn: Callable[[], object], device, min_seconds: float, max_reps: int = 50) -> float:
    fn()                       # warm-up (allocator, kernels)
    _sync(device)
    times: List[float] = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cases(device: torch.device, size_mb: float):
    """(name, fn, bytes) for each converter, on ``size_mb`` MiB of logical bf16 weight."""
    from core.checkpoint.formats import fp4_quantize, fp8_block_quantize
    from converters.fake_quant import fake_quant_fp8_act, fake_quant_mxfp4, fake_quant_nvfp4
    from converters.fp8_quantizer import quantize_for_publish
    from converters.fp8_to_bf16 import dequantize_fp8_weight
    from converters.mxfp4_to_fp8 import cast_mxfp4_to_fp8
    from converters.nvfp4 import nvfp4_quantize
    from converters.publish import publish_bucket

    cols = 4096
    rows = max(128, int(size_mb * 2**20 / 2 / cols) // 128 * 128)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16).to(device)
    packed, s4 = fp4_quantize(w)
    q8, s8 = fp8_block_quantize(w)
    w8, t8, _ = cast_mxfp4_to_fp8(packed, s4)
    nv = nvfp4_quantize(w)
    kv = w.view(-1, 512)

    def case(name, fn, inputs, outputs):
        return name, fn, _nbytes(*inputs) + _nbytes(*outputs)

    bucket = [(f"layers.0.ffn.experts.{e}.w{k}.weight", w[e * 128:(e + 1) * 128]) for e in range(rows // 128)
              for k in (1, 3)]
    yield case("mxfp4_to_fp8.cast", lambda: cast_mxfp4_to_fp8(packed, s4), (packed, s4), (w8, t8))
    yield case("fp8_to_bf16.dequant", lambda: dequantize_fp8_weight(q8, s8), (q8, s8), (w,))
    yield case("fp8_quantizer.publish", lambda: quantize_for_publish("layers.0.attn.wq_a.weight", w),
               (w,), (q8, s8))
    yield case("nvfp4.quantize", lambda: nvfp4_quantize(w), (w,), tuple(nv))
    yield case("publish_bucket.nvfp4", lambda: publish_bucket(bucket, "nvfp4"), (w, w), tuple(nv) + tuple(nv))
    yield case("fake_quant.nvfp4", lambda: fake_quant_nvfp4(w), (w,), (w,))
    yield case("fake_quant.mxfp4", lambda: fake_quant_mxfp4(w), (w,), (w,))
    yield case("fake_quant.fp8_kv", lambda: fake_quant_fp8_act(kv), (kv,), (kv,))


def _file_case(device: torch.device, tmp: Path):
    """End-to-end MXFP4 -> FP8 checkpoint conversion of the tiny preset (disk included)."""
    from core.checkpoint import prepare_checkpoint
    from core.config import preset
    from converters.mxfp4_to_fp8 import convert_mxfp4_to_fp8
    src = prepare_checkpoint(tmp / "mx", preset("tiny"), dtype="mxfp4-experts", seed=0, progress=False)
    nbytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    k = [0]

    def run():
        k[0] += 1
        out = convert_mxfp4_to_fp8(src, tmp / f"fp8-{k[0]}", device=device, progress_bar=False, verbose=False)
        return out

    out_bytes = []

    def run_measured():
        out = run()
        out_bytes.append(sum(p.stat().st_size for p in out.glob("*.safetensors")))

    return "mxfp4_to_fp8.checkpoint(tiny)", run_measured, nbytes, out_bytes


def run_bench(device="cpu", size_mb: float = 64.0, min_seconds: float = 0.5, files: bool = True) -> List[dict]:
    import os
    dev = torch.device(device)
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    devname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    results = []

    def record(name, nbytes, secs):
        r = {"converter": name, "device": devname, "bytes": int(nbytes), "seconds": secs,
             "gbps": nbytes / secs / 1e9, "peak_rss_mb": round(_peak_rss_mb(), 1), "date": date}
        if dev.type == "cuda":
            r["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
            r["frac_of_h200_hbm"] = r["gbps"] / H200_HBM_GBPS
        results.append(r)

    for name, fn, nbytes in _cases(dev, size_mb):
        record(name, nbytes, _time(fn, dev, min_seconds))
    if files:
        import os as _os
        os_env = _os.environ.get("DSV4_LOCK_DIR")
        with tempfile.TemporaryDirectory() as d:
            _os.environ["DSV4_LOCK_DIR"] = str(Path(d) / "locks")
            try:
                name, fn, nbytes, out_bytes = _file_case(dev, Path(d))
                secs = _time(fn, dev, min_seconds, max_reps=5)
                record(name, nbytes + (out_bytes[-1] if out_bytes else 0), secs)
            finally:
                if os_env is None:
                    _os.environ.pop("DSV4_LOCK_DIR", None)
                else:
                    _os.environ["DSV4_LOCK_DIR"] = os_env
    return results


def print_table(results: List[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"converter throughput on {results[0]['device'] if results else '?'}")
    for c in ("converter", "MB", "ms", "GB/s", "peak RSS MB"):
        t.add_column(c, justify="left" if c == "converter" else "right")
    gpu = any("frac_of_h200_hbm" in r for r in results)
    if gpu:
        t.add_column("of 4.8 TB/s", justify="right")
    for r in results:
        row = [r["converter"], f"{r['bytes'] / 1e6:.1f}", f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.2f}",
               f"{r['peak_rss_mb']:.0f}"]
        if gpu:
            row.append(f"{100 * r.get('frac_of_h200_hbm', 0):.1f}%")
        t.add_row(*row)
    Console(file=sys.stdout).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--size-mb", type=float, default=64.0, help="logical bf16 MiB per synthetic tensor")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="timed seconds per converter (at least 3 reps)")
    ap.add_argument("--no-files", action="store_true", help="skip the end-to-end checkpoint conversion")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda requested but CUDA is not available")
    results = run_bench(a.device, a.size_mb, a.min_seconds, files=not a.no_files)
    print_table(results)
    Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
