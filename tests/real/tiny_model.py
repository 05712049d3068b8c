"""Write a tiny random Llama model (about 600 KB) that vLLM can serve on the CPU.

Run with an interpreter that has ``transformers`` and ``tokenizers`` (the vLLM environment):
``python tiny_model.py OUT_DIR``. Deterministic: the same seed gives the same files. No hub is
reachable here, so the tokenizer is trained on generated text: byte-level BPE, 512 tokens.

Sizes follow what vLLM's CPU attention accepts: hidden 128 with 2 heads and 1 KV head gives
head_dim 64 (it rejected 16). One token of KV cache in bfloat16 costs
2 layers x (K + V) x 1 head x 64 x 2 bytes = 512 bytes.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

VOCAB = 512
MAX_POSITIONS = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(lines)]


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    torch.manual_seed(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
