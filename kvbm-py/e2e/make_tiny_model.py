"""Makes a tiny Llama model directory that `vllm serve` loads, with nothing from a model hub.

    python make_tiny_model.py OUT_DIR [--layers 2] [--hidden 128] [--heads 4] [--kv-heads 2]

- The tokenizer is a byte-level BPE trained here (HF `tokenizers`) on text this script writes
  itself, saved as `tokenizer.json` with a `tokenizer_config.json` and a chat template, as a
  `PreTrainedTokenizerFast` saves them.
- The weights are a randomly initialised `LlamaForCausalLM` (fixed seed) saved with
  `save_pretrained` as safetensors, in float32 so that recomputing a prefix and loading its KV
  blocks give the same greedy tokens. Weights are drawn wider than Llama's default (std
  `--init-std`) so that attention is sharp: the output then depends on early prompt tokens, which
  the token-exact checks need (a wrong prefix must change what is generated).
"""

from __future__ import annotations

import argparse
import json
import os
import random


def corpus(n_lines: int = 4000, seed: int = 7):
    rnd = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "da", "fo", "gu", "he", "ji", "pe", "qu", "wo", "xe", "yu", "zo"]
    words = ["".join(rnd.choice(syllables) for _ in range(rnd.randint(1, 4))) for _ in range(600)]
    words += [str(i) for i in range(100)] + ["the", "a", "of", "and", "to", "in", "is", "cache", "block", "token"]
    for _ in range(n_lines):
        yield " ".join(rnd.choice(words) for _ in range(rnd.randint(5, 20))) + rnd.choice([".", "!", "?", ","])


def make_tokenizer(out: str, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)
    return len(fast)


def make_model(out: str, vocab: int, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_len,
        initializer_range=args.init_std,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # Never stop early: the end-of-sequence token is never the most likely one.
        model.lm_head.weight[1].fill_(0.0)
        model.lm_head.bias = None
    model.save_pretrained(out, safe_serialization=True)
    # vLLM reads the dtype from the config.
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--init-std", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    vocab = make_tokenizer(args.out, args.vocab)
    make_model(args.out, vocab, args)
    print(f"tiny model in {args.out}: vocab {vocab}, {args.layers} layers, hidden {args.hidden}")


if __name__ == "__main__":
    main()
