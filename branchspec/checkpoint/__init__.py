"""Checkpoint folders: reading any supported format, writing branchspec's and Hugging Face's.

Three folder formats are read, told apart by their ``config.json`` (``folder.detect_format``):

- **branchspec**: ``"architecture": "branchspec-v4"`` (or no marker of another format);
  tensors already carry branchspec's names.
- **Hugging Face** (transformers' ``deepseek_v4``): ``"model_type": "deepseek_v4"``. Its
  tensors come in any of three spellings, all read: transformers' module names
  (``model.layers.0.self_attn.q_a_proj.weight``, ``mlp.experts.gate_up_proj``), what
  ``save_pretrained`` writes by default (DeepSeek's names under ``model.``, experts one by
  one, the attention's kv norm as ``attn.norm``), and DeepSeek's own names (hub releases).
- **DeepSeek original** (``inference/model.py``): a config.json of ``ModelArgs`` keys
  (``dim``, ``n_layers``, ...) beside ``model*-mp1.safetensors``-style files.

Weights are ``model.safetensors``, or ``model.safetensors.index.json`` and its shards, or
any ``*.safetensors`` in the folder, opened lazily (``SafetensorsFolder``). Block-FP8
weights (float8_e4m3fn with a ``.scale`` or ``.weight_scale_inv`` companion, one scale
per 128x128 block) are dequantised at load; FP4 expert weights are refused.

The mapping works on plain dicts of tensors (``to_branchspec_tensors``) and on the names
and shapes of branchspec's state_dict (``expected_shapes``, read from a model built on the
meta device), so it needs no weights.
RoPE needs no permutation: HF, DeepSeek and branchspec all rotate the trailing
``rope_dim`` channels in interleaved pairs.

One question per module: ``folder`` (a folder's files and format, the lazy safetensors
reader, all-or-nothing writing), ``hf_config`` and ``deepseek_config`` (a foreign
config.json as ModelConfig; ``foreign_config`` what they share), ``names`` (tensor name
maps and the plan built from them), ``fp8`` (block-FP8 dequantisation), ``schema``
(branchspec's state_dict names and shapes), ``load`` and ``save`` (branchspec's model in
and out), ``export`` (a model as a Hugging Face folder), ``convert`` (folder to folder).
"""

from branchspec.checkpoint.convert import convert_checkpoint, export_hf_folder
from branchspec.checkpoint.export import ExportError, export_hf
from branchspec.checkpoint.folder import CheckpointError, detect_format
from branchspec.checkpoint.load import checkpoint_stop_ids, load_checkpoint, open_checkpoint
from branchspec.checkpoint.save import checkpoint_metadata, save_checkpoint
from branchspec.model.dtypes import resolve_dtype

__all__ = [
    "CheckpointError",
    "ExportError",
    "checkpoint_metadata",
    "checkpoint_stop_ids",
    "convert_checkpoint",
    "detect_format",
    "export_hf",
    "export_hf_folder",
    "load_checkpoint",
    "open_checkpoint",
    "resolve_dtype",
    "save_checkpoint",
]
