"""Adversarial training of a small ALBERT-like masked language model, as a saddle-point problem.

    min_theta max_{||delta|| <= eps}  E_batch [ MLM_loss(theta; embeddings(x) + delta) ]

Expressed on the bring-your-own-model API (:mod:`collab.tasks.torch_task`): :func:`adversarial_mlm` is
a task factory like any user's. ``theta`` are the weights of an ``AlbertForMaskedLM`` built from a
``transformers.AlbertConfig`` (nothing is downloaded); ``delta`` is one perturbation of the input
embeddings (``seq_len x embedding_size``) shared by all examples, held by the adversary and projected
onto the Euclidean ball of radius ``epsilon``. The operator is ``F(theta, delta) = (grad_theta L,
-grad_delta L)`` on a minibatch of the device's own shard.

Data: the shipped corpus (``collab/tasks/text.py``), split into shards by line (device m reads lines
m, m+M, ...); character tokenizer. The metric is the MLM loss (under the current perturbation) on a
fixed evaluation batch of 64 masked lines.
"""

from __future__ import annotations

import torch

from collab.rng import torch_seed
from collab.tasks.text import CharTokenizer, corpus_tokenizer, load_lines
from collab.tasks.torch_task import TorchProblem, task_factory


def _albert(
    vocab: int, *, seq_len: int, embedding_size: int, hidden_size: int, layers: int, heads: int, seed: int
) -> torch.nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=vocab,
        embedding_size=embedding_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    return AlbertForMaskedLM(config)


def mask_tokens(
    ids: torch.Tensor, tok: CharTokenizer, mask_prob: float, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style masking: ``mask_prob`` of the real tokens become ``[MASK]``; labels elsewhere -100."""
    real = ids != tok.pad_id
    chosen = (torch.rand(ids.shape, generator=g) < mask_prob) & real
    chosen[:, 0] |= ~chosen.any(dim=1) & real[:, 0]  # at least one target per row
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return torch.where(chosen, torch.full_like(ids, tok.mask_id), ids), labels


@task_factory
def adversarial_mlm(
    *,
    seed: int,
    seq_len: int = 32,
    embedding_size: int = 32,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,
    epsilon: float = 1.0,
    mask_prob: float = 0.15,
) -> TorchProblem:
    """The adversarial masked-LM problem (see the module docstring)."""
    lines = load_lines()
    tok = corpus_tokenizer(lines)
    encoded = torch.tensor([tok.encode(t, seq_len) for t in lines], dtype=torch.long)
    model = _albert(
        len(tok),
        seq_len=seq_len,
        embedding_size=embedding_size,
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        seed=torch_seed(seed, 0, "adversarial-init") % 2**31,
    )

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], adv: dict) -> torch.Tensor:
        ids, labels = batch
        embedding: torch.nn.Module = model.get_input_embeddings()  # type: ignore[operator]
        embeds = embedding(ids) + adv["delta"].unsqueeze(0)
        out = model(inputs_embeds=embeds, attention_mask=(ids != tok.pad_id).long(), labels=labels)
        return out.loss

    def collate(rows: list[torch.Tensor], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return mask_tokens(torch.stack(rows), tok, mask_prob, g)

    def project(adv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        norm = float(adv["delta"].norm())
        return adv if norm <= epsilon else {"delta": adv["delta"] * (epsilon / norm)}

    g = torch.Generator().manual_seed(torch_seed(seed, 0, "adversarial-eval"))
    eval_batch = mask_tokens(encoded[torch.randint(len(encoded), (64,), generator=g)], tok, mask_prob, g)
    return TorchProblem(
        model=model,
        loss=loss,
        data=lambda shard, num_shards: encoded[shard::num_shards],
        collate=collate,
        eval_batch=eval_batch,
        adversary={"delta": torch.zeros(seq_len, embedding_size)},
        project_adversary=project,
    )
