"""Tiny Qwen2-architecture causal LMs with a locally trained tokenizer, built offline.

`init_tiny` trains a byte-level BPE tokenizer on a synthetic corpus (`corpus.py`), builds a
randomly initialised `Qwen2ForCausalLM` sized for fast CPU decoding, and saves both with
`save_pretrained`, so `AutoTokenizer.from_pretrained(dir)` and
`AutoModelForCausalLM.from_pretrained(dir)` load them with no hub access. Tests, demos and CPU
RaaS nodes use these models; nothing is ever downloaded.

Tokenizer: digits are split one per token before BPE (arithmetic is easier when numbers are
sequences of digits); ``<pad>``, ``<bos>``, ``<eos>`` are special tokens with ids 0, 1, 2;
the tool tags of `protocol.py` are single, non-special tokens (they survive
``skip_special_tokens``). Encoding with special tokens prepends ``<bos>``.

Prompt format (see `protocol.py`): ``format_prompt("What is 2+3?") == "Q: What is 2+3?\\nA:"``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from astraflow.errors import ModelError
from astraflow.models.corpus import synthetic_corpus
from astraflow.models.protocol import BOS, EOS, PAD, SPECIAL_TOKENS, TOOL_TAGS, UNK, format_prompt

__all__ = ["TinySpec", "format_prompt", "init_tiny", "load_tiny", "train_tokenizer"]

SPEC_FILE = "astraflow_tiny.json"
# Qwen2's pre-tokenizer: `AutoTokenizer` rebuilds any tokenizer of a "qwen2" model with this exact
# pipeline (NFC, this split, byte-level), so we train with it too. `\p{N}` isolates every digit.
QWEN2_PRETOKENIZE_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True, slots=True)
class TinySpec:
    """What `init_tiny` built; written to ``astraflow_tiny.json`` next to the weights."""

    vocab_size: int  # actual tokenizer size (the BPE trainer may stop below the request)
    hidden: int  # hidden size
    layers: int  # decoder layers
    heads: int  # attention heads
    kv_heads: int  # key/value heads (grouped-query attention)
    intermediate: int  # MLP width
    max_positions: int  # longest sequence the rotary embedding is configured for
    seed: int  # torch seed of the random initialisation
    parameters: int  # number of parameters (tied embeddings counted once)
    tied: bool = True  # output head shares the input embeddings (vLLM's in-place reload needs False)


def train_tokenizer(
    corpus: Iterable[str], vocab_size: int = 1024, max_length: int = 512
) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer on `corpus`, with digits one per token and the tool tags."""
    if vocab_size < 300:
        raise ModelError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least 300")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TAGS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_length,
    )


def init_tiny(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    tie_embeddings: bool = True,
) -> Path:
    """Builds a tiny tokenizer + Qwen2 causal LM and saves both to `out_dir`; returns its path.

    `corpus` defaults to `synthetic_corpus(seed=seed)`. The defaults give about 0.4 M parameters
    and decode 64 tokens with the KV cache in roughly 0.15 s on one CPU core. `tie_embeddings=False`
    gives the output head its own matrix (+0.13 M parameters at the defaults): what the vLLM
    backend serves, since vLLM's in-place weight reload leaves a tied head stale. The defaults'
    head size (hidden / heads = 32) is one vLLM's CPU attention kernels take.
    """
    if hidden % heads or heads % kv_heads:
        raise ModelError(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    out = Path(out_dir)
    tokenizer = train_tokenizer(
        synthetic_corpus(seed=seed) if corpus is None else corpus, vocab_size, max_positions
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    spec = TinySpec(
        vocab_size=len(tokenizer),
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        max_positions=max_positions,
        seed=seed,
        parameters=sum(p.numel() for p in model.parameters()),
        tied=tie_embeddings,
    )
    (out / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


def load_tiny(model_dir: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads (model, tokenizer) from a local directory only; the model is in eval mode on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelError(f"no model in {path}: create one with init_tiny({str(path)!r})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the model in {path}: {exc}") from exc
    model.eval()
    return model, tokenizer
