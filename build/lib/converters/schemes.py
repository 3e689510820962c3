"""Factories of the built-in quantization schemes.

Each factory returns a small object describing its scheme (``name``,
``publish_format``) with the operations that exist in code:

Every scheme satisfies ``core.protocols.Scheme``: ``publish(named_tensors)``
(the bucket the rollout engine loads, in ``publish_format``) and
``prepare_training(model)`` (what the scheme changes in a model that trains
under it: QAT's fake quantization; nothing for the others).

* ``bf16()`` -> :class:`BF16Scheme`: weights are used and published as they are.
* ``fp8()`` -> :class:`FP8Scheme`: ``.publish(named_tensors)`` (128x128 e4m3,
  ue8m0 scales by default), ``.quantize(name, tensor)``.
* ``mxfp4_fp8()`` -> :class:`MXFP4ToFP8Scheme`: ``.prepare(in_dir, out_dir)``
  (the lossless ``prepare-fp8`` conversion, a safe stage) and FP8 ``.publish``.
* ``nvfp4()`` -> :class:`NVFP4Scheme`: ``.publish(named_tensors)`` (routed
  experts only) and ``.fake_quant_experts`` for QAT-style use.
* ``qat()`` -> :class:`QATScheme`: the fake-quant ops (NVFP4 / MXFP4 experts,
  FP8 KV nope dims) and ``.install(model)`` / ``.remove(model)``, which switch a
  built ``miles`` / ``megatron`` model's forward to fake-quant training (routed
  experts and KV nope dims only; straight-through gradients to the bf16/fp32
  master weights). A QAT run publishes the master weights as bf16 (its
  record's ``publish_format``).

Every module is imported lazily so listing plugins never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


class _SchemeBase:
    """What every scheme shares: it publishes in its ``publish_format``, and by default changes nothing in a
    training model (it quantizes at publish or prepare time only; QAT overrides ``prepare_training``)."""

    def publish(self, named_tensors):
        from .publish import publish_bucket
        return publish_bucket(named_tensors, self.publish_format)

    def prepare_training(self, model) -> None:
        return None


@dataclass(frozen=True)
class BF16Scheme(_SchemeBase):
    """bf16 needs no conversion: weights are trained and published as they are."""

    name: str = "bf16"
    publish_format: str = "bf16"


def bf16():
    return BF16Scheme()


@dataclass(frozen=True)
class FP8Scheme(_SchemeBase):
    name: str = "fp8"
    scale_format: str = "ue8m0"          # or "fp32"

    @property
    def publish_format(self) -> str:
        return "fp8" if self.scale_format == "ue8m0" else "fp8-fp32"

    def quantize(self, name, tensor):
        from .fp8_quantizer import quantize_for_publish
        return quantize_for_publish(name, tensor, self.scale_format)


@dataclass(frozen=True)
class MXFP4ToFP8Scheme(FP8Scheme):
    name: str = "mxfp4-fp8"
    prepare_stage: str = "prepare-fp8"

    def prepare(self, in_dir, out_dir, **kw):
        """Lossless MXFP4 -> FP8 conversion of ``in_dir`` into ``out_dir`` (skipped when done)."""
        from .mxfp4_to_fp8 import convert_mxfp4_to_fp8
        return convert_mxfp4_to_fp8(in_dir, out_dir, **kw)


@dataclass(frozen=True)
class NVFP4Scheme(_SchemeBase):
    name: str = "nvfp4"
    publish_format: str = "nvfp4"

    def fake_quant_experts(self, gate, up):
        from .fake_quant import fake_quant_nvfp4_pair
        return fake_quant_nvfp4_pair(gate, up)


@dataclass(frozen=True)
class QATScheme(_SchemeBase):
    name: str = "qat"
    expert_format: str = "mxfp4"          # or "nvfp4"
    kv_block: int = 64
    # the engine runs the trained master weights unquantized
    publish_format: str = "bf16"

    def prepare_training(self, model) -> None:
        """Fake-quant training (:meth:`install`)."""
        self.install(model)

    def fake_quant_expert(self, weight):
        from .fake_quant import fake_quant_mxfp4, fake_quant_nvfp4
        return fake_quant_mxfp4(weight) if self.expert_format == "mxfp4" else fake_quant_nvfp4(weight)

    def fake_quant_kv(self, kv, rope_dim: int = 64):
        from .fake_quant import fake_quant_kv_nope
        return fake_quant_kv_nope(kv, rope_dim, self.kv_block)

    def install(self, model) -> int:
        """Switch ``model`` (an ``nn.Module`` tree) to fake-quant training; returns how many modules it set.

        The switches are attributes the modules read in their forward (default ``None`` = high precision):
        ``qat_expert_format`` on the routed experts (``engine.moe.DSv4GroupedExperts``: their weights are
        quantize-dequantized, ``expert_format``) and ``qat_kv_block`` on the attention modules of both
        implementations (the FP8 1 x ``kv_block`` simulation of the window KV and the main compressor's
        entries, nope dims only). Shared experts, the indexer and every other weight stay high precision.
        Raises ``ValueError`` when the model has no such module (e.g. the reference model)."""
        if self.expert_format not in ("mxfp4", "nvfp4"):
            raise ValueError(f"QAT expert_format {self.expert_format!r}: mxfp4 | nvfp4")
        return self._set(model, self.expert_format, int(self.kv_block))

    def remove(self, model) -> int:
        """Undo :meth:`install` (back to the high-precision forward)."""
        return self._set(model, None, None)

    @staticmethod
    def _set(model, expert_format, kv_block) -> int:
        n = 0
        for m in model.modules():
            if hasattr(type(m), "qat_expert_format"):
                m.qat_expert_format = expert_format
                n += 1
            if hasattr(type(m), "qat_kv_block"):
                m.qat_kv_block = kv_block
                n += 1
        if n == 0:
            raise ValueError(f"{type(model).__name__} has no fake-quant switches (QAT is built for the "
                             f"miles and megatron implementations)")
        return n


def fp8():
    return FP8Scheme()


def mxfp4_fp8():
    return MXFP4ToFP8Scheme()


def nvfp4():
    return NVFP4Scheme()


def qat():
    return QATScheme()
