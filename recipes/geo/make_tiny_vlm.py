"""Write a tiny random-init vision-language model directory: Qwen3-VL (a Qwen3 text model with a vision tower
and DeepStack), its image processor, and the byte tokenizer of gpu-services/make_tiny_model.py extended with
Qwen's vision tokens. Deterministic for a seed; small enough for CPU tests (~200K parameters). --moe: a Qwen3-VL-MoE
instead (each text layer 4 experts, top 2; the same vision tower, processor and tokenizer), for routing replay.

    python recipes/geo/make_tiny_vlm.py --out .molt/models/tiny-vlm [--seed 0] [--moe]

Images are resized (Qwen's smart_resize) to multiples of 16 pixels (patch 8 x merge 2) with at most 128 x 128
pixels, so an image is 1 to 64 placeholder tokens: (height / 16) * (width / 16).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu-services"))
from make_tiny_model import BOS_ID, CHAT_TEMPLATE, EOS_ID, PAD_ID, SPECIALS, byte_tokenizer  # noqa: E402

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # ids 259..262
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = range(256 + len(SPECIALS), 256 + len(SPECIALS) + len(VISION))
PATCH, MERGE, TEMPORAL = 8, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 128 * 128

# The text template with content parts: {"type": "image"} renders as Qwen's vision block, {"type": "text"} as
# its text. The framework renders a message's parts this way, then expands each <|image_pad|> to the image's
# placeholder count, as Qwen's processor does.
CONTENT = ("{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
           "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
           "{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}")
VLM_TEMPLATE = (CHAT_TEMPLATE.replace("<|im_start|>user\n{{ message.content }}", "<|im_start|>user\n" + CONTENT)
                .replace("<tool_response>\n{{ message.content }}", "<tool_response>\n" + CONTENT))


def model_config(moe: bool = False):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig
    text = dict(vocab_size=256 + len(SPECIALS) + len(VISION), hidden_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=[0])
    if moe:  # the dense MLP's 256 split into 4 experts of 64, as make_tiny_model.py --moe does
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
                         vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=True)


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def make(out: str, seed: int = 0, moe: bool = False) -> Path:
    from transformers import AutoModelForImageTextToText
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(model_config(moe), dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = byte_tokenizer()
    tok.add_special_tokens(VISION)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 1024, "chat_template": VLM_TEMPLATE,
        "add_bos_token": False, "clean_up_tokenization_spaces": False}, indent=2))
    image_processor().save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe", action="store_true")
    a = p.parse_args()
    print(make(a.out, a.seed, a.moe))
