"""The megatron model as one pipeline stage over rows (``dsv4 train --impl megatron --pp P``).

Why here: the trainer's pipeline (``engine.pipeline``; ``train.model.ImplTrainModel.forward_stage``) runs a
micro-batch's rows ``ids [B, S]`` and sends the mHC streams ``[B, S, hc, d]`` (and, with the MTP loss, the token
embeddings ``[B, S, d]``) between stages, through the row API of the miles model: ``embedding(ids)``,
``hidden_streams(ids, streams=)``, ``model(ids, streams=, return_hidden_streams=True)`` and
``mtp_logits(ids, hidden, embedded=)``. The megatron model runs packed THD streams only; :class:`RowStage` gives it
that row API by packing the rows as the one-stage trainer does (``train.model.pack_rows``: the ``B x S`` tokens in
row order, one segment per row, a row's padding inside its own segment), so a stage runs the ops of the one-rank
run on the same stream, and only reshapes: the stream's ``[T, 1, n, C]`` is the rows' ``[B, S, n, C]``.

The indexer KL loss (``dsa_indexer_loss_coeff``) is not carried between stages: the trainer refuses it with
``--pp`` (``train.config_checks``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RowStage"]


class RowStage:
    """The row API of a pipeline stage over a :class:`backends.megatron.model.DSv4NativeModel` cut to its stage
    (``engine.pipeline.split_stage``). Holds no parameters (the model's names stay the model's)."""

    def __init__(self, model):
        self.model = model
        self.tconfig = model.config              # the stage casts received streams to its params_dtype

    def _layout(self, ids: torch.Tensor):
        """The THD layout of the rows ``ids [B, S]``: one segment of ``S`` tokens per row."""
        B, S = ids.shape
        cu = torch.arange(B + 1, dtype=torch.int64, device=ids.device) * S
        return self.model.layout_for(ids.reshape(-1), cu)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, S]`` -> the token embeddings ``[B, S, C]``."""
        return self.model.embedding(ids.reshape(1, -1), position_ids=None).reshape(*ids.shape, -1)

    def _trunk(self, ids: torch.Tensor, streams: Optional[torch.Tensor]):
        """This stage's layers over the rows: ``(streams [T, 1, n, C], layout)``; ``streams [B, S, n, C]``: the
        previous stage's (None: from the embedding)."""
        x = None if streams is None else streams.reshape(-1, 1, *streams.shape[2:])
        layout = self._layout(ids)
        h, _kl, layout = self.model.hidden_streams(ids.reshape(-1), layout=layout, streams=x)
        return h, layout

    def hidden_streams(self, ids: torch.Tensor, streams: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The streams after this stage's layers, ``[B, S, n, C]``."""
        h, _layout = self._trunk(ids, streams)
        return h.reshape(*ids.shape, *h.shape[2:])

    def __call__(self, ids: torch.Tensor, streams: Optional[torch.Tensor] = None, return_hidden_streams: bool = False):
        """The last stage: fp32 logits ``[B, S, V]`` (and the final streams, opaque: what :meth:`mtp_logits`
        takes)."""
        m = self.model
        h, layout = self._trunk(ids, streams)
        logits = m._logits(m.decoder.collapse(h)[:, 0]).reshape(*ids.shape, -1)
        return (logits, (h, layout)) if return_hidden_streams else logits

    def mtp_logits(self, ids: torch.Tensor, hidden, embedded: torch.Tensor) -> list:
        """Per MTP depth ``k``: ``[B, S-1-k, V]`` (row ``i`` predicts ``ids[:, i+k+2]``), from the final streams
        of :meth:`__call__` and the embeddings ``embedded [B, S, C]`` of ``ids`` (sent by stage 0)."""
        h, layout = hidden
        B, S = ids.shape
        raw = self.model.mtp_from_streams(ids.reshape(-1), h, layout, embedded.reshape(B * S, 1, -1))
        return [lg.reshape(B, S - 1 - k, -1) for k, (lg, _cu) in enumerate(raw)]
