"""Write a tiny random-init Hugging Face model directory: Qwen3 (or Qwen3-MoE) weights, a byte-level
BPE tokenizer (id = byte value for ids 0..255) and a chat template with system/user/assistant/tool
messages and Hermes-style tool calls. Deterministic for a seed.

    python gpu-services/make_tiny_model.py --out models/tiny [--moe] [--seed 0] [--hidden 64 --layers 2 --heads 2]

--hidden/--layers/--heads make a larger one of the same family (e.g. for bench/sft-rl.ts); head_dim stays 32 and
the MLP is 4x hidden.
"""
import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
PAD_ID, BOS_ID, EOS_ID = 256, 256, 258

# Qwen-style ChatML with Hermes tool calls. Tool results render as a user turn, as Qwen3 does.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a tool with <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{% if not loop.first %}<|im_start|>system\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": {{ call.function.name | tojson }}, \"arguments\": "
    "{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}{{ call.function.arguments | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer applies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]  # mapped in order to chr(256), chr(257), ...
    return {b: chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)}


def byte_tokenizer() -> Tokenizer:
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}  # id = byte value
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def model_config(moe: bool, hidden: int = 64, layers: int = 2, heads: int = 2):
    common = dict(vocab_size=256 + len(SPECIALS), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads, head_dim=32, intermediate_size=4 * hidden, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  rope_theta=10000.0, torch_dtype="float32")
    if moe:
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=False)
    from transformers import Qwen3Config
    return Qwen3Config(**common)


def make(out: str, seed: int = 0, moe: bool = False, hidden: int = 64, layers: int = 2, heads: int = 2) -> Path:
    from transformers import AutoModelForCausalLM
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(moe, hidden, layers, heads), dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    byte_tokenizer().save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 1024, "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False, "clean_up_tokenization_spaces": False}, indent=2))
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe", action="store_true")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    a = p.parse_args()
    print(make(a.out, a.seed, a.moe, a.hidden, a.layers, a.heads))
