"""A small GPT-2-style character language model on the shipped corpus: a plain minimization task.

An example of collab's bring-your-own-model API (``collab/tasks/torch_task.py``), independent of the
built-in tasks: the model is a ``transformers`` ``GPT2LMHeadModel`` built from a ``GPT2Config`` (nothing
is downloaded), the loss is next-character cross-entropy, shard ``m`` of ``M`` reads every ``M``-th line
of the corpus, and there is no adversary (``F`` is the gradient). Run it with
``collab simulate --config examples/charlm.yaml`` or ``collab demo --config examples/charlm.yaml``.
"""

from __future__ import annotations

import torch

from collab.rng import torch_seed
from collab.tasks import TorchProblem, task_factory
from collab.tasks.text import corpus_tokenizer, load_lines


@task_factory
def char_gpt(
    *,
    seed: int,
    seq_len: int = 64,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 2,
    eval_lines: int = 64,
) -> TorchProblem:
    """``GPT2LMHeadModel`` over characters; options: ``seq_len``, ``layers``, ``hidden``, ``heads``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    lines = load_lines()
    tok = corpus_tokenizer(lines)
    rows = torch.tensor([tok.encode(line, seq_len) for line in lines], dtype=torch.long)
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=seq_len,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tok.pad_id,
        eos_token_id=tok.pad_id,
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(torch_seed(seed, 0, "charlm-init") % 2**31)
    model = GPT2LMHeadModel(config)

    def collate(examples: list[torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.stack(examples)
        attention = (ids != tok.pad_id).long()
        labels = torch.where(attention.bool(), ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "attention_mask": attention, "labels": labels}

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], adversary: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # next-character cross-entropy, padding ignored (what GPT2LMHeadModel's own loss computes)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )

    g = torch.Generator().manual_seed(torch_seed(seed, 0, "charlm-eval"))
    eval_rows = rows[torch.randint(len(rows), (eval_lines,), generator=g)]
    return TorchProblem(
        model=model,
        loss=loss,
        data=lambda shard, num_shards: rows[shard::num_shards],
        collate=collate,
        eval_batch=collate(list(eval_rows), g),
    )
