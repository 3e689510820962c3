"""Official DeepSeek-V4 checkpoint format: tensor table, codecs, reader/writer.

* :mod:`.official_tensors` - the table of official names / shapes / dtypes.
* :mod:`.formats` - FP8 e4m3 (128x128) and FP4 e2m1 (1x32) codecs, ue8m0 scales.
* :mod:`.io` - validated streaming reader, atomic sharded writer, ``load_into``.
* :mod:`.tiny` - deterministic checkpoints from the table alone.
* :mod:`.tokenizer` - byte-level stand-in tokenizer for tiny checkpoints.
"""

from .errors import CheckpointError
from .io import (
    CheckpointReader, hf_config_for_format, load_into, open_checkpoint, read_safetensors_header,
    weight_format_from_hf_dict, write_checkpoint,
)
from .official_tensors import WEIGHT_FORMATS, TensorSpec, logical_specs, official_tensor_specs, scale_name
from .tiny import prepare_checkpoint
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "CheckpointError", "CheckpointReader", "ByteTokenizer", "TensorSpec", "WEIGHT_FORMATS",
    "hf_config_for_format", "load_into", "load_tokenizer", "logical_specs", "official_tensor_specs",
    "open_checkpoint", "prepare_checkpoint", "read_safetensors_header", "scale_name",
    "weight_format_from_hf_dict", "write_checkpoint",
]
