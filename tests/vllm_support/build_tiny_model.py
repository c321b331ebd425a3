"""Build a tiny random-weight Llama model that a real vLLM CPU server can load.

Run with the vLLM venv's python (it needs ``transformers``, ``tokenizers`` and
``torch``; nothing is downloaded)::

    python build_tiny_model.py --out DIR [--layers 2 --hidden 256 --vocab 4096 --seed 0]

It trains a byte-level BPE tokenizer on a small corpus generated from the seed,
builds a ``LlamaForCausalLM`` with random weights (seeded), and saves model
(safetensors), tokenizer (``PreTrainedTokenizerFast`` with bos/eos/pad and a simple
chat template, so ``/v1/chat/completions`` works) and generation config to DIR.

Idempotent: DIR holds a stamp with the build parameters; a DIR whose stamp matches
is left alone. The build goes to a temporary sibling folder that is renamed into
place, so an interrupted build never leaves a half-written model behind.
Deterministic: the same arguments give byte-identical weights and tokenizer.

Output lengths are random (the weights are), so tests control them with
``max_tokens`` and ``ignore_eos``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Bump when the output layout changes, so old stamped folders are rebuilt.
BUILD_VERSION = 2
STAMP_NAME = ".binbatch-model-stamp"

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

# A minimal chat format: every message is "<|role|>\n" + content + "</s>\n"; the
# generation prompt opens an assistant turn. Jinja, as the HF chat_template field.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

COMMON_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there "
    "use an each which she do how their if will up other about out many then them "
    "these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part hello world request batch token model "
    "server latency memory cache queue prompt answer question sidecar engine bin"
).split()


def make_corpus(seed: int, lines: int = 6000) -> list[str]:
    """A deterministic corpus: common English words, synthetic words, numbers, code."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    synthetic = []
    for _ in range(3000):
        n = rng.randint(1, 4)
        synthetic.append("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(n)))
    # Zipf-like weights so BPE finds frequent merges.
    words = COMMON_WORDS + synthetic
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(len(words))]
    out = []
    for i in range(lines):
        kind = i % 10
        if kind == 7:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            out.append(f"{a} + {b} = {a + b}; {a} * {b} = {a * b}.")
        elif kind == 8:
            name = rng.choice(synthetic)
            out.append(f"def {name}(x, y):\n    return x * {rng.randint(1, 99)} + y  # {name}")
        else:
            n = rng.randint(4, 24)
            sentence = " ".join(rng.choices(words, weights=weights, k=n))
            punct = rng.choice([".", "?", "!", ",", ":"])
            out.append(sentence[:1].upper() + sentence[1:] + punct)
    return out


def build_tokenizer(corpus: list[str], vocab: int, positions: int = 2048) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    # Prepend BOS like Llama tokenizers do (add_special_tokens=True).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, tok.token_to_id(BOS))],
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=positions,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: Any, layers: int, hidden: int, seed: int, positions: int = 2048) -> Any:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    head_dim = 64  # a head size every vLLM CPU attention backend supports
    if hidden % head_dim:
        raise SystemExit(f"--hidden must be a multiple of {head_dim}, got {hidden}")
    heads = hidden // head_dim
    vocab_size = len(tokenizer)
    # Round the embedding table up to a multiple of 64 (friendlier kernels); ids past
    # the tokenizer's are never produced by it and decode to nothing.
    vocab_size = (vocab_size + 63) // 64 * 64
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,  # Llama uses ~8/3·h·2; 4h keeps it simple
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Saved in bfloat16, what vLLM's CPU backend runs by default (AMX/AVX512-BF16).
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Re-draw every parameter from our own seeded generator so the weights do not
    # depend on how a transformers release orders or skips its init calls.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * config.initializer_range)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def stamp_for(args: argparse.Namespace) -> str:
    return json.dumps(
        {
            "build_version": BUILD_VERSION,
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "seed": args.seed,
            # only when not the default, so the folders built before it are reused
            **({"positions": args.positions} if args.positions != 2048 else {}),
        },
        sort_keys=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--positions", type=int, default=2048, help="the longest context (max_position_embeddings)")
    args = parser.parse_args(argv)
    # Everything is local: never reach for the hub, and keep the output readable.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    out: Path = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per output folder (two pytest sessions may race).
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build(args, out)


def build(args: argparse.Namespace, out: Path) -> int:
    stamp = stamp_for(args)
    stamp_file = out / STAMP_NAME
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        print(f"[build_tiny_model] reusing {out} ({stamp})")
        return 0

    start = time.monotonic()
    print(f"[build_tiny_model] building {out} ({stamp})")
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        corpus = make_corpus(args.seed)
        tokenizer = build_tokenizer(corpus, args.vocab, args.positions)
        model = build_model(tokenizer, args.layers, args.hidden, args.seed, args.positions)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / STAMP_NAME).write_text(stamp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(
        f"[build_tiny_model] done in {time.monotonic() - start:.1f} s: {out} "
        f"({n_params / 1e6:.2f} M parameters, tokenizer {len(tokenizer)} tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
