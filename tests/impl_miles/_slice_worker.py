"""Worker of test_hf_slices.py: one gloo rank of a tp=world miles model loading HF checkpoints twice, by the
old path (whole tensors read, then sliced: ``engine.loading.load_hf_state_dict``) and by the sliced reader
(``engine.loading.load_hf_checkpoint``), counting the bytes each path pulls out of safetensors."""

from __future__ import annotations

import torch


class _Counter:
    """Wraps ``safe_open`` in a module: counts the bytes of every tensor and slice read through it."""

    def __init__(self, module):
        self.module, self.real, self.bytes = module, module.safe_open, 0

    def __enter__(self):
        counter = self

        class Slice:
            def __init__(self, s):
                self.s = s

            def __getitem__(self, index):
                t = self.s[index]
                counter.bytes += t.numel() * t.element_size()
                return t

        class File:
            def __init__(self, *a, **k):
                self.f = counter.real(*a, **k)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def get_tensor(self, name):
                t = self.f.get_tensor(name)
                counter.bytes += t.numel() * t.element_size()
                return t

            def get_slice(self, name):
                return Slice(self.f.get_slice(name))

        self.module.safe_open = File
        return self

    def __exit__(self, *exc):
        self.module.safe_open = self.real
        return False


def run(rank: int, world: int, port: int, cases: list, out_path: str) -> None:
    """``cases``: ``[(label, checkpoint folder, ModelConfig)]``. Saves, per case: whether every tensor equals
    the old path's, the bytes each path read, and (to account for them) the stored bytes of the official
    tensors this rank's model slices and of those it holds whole."""
    from backends.cpu.megatron_shims import destroy_cpu_process_group
    from backends.cpu.target import CpuTarget

    torch.set_num_threads(1)
    CpuTarget().init_process_group(rank, world, tp=world, port=port)
    try:
        import core.checkpoint.io as ckio
        import core.checkpoint.slices as ckslices
        from core.assembly import assemble
        from core.checkpoint import open_checkpoint
        from core.checkpoint.official_tensors import scale_name
        from core.run_config import Choices, normalize
        from core.weight_contract import native_to_official_names
        from engine.loading import load_hf_checkpoint, load_hf_state_dict, native_tensors
        from engine.tp import tp_spec
        from launchers.builtin_plugins import make_host

        out = {}
        for label, folder, cfg in cases:
            run_cfg = normalize(Choices(impl="miles", tp=world, hardware="cpu", model=cfg),
                                make_host(third_party=False), model_name="tiny")
            m = assemble(run_cfg).build_model(cfg)
            reader = open_checkpoint(folder)
            with _Counter(ckio) as old_bytes:
                load_hf_state_dict(m, reader.iter_tensors(dequantize=True, dtype=torch.float32, progress=False), cfg)
            old = {n: t.detach().clone() for n, t in native_tensors(m).items()}
            for t in native_tensors(m).values():                 # the new path must fill every element
                t.data.fill_(float("nan") if t.is_floating_point() else -1)
            with _Counter(ckslices) as new_bytes:
                load_hf_checkpoint(m, folder, cfg)
            new = native_tensors(m)
            differ = sorted(n for n, t in old.items() if not torch.equal(t, new[n]))

            stored = {n: e.offsets[1] - e.offsets[0] for hdr in reader.headers.values() for n, e in hdr.items()}
            sliced = set()
            for n, t in new.items():
                if tp_spec(t) is not None:
                    for o in native_to_official_names(n, cfg):
                        sliced.add(o)
                        if o.endswith(".weight") and scale_name(o) in stored:
                            sliced.add(scale_name(o))
            out[label] = {"differ": differ, "old_bytes": old_bytes.bytes, "new_bytes": new_bytes.bytes,
                          "sliced_bytes": sum(stored[n] for n in sliced),
                          "whole_bytes": sum(b for n, b in stored.items() if n not in sliced)}
        torch.save(out, f"{out_path}.{rank}")
    finally:
        destroy_cpu_process_group()
