"""Adversarial training of a small ALBERT-like masked language model, as a saddle-point problem.

    min_theta max_{||delta|| <= eps}  E_batch [ MLM_loss(theta; embeddings(x) + delta) ]

``theta`` are the weights of an ``AlbertForMaskedLM`` built from a ``transformers.AlbertConfig`` (nothing
is downloaded); ``delta`` is one perturbation of the input embeddings (``seq_len x embedding_size``)
shared by all examples, projected onto the Euclidean ball of radius ``epsilon``. The VI operator is
``F(theta, delta) = (grad_theta L, -grad_delta L)``, evaluated on a minibatch of the device's own shard.

Data: ``collab/tasks/data/corpus.txt`` (shipped; regenerate with ``bench/make_corpus.py``), loaded with
``datasets`` from the local file and split into shards by line (device m reads lines m, m+M, ...).
Tokenizer: character level, built offline from the corpus alphabet. The metric is the MLM loss (under
the current perturbation) on a fixed evaluation batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from collab.rng import torch_seed
from collab.tasks.base import LocalOperator, Task

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
PAD, MASK, UNK = "[PAD]", "[MASK]", "[UNK]"


class CharTokenizer:
    """Character-level tokenizer over a fixed alphabet plus ``[PAD]``, ``[MASK]``, ``[UNK]``."""

    def __init__(self, alphabet: str) -> None:
        self.itos = [PAD, MASK, UNK, *sorted(set(alphabet))]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.mask_id, self.unk_id = 0, 1, 2

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, length: int) -> list[int]:
        ids = [self.stoi.get(c, self.unk_id) for c in text[:length]]
        return ids + [self.pad_id] * (length - len(ids))


def load_lines(path: Path = CORPUS) -> list[str]:
    """The corpus lines, read with ``datasets`` from the local file (offline)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("text", data_files=str(path), split="train")
    return [row["text"] for row in ds if row["text"].strip()]


def _build_model(
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
    model = AlbertForMaskedLM(config)
    model.eval()  # no dropout: F must be a deterministic function of z and the batch
    return model


class _MLM:
    """Shared machinery: the model, the flat parameter layout, masking and the loss."""

    def __init__(self, task: AdversarialTask, device: str) -> None:
        self.task, self.device = task, torch.device(device)
        self.model = task.new_model().to(self.device)
        self.params = [p for p in self.model.parameters()]
        self.n_theta = sum(p.numel() for p in self.params)

    def load(self, z: torch.Tensor) -> torch.Tensor:
        """Write theta into the model; return delta (on device, requires grad)."""
        z = z.to(self.device)
        torch.nn.utils.vector_to_parameters(z[: self.n_theta], self.params)
        delta = z[self.n_theta :].reshape(self.task.seq_len, self.task.embedding_size).clone()
        return delta.requires_grad_(True)

    def loss(self, delta: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embedding: torch.nn.Module = self.model.get_input_embeddings()  # type: ignore[operator]
        embeds = embedding(ids) + delta.unsqueeze(0)
        attention = (ids != self.task.tokenizer.pad_id).long()
        out = self.model(inputs_embeds=embeds, attention_mask=attention, labels=labels)
        return out.loss

    def operator(
        self, z: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        delta = self.load(z)
        for p in self.params:
            p.grad = None
        loss = self.loss(delta, ids, labels)
        grads = torch.autograd.grad(loss, [*self.params, delta])
        g_theta = torch.cat([g.reshape(-1) for g in grads[:-1]])
        return torch.cat([g_theta, -grads[-1].reshape(-1)]).float().cpu(), float(loss.detach())


class AdversarialOperator(LocalOperator):
    def __init__(self, task: AdversarialTask, index: int, device: str) -> None:
        self.task, self.index = task, index
        self.mlm = _MLM(task, device)
        self.dim = task.dim
        self.rows = task.encoded[index :: task.num_devices]
        if len(self.rows) == 0:
            raise ValueError(f"shard {index} of {task.num_devices} is empty")
        self.last_loss = float("nan")

    @property
    def weight(self) -> float:
        return float(self.task.batch_size)

    def _batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(torch_seed(self.task.seed, step, "adversarial-batch", self.index))
        pick = torch.randint(len(self.rows), (size,), generator=g)
        return self.task.mask(self.rows[pick], g)

    def evaluate(
        self, points: Sequence[torch.Tensor], *, step: int, full: bool = False
    ) -> list[torch.Tensor]:
        size = self.task.batch_size * (4 if full else 1)
        ids, labels = self._batch(step, size)
        ids, labels = ids.to(self.mlm.device), labels.to(self.mlm.device)
        out = []
        for p in points:
            f, loss = self.mlm.operator(p, ids, labels)
            out.append(f)
            self.last_loss = loss
        return out


class AdversarialTask(Task):
    """``AdversarialTask(num_devices=M, seed=s, ...)``; ``z = (theta, delta)``."""

    metric_name = "loss"

    def __init__(
        self,
        *,
        num_devices: int,
        seed: int,
        seq_len: int = 32,
        batch_size: int = 16,
        embedding_size: int = 32,
        hidden_size: int = 64,
        layers: int = 2,
        heads: int = 2,
        epsilon: float = 1.0,
        mask_prob: float = 0.15,
        device: str = "cpu",
    ) -> None:
        self.num_devices, self.seed, self.seq_len, self.batch_size = num_devices, seed, seq_len, batch_size
        self.embedding_size, self.hidden_size, self.layers, self.heads = (
            embedding_size,
            hidden_size,
            layers,
            heads,
        )
        self.epsilon, self.mask_prob, self.device = epsilon, mask_prob, device
        lines = load_lines()
        self.tokenizer = CharTokenizer("".join(sorted(set("".join(lines)))))
        self.encoded = torch.tensor([self.tokenizer.encode(t, seq_len) for t in lines], dtype=torch.long)
        self._eval_mlm = _MLM(self, "cpu")
        self.n_theta = self._eval_mlm.n_theta
        self.dim = self.n_theta + seq_len * embedding_size
        g = torch.Generator().manual_seed(torch_seed(seed, 0, "adversarial-eval"))
        self._eval = self.mask(self.encoded[torch.randint(len(self.encoded), (64,), generator=g)], g)

    def new_model(self) -> torch.nn.Module:
        return _build_model(
            len(self.tokenizer),
            seq_len=self.seq_len,
            embedding_size=self.embedding_size,
            hidden_size=self.hidden_size,
            layers=self.layers,
            heads=self.heads,
            seed=torch_seed(self.seed, 0, "adversarial-init") % 2**31,
        )

    def mask(self, ids: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT-style masking: ``mask_prob`` of the real tokens become ``[MASK]``; labels elsewhere -100."""
        real = ids != self.tokenizer.pad_id
        chosen = (torch.rand(ids.shape, generator=g) < self.mask_prob) & real
        chosen[:, 0] |= ~chosen.any(dim=1) & real[:, 0]  # at least one target per row
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        return torch.where(chosen, torch.full_like(ids, self.tokenizer.mask_id), ids), labels

    def initial_point(self) -> torch.Tensor:
        theta = torch.nn.utils.parameters_to_vector(self._eval_mlm.params).detach().float()
        return torch.cat([theta, torch.zeros(self.seq_len * self.embedding_size)])

    def local_operator(self, index: int) -> AdversarialOperator:
        return AdversarialOperator(self, index, self.device)

    def project(self, z: torch.Tensor) -> torch.Tensor:
        """Identity on theta; delta onto the ball of radius epsilon."""
        delta = z[self.n_theta :]
        norm = float(delta.norm())
        if norm <= self.epsilon:
            return z
        return torch.cat([z[: self.n_theta], delta * (self.epsilon / norm)])

    def metric(self, z: torch.Tensor) -> float:
        with torch.no_grad():
            delta = self._eval_mlm.load(z).detach()
            return float(self._eval_mlm.loss(delta, *self._eval))
