"""`kvmem tune-reader`: distil text prefill into the reader of KV-mode chats, through a map of the
injected facts' keys and values (reader/kvmap.py) and, when asked, a LoRA on the query projections.

Teacher: the base model prefilling [head][facts][tail] as text, and its greedy reply.
Student: the same model reading the facts' KV exactly as kvmem serves it (each fact encoded on
its own after the head and its context window, if it has one, keys moved to its serving
position; encoded without the adapter, as the engine encodes), the facts' KV put through the
KV map, then the tail and the reply computed (with the LoRA on the query projections, when
there is one).
Loss: KL(teacher || student) over the reply's next-token distributions. No labels are needed.

Work is kept in `<out>.work/`: the teacher's targets (computed once, in chunks) and a training
checkpoint, so an interrupted run resumes where it stopped; the folder is removed on success.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvmem.reader import kvmap, lora
from kvmem.tune.lab import Example, FactKV, check_rotary, memory_cache, reply_logits, teacher_reply
from kvmem.tune.measure import kl_per_token
from kvmem.tune.split import TUNE_CONVERSATIONS  # noqa: F401 - part of train's API (never the reported ones)

log = logging.getLogger(__name__)

CHUNK = 25  # teacher targets per file: a crash loses at most this many


@dataclass(frozen=True)
class TuneConfig:
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-3
    epochs: int = 2
    reply_tokens: int = 16
    seed: int = 0
    checkpoint_every: int = 50  # steps
    first_weight: float = 1.0  # the reply's first token counts this many times in the loss
    targets: tuple[str, ...] = ()  # the linear layers a LoRA wraps (q_proj...); () for no LoRA
    kv_map: bool = True  # train the KV map of the injected facts (reader/kvmap.py)
    map_lr: float = 3e-3  # its learning rate

    def __post_init__(self) -> None:
        if self.rank < 1 or self.epochs < 1 or self.reply_tokens < 1 or self.lr <= 0 or self.checkpoint_every < 1:
            raise ValueError("rank, epochs, reply_tokens and checkpoint_every must be >= 1 and lr > 0")
        if not self.map_lr > 0:
            raise ValueError(f"map_lr must be > 0, got {self.map_lr!r}")
        if not self.targets and not self.kv_map:
            raise ValueError("nothing to train: no LoRA targets and no KV map")
        if not self.first_weight > 0:
            raise ValueError(f"first_weight must be > 0, got {self.first_weight!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")


@dataclass(frozen=True)
class TuneReport:
    steps: int
    first_loss: float  # mean KL over the first epoch's first tenth
    last_loss: float  # mean KL over the last epoch's last tenth
    seconds: float
    adapter: Path


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def eos_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return {i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id}


def teacher_targets(model, wrapped, examples: list[Example], eos: set[int], reply_tokens: int, work: Path,
                    progress: bool = True) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Per example: the teacher's greedy reply and its log-probs [len(reply), vocab] (fp16)."""
    out: list = []
    with lora.disabled(wrapped), tqdm(total=len(examples), desc="teacher replies", unit="chat",
                                      disable=not progress) as bar:
        for c in range(0, len(examples), CHUNK):
            path = work / f"teacher-{c // CHUNK:05d}.pt"
            if path.exists():
                chunk = torch.load(path)
            else:
                chunk = []
                for ex in examples[c : c + CHUNK]:
                    reply, logits = teacher_reply(model, ex, reply_tokens, eos)
                    chunk.append((reply, logits.log_softmax(-1).half()))
                torch.save(chunk, path.with_suffix(".tmp"))
                path.with_suffix(".tmp").rename(path)
            out += chunk
            bar.update(len(chunk))
    return out


def tune(model, examples: list[Example], eos: set[int], out: Path, cfg: TuneConfig, meta: dict,
         progress: bool = True) -> TuneReport:
    """Train the adapter on `examples` and save it to `out` (PEFT layout + kvmem.json)."""
    if not examples:
        raise ValueError("no training examples")
    rotary = check_rotary(model)
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    for p in model.parameters():  # the base model stays frozen (attach freezes it too)
        p.requires_grad_(False)
    wrapped = lora.attach(model, cfg.rank, cfg.alpha, cfg.targets) if cfg.targets else []
    work = _work_dir(out, examples, cfg)
    targets = teacher_targets(model, wrapped, examples, eos, cfg.reply_tokens, work, progress)
    params = [p for _, m in wrapped for p in (m.lora_A, m.lora_B)]
    kv = _trainable_map(model, rotary) if cfg.kv_map else None
    groups = ([{"params": params, "lr": cfg.lr}] if params else []) + \
        ([{"params": list(kv.tensors()), "lr": cfg.map_lr}] if kv else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    step, losses = _resume(work, wrapped, opt, kv)
    facts = FactKV()
    total = cfg.epochs * len(examples)
    with tqdm(total=total, initial=step, desc="tuning reader", unit="step", disable=not progress) as bar:
        while step < total:
            epoch, i = divmod(step, len(examples))
            order = list(range(len(examples)))
            random.Random(cfg.seed + epoch).shuffle(order)  # a fixed order per epoch: resuming replays it
            n = order[i]
            losses.append(_step(model, wrapped, opt, examples[n], targets[n], facts, cfg.first_weight, kv))
            step += 1
            bar.update()
            bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
            if step % cfg.checkpoint_every == 0:
                _checkpoint(work, wrapped, opt, step, losses, kv)
    lora.save(wrapped, out, rank=cfg.rank, alpha=cfg.alpha, base_model=meta.get("model", ""),
              meta={**meta, "tune": asdict(cfg), "examples": len(examples), "steps": step, "losses": losses},
              kv_map=kv)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    tenth = max(1, len(examples) // 10)
    return TuneReport(step, sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth,
                      time.perf_counter() - start, out)


def _work_dir(out: Path, examples: list[Example], cfg: TuneConfig) -> Path:
    """`<out>.work`, emptied first when it holds another run's work (other examples or settings)."""
    import hashlib

    key = hashlib.sha256(repr((examples, asdict(cfg))).encode()).hexdigest()
    work = Path(str(out) + ".work")
    stale = work.exists() and (not (work / "key").exists() or (work / "key").read_text() != key)
    if stale:
        log.info("%s holds another run's work: starting over", work)
        for f in work.iterdir():
            f.unlink()
    work.mkdir(parents=True, exist_ok=True)
    (work / "key").write_text(key)
    return work


@torch.no_grad()
def evaluate(model, wrapped, examples: list[Example], eos: set[int], reply_tokens: int = 16,
             progress: bool = True, kv_map: kvmap.KVMap | None = None) -> dict[str, dict[str, float]]:
    """KV mode without and with the adapter (its LoRA, if `wrapped` has one, and its KV map, if
    given), each against text prefill (see measure.compare)."""
    from kvmem.tune.measure import compare, summarize

    rows: dict[str, list] = {"kv": [], "kv+adapter": []}
    facts = FactKV()
    for ex in tqdm(examples, desc="evaluating reader", unit="chat", disable=not progress):
        with lora.disabled(wrapped):
            reply, teacher = teacher_reply(model, ex, reply_tokens, eos)
            layers = memory_cache(model, ex, facts=facts)
            rows["kv"].append(compare(teacher, reply_logits(model, ex, reply, layers)))
        if kv_map is not None:
            layers = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), kv_map)
        rows["kv+adapter"].append(compare(teacher, reply_logits(model, ex, reply, layers)))
    return {name: summarize(r) for name, r in rows.items()}


def reply_loss(kl: torch.Tensor, first_weight: float = 1.0) -> torch.Tensor:
    """Weighted mean of the per-token KL [n] of a reply. The first token is the one a chat's
    answer turns on (and the one the engine's fidelity numbers measure): `first_weight` > 1
    gives it that many tokens' share of the loss."""
    weights = torch.ones_like(kl)
    weights[0] = first_weight
    return (kl * weights).sum() / weights.sum()


def _trainable_map(model, rotary: int) -> kvmap.KVMap:
    """A KV map for this model (rotating `rotary` dims of each head) that changes nothing yet,
    its tensors trainable."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return kvmap.KVMap.identity(c.num_hidden_layers, c.num_key_value_heads, head_dim, requires_grad=True,
                                rotary_dim=rotary)


def _step(model, wrapped, opt, ex: Example, target, facts: FactKV, first_weight: float = 1.0,
          kv: kvmap.KVMap | None = None) -> float:
    reply, teacher = target
    with torch.no_grad(), lora.disabled(wrapped):
        layers = memory_cache(model, ex, facts=facts)  # the engine encodes facts without the adapter
    if kv is not None:  # the head stays as computed: only the facts' KV is mapped at injection
        layers = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), kv)
    loss = reply_loss(kl_per_token(teacher, reply_logits(model, ex, reply, layers)), first_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def _checkpoint(work: Path, wrapped, opt, step: int, losses: list[float], kv=None) -> None:
    state = {"step": step, "losses": losses, "opt": opt.state_dict(),
             "lora": {name: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for name, m in wrapped},
             "kv_map": tuple(t.detach().clone() for t in kv.tensors()) if kv else None}
    torch.save(state, work / "state.tmp")
    (work / "state.tmp").rename(work / "state.pt")


def _resume(work: Path, wrapped, opt, kv=None) -> tuple[int, list[float]]:
    path = work / "state.pt"
    if not path.exists():
        return 0, []
    state = torch.load(path)
    with torch.no_grad():
        for name, m in wrapped:
            a, b = state["lora"][name]
            m.lora_A.copy_(a)
            m.lora_B.copy_(b)
        for t, saved in zip(kv.tensors() if kv else (), state.get("kv_map") or ()):
            t.copy_(saved)
    opt.load_state_dict(state["opt"])
    log.info("resuming reader tuning at step %d", state["step"])
    return state["step"], list(state["losses"])
