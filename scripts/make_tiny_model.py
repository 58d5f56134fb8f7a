"""Make a tiny random-weight Llama and a locally trained byte-level BPE tokenizer.

Nothing can be downloaded here, so the test model is built from a fixed seed: its output is
gibberish but greedy decoding is deterministic, which is all equivalence tests need.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated prefill and decode split the prompt pass from token generation.",
    "A key value cache holds attention keys and values for every token seen so far.",
    "Once upon a time there was a small model that could only speak in riddles.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { }",
    "def main():\n    print('hello world')\n    return 0\n",
    "The transfer engine moves blocks of memory between two machines over RDMA or TCP.",
]


def build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)


def build_model(out: Path, args: argparse.Namespace, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    if args.layer_types:
        # A hybrid model: vLLM's llama reads layer_types and sliding_window and puts the
        # sliding and full attention layers in separate KV cache groups.
        kinds = [f"{k}_attention" for k in args.layer_types.split(",")]
        if len(kinds) != args.layers:
            raise SystemExit(f"--layer-types needs {args.layers} entries, got {len(kinds)}")
        cfg.layer_types = kinds
        cfg.sliding_window = args.sliding_window
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    # Wider weights than the default init so greedy outputs vary across prompts.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.02)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layer-types",
        default="",
        help="comma-separated sliding|full per layer, e.g. sliding,full (a hybrid model)",
    )
    ap.add_argument("--sliding-window", type=int, default=64)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out, args.vocab)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.out))
    build_model(args.out, args, vocab)
    print(f"tiny model written to {args.out} (vocab {vocab}, layers {args.layers})")


if __name__ == "__main__":
    main()
