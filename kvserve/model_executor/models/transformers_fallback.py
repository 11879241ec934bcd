"""Any transformers causal LM on kvserve's scheduler and paged KV cache (``model_impl``).

The model is transformers' own module (``AutoModelForCausalLM.from_config``, weights read from
the checkpoint's safetensors), with its attention replaced through transformers' attention
interface: ``ATTN_IMPLEMENTATION`` is registered in ``transformers.AttentionInterface`` and set as
the config's ``_attn_implementation``, so every attention module hands its rotated
``query`` ``[1, H, T, D]``, ``key`` / ``value`` ``[1, KH, T, D]`` to ``paged_attention_forward``,
which writes K/V into the paged cache and attends through the step's block tables
(``layers.attention.PagedAttention``, the native families' attention). A step's flattened tokens
run as one batch row ``[1, T]`` with their positions as ``position_ids``; the step's
``AttentionMetadata`` and KV caches reach the attention function through a context variable, the
layer by ``module.layer_idx``. No mask is built (the interface name has no mask function): the
metadata carries each chunk's causal extent.

What the attention function cannot honour is refused at load (``ValueError`` naming the
architecture and the feature): ALiBi, attention-logit soft-capping, cross-attention, encoder-
decoder or non-causal attention, attention sinks, per-layer sliding windows, a model that builds
its own attention mask or does not route attention through the interface, a head that changes
the logits beyond the output projection. A one-step probe at load (two tokens, no cache) checks
the last three and reads the attention shapes (heads, KV heads, head size) the cache is sized by.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from kvserve.model_executor.layers.attention import AttentionMetadata, PagedAttention

#: The ``_attn_implementation`` name under which ``paged_attention_forward`` is registered.
ATTN_IMPLEMENTATION = "kvserve_paged"

#: Attention keyword arguments whose meaning the paged attention cannot reproduce, by feature.
_UNSUPPORTED_KWARGS = {"softcap": "attention-logit soft-capping", "s_aux": "attention sinks"}

#: Config fields (set and not false / zero) that mark a feature the fallback cannot run.
_UNSUPPORTED_CONFIG = (
    ("alibi", "ALiBi position biases"),
    ("use_alibi", "ALiBi position biases"),
    ("attn_logit_softcapping", "attention-logit soft-capping"),
    ("add_cross_attention", "cross-attention"),
    ("is_encoder_decoder", "an encoder-decoder architecture"),
    ("final_logit_softcapping", "final-logit soft-capping"),
)


@dataclass
class _Step:
    """What the attention function needs of the current forward.

    Attributes:
        meta: the step's metadata (``None`` in the load-time probe: plain causal attention).
        kv_caches: one ``[2, KH, num_blocks, block_size, D]`` tensor per layer, or ``None``.
        attention: layer index -> its ``PagedAttention`` (built on the layer's first call).
        calls: the probe's record of each call (layer index, shapes, mask, keyword arguments).
    """

    meta: AttentionMetadata | None
    kv_caches: list[torch.Tensor] | None
    attention: dict[int, PagedAttention]
    calls: list[dict] | None = None


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("kvserve_fallback_step", default=None)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over kvserve's paged KV cache.

    Args:
        module: the calling attention module; ``module.layer_idx`` picks the layer's cache.
        query: ``[1, H, T, D]``; key, value: ``[1, KH, T, D]`` (rotary already applied).
        attention_mask: must be ``None`` (the step's metadata gives each row its keys).
        scaling: softmax scale (``D ** -0.5`` when ``None``).
    Returns:
        ``([1, T, H, D], None)`` in ``query``'s dtype.
    Raises:
        RuntimeError: called outside a ``TransformersForCausalLM`` forward.
    """
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention was called outside a kvserve forward")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(
            f"{type(module).__name__} calls the attention function without an integer layer_idx; "
            "the transformers fallback needs it to pick the layer's KV cache"
        )
    _, H, T, D = query.shape
    KH = key.shape[1]
    scale = float(scaling) if scaling is not None else D**-0.5
    if step.calls is not None:
        step.calls.append(
            dict(
                layer=layer,
                heads=H,
                kv_heads=KH,
                head_dim=D,
                value_dim=value.shape[-1],
                mask=attention_mask is not None,
                causal=getattr(module, "is_causal", True),
                window=kwargs.get("sliding_window", getattr(module, "sliding_window", None)),
                unsupported=[k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None],
            )
        )
    attn = step.attention.get(layer)
    if attn is None or attn.scale != scale:
        attn = step.attention[layer] = PagedAttention(H, KH, D, scale)
    meta = step.meta
    if meta is None:  # the probe: one fresh chunk, no cache
        meta = AttentionMetadata(write_idx=None, num_prefill_tokens=T)
        meta.prefills = [_chunk(T)]
    cache = None if step.kv_caches is None else step.kv_caches[layer]
    out = attn.forward(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cache, meta
    )
    return out.view(1, T, H, D), None


def _chunk(n: int):
    from kvserve.model_executor.layers.attention import PrefillChunk

    return PrefillChunk(start=0, end=n, context_start=0)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def causal_lm_class_name(hf_config, where: str) -> str:
    """The transformers causal-LM class that runs ``hf_config``: its ``architectures`` entry when
    that names a causal LM, else the causal LM of its ``model_type``.

    Raises:
        ValueError: naming ``where`` (the checkpoint's ``config.json``) and the architecture, when
            the checkpoint is no causal LM (an encoder-only, vision, sequence-classification or
            encoder-decoder model) or transformers has no causal LM for its ``model_type``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    named = archs or model_type
    for arch in archs:
        if arch in causal:
            return arch
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"{where}: architecture {named!r} is an encoder-decoder model; the transformers "
            "fallback runs decoder-only causal language models"
        )
    if archs:
        raise ValueError(
            f"{where}: architecture {named!r} has no causal language-model head (an encoder-only, "
            "vision or classification model?); the transformers fallback runs causal language models only"
        )
    if isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    raise ValueError(
        f"{where}: model_type {model_type!r} has no causal language model in transformers; the "
        "transformers fallback runs causal language models only"
    )


def check_config_features(hf_config, where: str) -> None:
    """Refuse configs that ask for an attention or head feature the fallback cannot honour, and
    multimodal ones (a ``vision_config`` / ``audio_config``: their inputs are not text tokens).

    Raises:
        ValueError: naming ``where``, the architecture and the feature.
    """
    arch = causal_lm_class_name(hf_config, where)
    for name, feature in _UNSUPPORTED_CONFIG:
        if getattr(hf_config, name, None):
            raise ValueError(
                f"{where}: {arch} uses {feature} ({name}={getattr(hf_config, name)!r}), which the "
                "transformers fallback's paged attention cannot run"
            )
    for sub in ("vision_config", "audio_config"):
        if getattr(hf_config, sub, None) is not None:
            raise ValueError(
                f"{where}: {arch} is a multimodal model ({sub}); the transformers fallback runs "
                "text-only causal language models (a checkpoint of its text model alone may load)"
            )
    if getattr(hf_config, "is_causal", True) is False:
        raise ValueError(
            f"{where}: {arch} has non-causal attention (is_causal=False); the fallback is causal only"
        )
    if getattr(hf_config, "position_embedding_type", None) in ("alibi",):
        raise ValueError(
            f"{where}: {arch} uses ALiBi position biases, which the transformers fallback cannot run"
        )


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM whose attention runs on kvserve's paged KV cache.

    Exposes what the model runner, the worker and the cache engine read of a native model:
    ``forward(input_ids, positions, kv_caches, meta)``, ``compute_logits``, ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``dtype``, ``layers[i].self_attn`` (heads, KV heads, head size
    for the runner's kernel choice), and the loader's ``weight_target`` / ``check_all_loaded``.

    Args:
        hf_config: the checkpoint's transformers config (its ``_attn_implementation`` is set).
        dtype: parameter and activation dtype; device: ``"cpu"`` / ``"cuda"``.
        max_position: unused (the module's own position tables and rotary cover the config's
            ``max_position_embeddings``, which bounds ``max_model_len``).
        tp: must be ``None``.
        where: the checkpoint, for error messages.

    Raises:
        ValueError: ``tp`` set; an architecture that is no causal LM, or uses a feature the
            paged attention cannot honour (see the module doc), naming the architecture and
            the feature.
    """

    #: The fused CPU decode step (``cpu_decode_step``) runs the native families only: it refuses
    #: a model that says it is this one.
    is_transformers_fallback = True
    use_native_decode = False
    fuse_native_decode = False
    tp = None
    tp_size = 1

    def __init__(self, hf_config, dtype=torch.float32, device="cpu", max_position=None, tp=None, where=""):
        super().__init__()
        from transformers import AutoModelForCausalLM

        where = where or "config.json"
        if tp is not None:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported by the transformers fallback (its modules "
                "are not sharded)"
            )
        self.architecture = causal_lm_class_name(hf_config, where)
        check_config_features(hf_config, where)
        _register()
        self.config = hf_config
        self.dtype = dtype
        hf_config._attn_implementation = ATTN_IMPLEMENTATION
        with torch.device(device):
            self.hf = AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
            ).eval()
        self.hf.requires_grad_(False)
        self.decoder = self.hf.base_model
        head = self.hf.get_output_embeddings()
        if head is None or self.decoder is self.hf:
            raise ValueError(
                f"{where}: {self.architecture} has no separate output projection to compute logits with"
            )
        self.lm_head = head
        self._attention: dict[int, PagedAttention] = {}
        # loading state (``weight_target`` / ``check_all_loaded``): the module's tensors by
        # state-dict key, the keys filled, transformers' renamings and conversions
        self._state: dict[str, torch.Tensor] | None = None
        self._loaded: set[str] = set()
        self._transforms: tuple[list[Any], list[Any]] | None = None
        self._probe(where)

    # ------------------------------------------------------------------ load-time checks
    def _probe(self, where: str) -> None:
        """Run two tokens through the model without a cache: every layer must call the attention
        function once, with one shape, no mask of its own, causal and with none of the
        unsupported keyword arguments; the logits must be the output projection of the last
        hidden states (no extra scaling or soft-capping). Sets the attention shapes."""
        arch = self.architecture
        step = _Step(meta=None, kv_caches=None, attention={}, calls=[])
        ids = torch.tensor([[1, 2]], device=self.lm_head.weight.device)
        pos = torch.tensor([[0, 1]], device=ids.device)
        token = _STEP.set(step)
        try:
            with torch.inference_mode():
                ref = self.hf(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
                calls = list(step.calls or [])
                step.calls = None
                hidden = self.decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
                got = self.compute_logits(hidden)
        finally:
            _STEP.reset(token)
        n = int(getattr(self.config, "num_hidden_layers", 0) or 0)
        layers = sorted(c["layer"] for c in calls if isinstance(c["layer"], int))
        if not calls or layers != list(range(len(calls))) or (n and len(calls) != n):
            raise ValueError(
                f"{where}: {arch} does not route its attention through transformers' attention "
                f"interface once per layer (got {len(calls)} calls for {n} layers), so the "
                "transformers fallback cannot give it a paged KV cache"
            )
        for c in calls:
            if c["mask"]:
                raise ValueError(
                    f"{where}: {arch} builds its own attention mask or bias (ALiBi or a custom "
                    "mask), which the transformers fallback's paged attention cannot apply"
                )
            if not c["causal"]:
                raise ValueError(
                    f"{where}: {arch} has non-causal attention; the transformers fallback is causal only"
                )
            if c["unsupported"]:
                feats = ", ".join(_UNSUPPORTED_KWARGS[k] for k in c["unsupported"])
                raise ValueError(f"{where}: {arch} uses {feats}, which the transformers fallback cannot run")
            if c["value_dim"] != c["head_dim"]:
                raise ValueError(
                    f"{where}: {arch} has value heads of {c['value_dim']} and key heads of "
                    f"{c['head_dim']}; the paged KV cache needs one head size"
                )
        shapes = {(c["heads"], c["kv_heads"], c["head_dim"]) for c in calls}
        if len(shapes) != 1:
            raise ValueError(
                f"{where}: {arch} has layers of different attention shapes {sorted(shapes)}; the "
                "paged KV cache needs one (heads, KV heads, head size) for all layers"
            )
        from kvserve.transformers_utils.hf_config import get_sliding_window

        window = get_sliding_window(self.config)
        windows = {c["window"] or None for c in calls}
        if windows != {window}:
            raise ValueError(
                f"{where}: {arch} has per-layer attention windows {sorted(windows, key=str)}; the "
                f"transformers fallback runs one model-wide window ({window})"
            )
        if not torch.allclose(got, ref, rtol=1e-3, atol=1e-3 * (1 + float(ref.abs().max()))):
            raise ValueError(
                f"{where}: {arch} changes its logits beyond the output projection (a logit scale or "
                "soft-cap), which the transformers fallback does not reproduce"
            )
        ((heads, kv_heads, head_dim),) = shapes
        self.num_layers = len(calls)
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        shape = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
        #: per layer, the attention shape the runner reads (``layers[0].self_attn``)
        self.layers = [SimpleNamespace(self_attn=shape) for _ in range(self.num_layers)]

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids, positions: int64 ``[T]`` (the step's flattened tokens, one batch row).
            kv_caches: one ``[2, kv_heads, num_blocks, block_size, head_dim]`` tensor per layer,
                or ``None`` (no cache: fresh prefills only).
            meta: the step's ``AttentionMetadata``.
        Returns:
            ``[T, hidden_size]`` in the model dtype.
        """
        token = _STEP.set(_Step(meta=meta, kv_caches=kv_caches, attention=self._attention))
        try:
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab_size]`` for hidden states ``[N, hidden_size]``."""
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------ weights
    def _params(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            self._state = dict(self.hf.state_dict(keep_vars=True))
        return self._state

    def _name(self, name: str) -> str | None:
        """The module's state-dict key for checkpoint tensor ``name``, or ``None`` for a tensor
        transformers itself ignores. Legacy names are renamed by the model's own conversion
        mapping (``transformers.conversion_mapping``: GPT-NeoX's ``embed_out`` is its
        ``lm_head``), the base model's prefix added or dropped as needed.

        Raises:
            ValueError: a name the module has no tensor for, or one that transformers converts
                (splits, merges or permutes) rather than renames.
        """
        params = self._params()
        if name in params:
            return name
        renamed, converter = self._rename(name)
        if converter is not None:
            raise ValueError(
                f"weight {name!r} of {self.architecture} needs transformers' weight conversion "
                f"({converter!r}), which the transformers fallback's loader does not apply"
            )
        prefix = self.hf.base_model_prefix
        for cand in (renamed, f"{prefix}.{renamed}", renamed.removeprefix(f"{prefix}.")):
            if cand in params:
                return cand
        ignore = getattr(self.hf, "_keys_to_ignore_on_load_unexpected", None) or ()
        if any(re.search(p, name) for p in ignore):
            return None
        raise ValueError(f"unexpected weight {name!r} for {self.architecture}")

    def _rename(self, name: str) -> tuple[str, str | None]:
        """``name`` after transformers' renamings for this model, and the source pattern of a
        conversion that also matches it (``None``: a plain rename)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        if self._transforms is None:
            transforms = get_model_conversion_mapping(self.hf)
            self._transforms = (
                [t for t in transforms if not isinstance(t, WeightConverter)],
                [t for t in transforms if isinstance(t, WeightConverter)],
            )
        renamings, converters = self._transforms
        return rename_source_key(name, renamings, converters, self.hf.base_model_prefix, self._params())

    def weight_target(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor checkpoint weight ``name`` is read into (``model_loader.read_safetensors_into``).

        Raises:
            ValueError: an unknown name or a shape that differs from the module's.
        """
        key = self._name(name)
        if key is None:
            return None
        t = self._params()[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(shape)}, {self.architecture} expects {tuple(t.shape)}"
            )
        self._loaded.add(key)
        return t.data

    def check_all_loaded(self, loaded) -> None:
        """Raises ValueError naming the module's weights the checkpoint did not hold (a tied
        output projection counts as loaded with the embedding it shares)."""
        params = self._params()
        done = self._loaded
        storages = {params[k].data_ptr() for k in done}
        persistent = set(self.hf.state_dict().keys())
        ignore = getattr(self.hf, "_keys_to_ignore_on_load_missing", None) or ()
        missing = [
            k
            for k in params
            if k in persistent
            and k not in done
            and params[k].data_ptr() not in storages
            and not any(re.search(p, k) for p in ignore)
        ]
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"missing weights for {self.architecture}: {missing[:5]}{more}")
        self._state, self._transforms = None, None
