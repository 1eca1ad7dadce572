"""Train Strata's demo model: a tiny qwen3moe that writes (King James) English.

    python examples/demo_model/train.py [--steps N] [--out-dir /tmp/strata-demo] [--data-dir strata_core/data]

1. trains a 2048-token byte-level BPE (Qwen2 pre-tokenizer) on ``kjv_narrative.txt``;
2. trains ``Qwen3MoeForCausalLM`` (4 layers, hidden 128, 8 experts top-2, expert FFN 256) on it,
   seeded and single-process, 2 CPU threads, printing the loss as it goes;
3. saves the HF checkpoint and tokenizer to ``--out-dir`` and prints greedy samples;
4. writes ``demo-qwen3moe-f16.gguf`` and ``demo-qwen3moe-q8_0.gguf`` (ChatML template inside) to
   ``--data-dir`` with ``strata_core.gguf.writer``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import tokenizers
import torch
from pydantic import BaseModel, Field
from pydantic_settings import CliApp
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from strata_core.text.chat import CHATML_TEMPLATE
from strata_core.text.tokenizer import train_byte_level_bpe

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "kjv_narrative.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPTS = ["In the beginning", "And the king said", "Jesus answered"]
SEED = 1234


def model_config(vocab_size: int) -> Qwen3MoeConfig:
    """The demo architecture: ~3.8M parameters, ~1M active per token."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
    )


def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """One batch of random windows of ``seq + 1`` tokens."""
    starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
    return torch.stack([ids[s : s + seq + 1] for s in starts.tolist()])


def train(args: TrainOptions) -> tuple[Qwen3MoeForCausalLM, tokenizers.Tokenizer]:
    """Train the tokenizer, then the model; the printed losses include the router's auxiliary loss."""
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    text = CORPUS.read_text(encoding="utf-8")
    t0 = time.time()
    tokenizer = train_byte_level_bpe(text.split("\n\n"), vocab_size=2048, special_tokens=SPECIAL_TOKENS)
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    split = int(len(ids) * 0.98)
    train_ids, val_ids = ids[:split], ids[split:]
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens, corpus {len(ids)} tokens ({time.time() - t0:.1f}s)", flush=True)

    model = Qwen3MoeForCausalLM(model_config(tokenizer.get_vocab_size()))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    )
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        x = batches(train_ids, args.batch, args.seq, gen)
        out = model(input_ids=x, labels=x)  # the loss shifts labels: each position predicts the next
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == 1:
            print(f"step {step:5d}/{args.steps}  loss {out.loss.item():.3f}  lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.0f}s", flush=True)
    model.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(SEED + 1)
        val = [model(input_ids=(b := batches(val_ids, args.batch, args.seq, g)), labels=b).loss.item() for _ in range(4)]
    print(f"validation loss {sum(val) / len(val):.3f}, train time {time.time() - t0:.0f}s", flush=True)
    return model, tokenizer


def greedy_samples(model: Qwen3MoeForCausalLM, tokenizer: tokenizers.Tokenizer, n_tokens: int = 30) -> None:
    """Print what the trained HF model writes for PROMPTS (greedy)."""
    for prompt in PROMPTS:
        x = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            y = model.generate(x, max_new_tokens=n_tokens, do_sample=False, pad_token_id=0)
        print(f"{prompt!r} -> {tokenizer.decode(y[0].tolist())!r}", flush=True)


def write_ggufs(model: Qwen3MoeForCausalLM, tokenizer: tokenizers.Tokenizer, data_dir: Path) -> None:
    """The F16 and Q8_0 demo GGUFs, with the tokenizer and the ChatML template."""
    from gguf import GGMLQuantizationType as Q

    from strata_core.gguf.writer import write_gguf

    data_dir.mkdir(parents=True, exist_ok=True)
    model.config.name_or_path = "strata-demo-qwen3moe"  # general.name
    for name, qtype in (("f16", Q.F16), ("q8_0", Q.Q8_0)):
        path = data_dir / f"demo-qwen3moe-{name}.gguf"
        write_gguf(model, path, expert_qtype=qtype, dense_qtype=qtype, tokenizer=tokenizer,
                   chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>", bos_token=None)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)


class TrainOptions(BaseModel):
    """Train Strata's demo model and write it as GGUF (flags parsed by pydantic-settings' CLI)."""

    steps: int = Field(400, ge=1, description="optimizer steps")
    batch: int = Field(16, ge=1, description="sequences per step")
    seq: int = Field(128, ge=8, description="tokens per sequence")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    out_dir: Path = Field(Path("/tmp/strata-demo"), description="where the HF checkpoint goes")
    data_dir: Path = Field(HERE.parents[1] / "strata_core" / "data", description="where the GGUFs go")
    gguf: bool = Field(True, description="write the GGUFs (--no-gguf stops after the HF checkpoint)")

    def cli_cmd(self) -> None:
        """Train, save the checkpoint, print samples, write the GGUFs."""
        model, tokenizer = train(self)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(self.out_dir)
        tokenizer.save(str(self.out_dir / "tokenizer.json"))
        print(f"saved HF checkpoint to {self.out_dir}", flush=True)
        greedy_samples(model, tokenizer)
        if self.gguf:
            write_ggufs(model, tokenizer, self.data_dir)


if __name__ == "__main__":
    CliApp.run(TrainOptions)
