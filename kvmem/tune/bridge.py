"""Learned bridge tokens (lab): soft tokens after the injected facts, distilled from text prefill.

Facts injected from blobs never attend to each other. B tokens placed right after them, computed
as ordinary prompt tokens, attend to every fact; if their inputs are learned, they can carry to
the tail some of what cross-fact attention would have. The model stays frozen: only the bridge's
input vectors [B, hidden] (what the embedding would hand the first layer) are trained, with
tune-reader's loss, KL(text prefill || KV mode + bridge) over text prefill's greedy reply.

The chat becomes [head][facts][bridge][tail]; the tail's positions move on by B, which RoPE
makes harmless (attention sees relative positions; the tail is further from the facts by B).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvmem.reader import kvmap
from kvmem.tune.lab import Example, FactKV, as_cache, memory_cache, reply_logits, teacher_reply
from kvmem.tune.measure import compare, kl_per_token, tie_aware
from kvmem.tune.train import reply_loss


@dataclass(frozen=True)
class BridgeConfig:
    tokens: int = 16  # B
    lr: float = 3e-3
    epochs: int = 2
    first_weight: float = 2.0  # the reply's first token counts this many times in the loss
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.epochs < 1 or not self.lr > 0 or not self.first_weight > 0:
            raise ValueError("tokens and epochs must be >= 1, lr and first_weight > 0")


def initial(model, token_id: int, n: int, seed: int = 0) -> torch.Tensor:
    """[n, hidden]: the embedding of `token_id` (a newline: what a fact list ends with), a little
    noise apart so the n tokens can learn different things."""
    emb = model.get_input_embeddings().weight
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, emb.shape[1], generator=g) * 0.01 * emb.std().item()
    return (emb[token_id].detach().float()[None] + noise).to(emb.dtype)


def bridged_logits(model, ex: Example, reply: tuple[int, ...], layers, bridge: torch.Tensor) -> torch.Tensor:
    """Logits [len(reply), vocab] predicting each reply token after [memory][bridge][tail]:
    `layers` the memory's KV (lab.memory_cache), bridge [B, hidden] input vectors (B may be 0)."""
    m, b = len(ex.memory_ids), bridge.shape[0]
    tail = model.get_input_embeddings()(torch.tensor([ex.tail + reply[:-1]]))  # [1, n, hidden]
    x = torch.cat([bridge[None].to(tail.dtype), tail], dim=1)  # [1, B + n, hidden]
    positions = torch.arange(m, m + x.shape[1])[None]
    logits = model(inputs_embeds=x, position_ids=positions, past_key_values=as_cache(model, layers),
                   use_cache=True).logits[0]
    return logits[b + len(ex.tail) - 1 :]


class Memory:
    """The KV-mode memory of examples as served: facts remembered once, through the KV map if any."""

    def __init__(self, model, kv_map: kvmap.KVMap | None) -> None:
        self.model, self.kv_map, self.facts = model, kv_map, FactKV()

    @torch.no_grad()
    def __call__(self, ex: Example):
        layers = memory_cache(self.model, ex, facts=self.facts)
        if self.kv_map is not None:
            layers = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), self.kv_map)
        return layers


def train(model, examples: list[Example], targets, memory: Memory, bridge: torch.Tensor, cfg: BridgeConfig,
          progress: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Distil text prefill into the bridge vectors; the model frozen. targets: per example the
    teacher's (reply, log-probs [len(reply), vocab]) (train.teacher_targets). -> (bridge, losses)."""
    for p in model.parameters():
        p.requires_grad_(False)
    bridge = bridge.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([bridge], lr=cfg.lr)
    losses: list[float] = []
    with tqdm(total=cfg.epochs * len(examples), desc="bridge tokens", unit="step", disable=not progress) as bar:
        for epoch in range(cfg.epochs):
            order = list(range(len(examples)))
            random.Random(cfg.seed + epoch).shuffle(order)
            for n in order:
                ex, (reply, teacher) = examples[n], targets[n]
                kl = kl_per_token(teacher, bridged_logits(model, ex, reply, memory(ex), bridge))
                loss = reply_loss(kl, cfg.first_weight)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                bar.update()
                bar.set_postfix(kl=f"{statistics.fmean(losses[-20:]):.4f}")
    return bridge.detach(), losses


@torch.no_grad()
def evaluate(model, examples: list[Example], eos: set[int], memory: Memory, bridges: dict[str, torch.Tensor],
             reply_tokens: int = 16, progress: bool = True) -> dict[str, list[dict[str, float]]]:
    """KV mode as `memory` serves it, plain ("kv") and with each named bridge, against text prefill:
    per chat, measure.compare's row plus tie-aware first-token agreement (measure.summarize
    averages them)."""
    rows: dict[str, list] = {"kv": [], **{name: [] for name in bridges}}
    for ex in tqdm(examples, desc="measuring bridges", unit="chat", disable=not progress):
        reply, teacher = teacher_reply(model, ex, reply_tokens, eos)
        layers = memory(ex)
        students = {"kv": reply_logits(model, ex, reply, layers)}
        students.update({name: bridged_logits(model, ex, reply, layers, b) for name, b in bridges.items()})
        for name, student in students.items():
            rows[name].append({**compare(teacher, student), "first_agree_tie_aware": tie_aware(teacher, student)})
    return rows
