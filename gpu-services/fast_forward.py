"""The torch engine's forward for dense Qwen3-family text models.

Why not the model's own forward? At the sizes the engine serves on CPU it is not the arithmetic that costs:
- the tiny model's decode step spent ~3/4 of its time in Python (module calls, mask building, kwargs plumbing);
- a left-padded prefill runs every linear layer over the padding too (a third of the work for prompts of 8-24 ids).
This forward calls the model's own norm and MLP modules and its weights, and runs the linear layers over real tokens
only. A decode step writes its keys and values in place into spare columns of the layer's cache (`append`), not
through DynamicLayer's torch.cat of the whole cache, which at 64 rows cost ~2/3 of the attention itself; attention
runs over the whole buffer with the spare columns masked out (SDPA copies a view of the used columns, not being
contiguous, at the cost of the cat; two matmuls over such views were slower still: measured). Anything else (MoE
routers, vision towers, sliding windows) keeps the model's forward: `supports` says which.

On CPU in fp32 its larger GEMMs are oneDNN's over weights reordered once into its blocked layout: the 33.7M model's
decode GEMMs ran 1.6-2x faster than F.linear (MKL's sgemm) at 2-64 rows on this machine's AMD EPYC, and no slower at
1; under 2^17 weights MKL's smaller cost per call wins (measured). The reordered copies (and the q/k norm weights
concatenated per layer) are derived from the weights on first use: after new weights land, `forget` must drop them.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from weight_transfer import span


PACK_MIN = 1 << 17  # oneDNN's call costs ~15 us more than MKL's: on smaller weights (the tiny model's) F.linear won,
PACK_ROWS = 512  # except over this many rows and more (a prefill): there oneDNN was 1.2-1.4x faster on them too


def supports(model) -> bool:
    config = model.config
    return (type(model).__name__ == "Qwen3ForCausalLM" and config.get_text_config() is config
            and all(layer.self_attn.q_norm.variance_epsilon == layer.self_attn.k_norm.variance_epsilon
                    for layer in model.model.layers)
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
            and "dynamic" not in model.model.rotary_emb.rope_type and model.model.rotary_emb.rope_type != "longrope")


def fuse(model) -> None:
    """Make each layer's q/k/v weights (and gate/up) row slices of one tensor, so one GEMM serves them. Call before
    taking the model's state_dict: weight updates copy into those slices, so the fused tensors stay current."""
    weight = model.lm_head.weight
    model.fast_pack = (weight.device.type == "cpu" and weight.dtype == torch.float32
                       and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    forget(model)
    model.fast_rope = rope_table(model)  # from the config alone: kept across weight updates
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv = share(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp.gate_up = share(mlp.gate_proj, mlp.up_proj)


def share(*linears: torch.nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    weight, bias = joined([lin.weight for lin in linears]), None
    if linears[0].bias is not None:
        bias = joined([lin.bias for lin in linears])
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.weight.shape[0])
        lin.weight = torch.nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
        start = rows.stop
    return weight, bias


def forget(model) -> None:
    """Drop what was derived from the weights (call after new weights are copied in)."""
    model.fast_derived = {}


def derived(model, key, make):
    """make(), kept in the model until `forget`; key names it."""
    if key not in model.fast_derived:
        model.fast_derived[key] = make()
    return model.fast_derived[key]


def linear(model, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if not model.fast_pack or (weight.numel() < PACK_MIN and len(x) < PACK_ROWS):
        return F.linear(x, weight, bias)
    # the layout's batch-size hint: packed for 16, 64 or 1024 rows ran alike at 8-256 rows (measured)
    packed = derived(model, id(weight), lambda: torch.ops.mkldnn._reorder_linear_weight(weight, 64))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors stacked along dim 0: a view when they already lie back to back (weight_transfer.flatten), so the
    weights stay where a transfer writes them; else a copy."""
    flat = span([t.detach() for t in tensors])
    if flat is None:
        return torch.cat([t.detach() for t in tensors])
    return flat.view(tensors[0].dtype).view(-1, *tensors[0].shape[1:])


SPARE = 8  # columns a full cache grows by: a copy of the cache every 8 decode steps, ~4 masked columns attended


def grown(buffer: torch.Tensor, columns: int) -> torch.Tensor:
    """buffer [B, heads, W, D] copied into a new one of `columns` columns, the new ones zero. Not F.pad, which zeroed
    every column before copying the old ones over (~3% of the 33.7M model's decode at 64 rows). The spare columns must
    be finite even though masked: a NaN key would make its score NaN whatever the mask adds."""
    out = buffer.new_empty(*buffer.shape[:2], columns, buffer.shape[3])
    out[:, :, :buffer.shape[2]] = buffer
    out[:, :, buffer.shape[2]:] = 0
    return out


def append(kv, keys: torch.Tensor, values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write keys/values [B, heads, T, D] at columns [width - T, width) of the layer's cache (the columns past width
    are spare) and return its buffers [B, heads, >= width, D]."""
    if not kv.is_initialized:  # a prefill's fresh cache
        return kv.update(keys, values)
    if kv.keys.shape[2] < width:
        kv.keys, kv.values = grown(kv.keys, width + SPARE), grown(kv.values, width + SPARE)
    kv.keys[:, :, width - keys.shape[2]:width] = keys
    kv.values[:, :, width - keys.shape[2]:width] = values
    return kv.keys, kv.values


def rms_norm(norm, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Qwen3RMSNorm, inline (a module call per norm was a tenth of the tiny model's decode step): x * rsqrt(mean(x^2) +
    eps) in float32, by F.rms_norm (the same bits on CPU, measured: one call from Python instead of six), times the
    weight, which may be per head [heads, D] (the q/k norms at once)."""
    h = F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon)
    return (norm.weight if weight is None else weight) * h.to(x.dtype)


def rope_table(model) -> torch.Tensor:
    """[max positions, 2, D]: cos and sin of every position, from the model's rotary module once (its arithmetic is per
    position, so a row is what it computes per step; `supports` leaves out the rope types that rescale with length),
    the sin with rotate_half's sign folded in: x * cos + rotate_half(x) * sin = x * cos + roll(x, D/2) * signed sin."""
    inner = model.model
    positions = torch.arange(model.config.max_position_embeddings, device=inner.embed_tokens.weight.device)
    cos, sin = inner.rotary_emb(inner.embed_tokens.weight, positions[None])  # [1, P, D]
    half = sin.shape[-1] // 2
    return torch.stack([cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)], dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, as transformers' apply_rotary_pos_emb: x [N, heads, D], cos/sin [N, 1, D] (rope_table rows)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for one new query per row, as two batched matmuls: q [B, heads, 1, D],
    keys/values [B, kv_heads, S, D], mask [B, 1, 1, S] additive. On CPU, SDPA's flash kernel took 1.4-1.6x as long
    for a decode step's shapes (64 rows, 16 heads x 32, 48-200 keys; measured); it was 13% of a 33.7M round at 64 rows.
    Grouped-query heads read their shared kv head through a view, not a copy: head h reads kv head h // (heads /
    kv_heads), as SDPA's enable_gqa and transformers' repeat_kv."""
    B, H, _, D = q.shape
    q = q.reshape(B, keys.shape[1], -1, D)  # [B, kv_heads, heads per kv head, D]
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).add_(mask)  # [B, kv_heads, group, S]
    return torch.matmul(scores.softmax(dim=-1), values).view(B, H, 1, D)


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, real: Optional[torch.Tensor], cache: DynamicCache,
            attn_mask: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] at the last position of each row. input_ids/positions/real [B, T] (real: bool, False = left
    padding, which no linear layer sees; None: all real, a decode step); cache: this batch's DynamicCache, its T new
    columns are written after the `cached` ones (its buffers may have spare columns past them: see append);
    attn_mask [B, 1, T, cached + T] bool, True = may attend."""
    B, T = input_ids.shape
    inner = model.model
    flat = None if real is None else real.reshape(-1)
    idx = None if flat is None or bool(flat.all()) else flat.nonzero()[:, 0]  # None: every position is real
    pick = lambda t: t if idx is None else t[idx]  # [B*T, ...] -> [N, ...]
    h = inner.embed_tokens(pick(input_ids.reshape(-1)))  # [N, hidden]
    rope = model.fast_rope[pick(positions.reshape(-1))]  # [N, 2, D]
    cos, sin = rope[:, :1], rope[:, 1:]  # [N, 1, D]

    def spread(x: torch.Tensor) -> torch.Tensor:  # [N, heads, D] -> [B, heads, T, D], zeros at padding
        if idx is not None:
            x = x.new_zeros(B * T, *x.shape[1:]).index_copy_(0, idx, x)
        return x.view(B, T, *x.shape[1:]).transpose(1, 2)

    mask = None
    for layer, kv in zip(inner.layers, cache.layers):
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads = attn.q_proj.weight.shape[0] // attn.head_dim, attn.k_proj.weight.shape[0] // attn.head_dim
        qkv = linear(model, rms_norm(layer.input_layernorm, h), *attn.qkv)
        qkv = qkv.view(len(h), -1, attn.head_dim)  # [N, heads', D]
        # q and k: their norms (each its own weight, the same epsilon) and the rotation in one go
        norm_weight = derived(model, id(attn), lambda: torch.cat([attn.q_norm.weight.expand(heads, -1),
                                                                  attn.k_norm.weight.expand(kv_heads, -1)]))
        qk = rotate(rms_norm(attn.q_norm, qkv[:, :heads + kv_heads], norm_weight), cos, sin)
        keys, values = append(kv, spread(qk[:, heads:]), spread(qkv[:, heads + kv_heads:]), attn_mask.shape[-1])
        if mask is None:  # once for all layers, additive (SDPA makes one of a bool mask per call); spare columns -inf
            allowed = F.pad(attn_mask, (0, keys.shape[2] - attn_mask.shape[-1]))
            mask = torch.zeros(allowed.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~allowed, -torch.inf)
        if T == 1 and keys.device.type == "cpu":
            out = decode_attention(spread(qk[:, :heads]), keys, values, mask, attn.scaling)
        else:
            out = F.scaled_dot_product_attention(spread(qk[:, :heads]), keys, values, attn_mask=mask,
                                                 scale=attn.scaling, enable_gqa=attn.num_key_value_groups > 1)
        out = pick(out.transpose(1, 2).reshape(B * T, -1))  # [N, heads * D]
        h = h + linear(model, out, attn.o_proj.weight, attn.o_proj.bias)
        gate, up = linear(model, rms_norm(layer.post_attention_layernorm, h), *mlp.gate_up).chunk(2, dim=-1)
        h = h + linear(model, mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    last = h.view(B, T, -1)[:, -1] if idx is None else h[(flat.cumsum(0) - 1).view(B, T)[:, -1]]  # [B, hidden]
    return linear(model, rms_norm(inner.norm, last), model.lm_head.weight, model.lm_head.bias)
