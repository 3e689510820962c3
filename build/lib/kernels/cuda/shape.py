"""The attention shape the `cuda` backend's sparse-attention kernel is built for (one place: the plugin record
and the entry points' checks read it; the kernel's own launcher checks the same numbers)."""

HEAD_DIM = 512     # q / kv head dim (K = V): DeepSeek-V4-Flash and -Pro
HEAD_TILE = 64     # query heads per kernel tile (one wgmma M tile); the heads must be a multiple of it
