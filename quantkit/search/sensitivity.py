"""Measured sensitivity: how much the worst domain's KLD against the original grows when one fused group of Linears
alone takes a candidate grid.

Block by block over the original model: the calibration windows' inputs to the block give each Linear's Hessian
(the original's inputs: no error feedback, so every group is judged in the unquantized model around it); each
candidate's weights come from the recipe's weight method on that Hessian (GPTQ's solve, or its rounding); and the
group's candidate weights are swapped in while the scored text runs from the block's cached input to the logits.

Measuring every group at every candidate costs one forward of the model's tail each. By default a group is measured
at its lossiest candidate only (the largest Hessian-weighted output error tr(δHδᵀ)), and the other candidates'
increases are that one scaled by their error: KLD grows with the square of a small perturbation, as the output
error does. `checks` groups are measured at every candidate too, and search.json reports how well the scaling
agreed there; `measure: all` measures everything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import data, self_text
from ..algorithms.fp4 import FUSED
from ..algorithms.gptq import GPTQ, Hessian, NotPositiveDefinite
from ..algorithms.grid import GridSpec
from ..errors import QuantkitError
from ..evaluation.streamed import _Pass, _Replay
from ..files import write_json_atomic
from ..model import Loaded
from ..progress import Reporter
from ..quantize.capture import capture_block_inputs
from .config import Search

MICRO = 32  # calibration windows per block forward
SELF_TOKENS = 2048


@dataclass
class Sample:
    """The scored text: windows of every domain, with the original's log-probs and its hidden states at each
    block's input."""

    domains: list[str]
    ids: torch.Tensor  # [W, L]
    domain: torch.Tensor  # [W] index into domains
    base_p: torch.Tensor  # [W, L - 1, V] the original's next-token probabilities
    neg_entropy: torch.Tensor  # [W, L - 1]: Σ p ln p
    hidden: list[torch.Tensor]  # per block: its input [W, L, H]

    def kld(self, logits: torch.Tensor) -> list[float]:
        """Mean KL(original ‖ model) = Σ p ln p − Σ p ln q per token, per domain."""
        logq = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        per = (self.neg_entropy - (self.base_p * logq).sum(-1)).mean(-1)  # [W]
        return [float(per[self.domain == d].mean()) for d in range(len(self.domains))]


def _domain_ids(name: str, cfg: Search, loaded: Loaded, spec: str, dtype: str, seed: int,
                report: Reporter) -> torch.Tensor:
    windows = -(-cfg.tokens // cfg.seq_len)
    need = windows * cfg.seq_len
    if name == data.SELF:  # fresh text of the original's, not the calibration's nor the evaluation's
        # one stream of at least SELF_TOKENS, cached whatever `tokens` asks, its end scored as the files' are
        ids = self_text.tokens(spec, max(need, SELF_TOKENS), "calibration", dtype, torch.device("cpu"), report,
                               load=lambda: loaded, seed=seed + 1, batch_size=8)[-need:]
    else:
        path = data.resolve(name, "calibration", "search.domains")
        text = data.read_text(path, "text", "search.domains", data.chat_renderer(loaded.tokenizer, None))
        ids = data.token_ids(loaded.tokenizer, text, add_special_tokens=False)
        if ids.numel() < need:
            raise QuantkitError(f"search.domains: {name} has {ids.numel()} tokens, the search scores {need} "
                                "(lower search.tokens)")
        ids = ids[-need:]  # the split's end: calibration windows are drawn at random, mostly elsewhere
    return ids.view(windows, cfg.seq_len)


@torch.no_grad()
def score_sample(cfg: Search, loaded: Loaded, blocks: nn.ModuleList, spec: str, dtype: str, seed: int,
                 report: Reporter) -> Sample:
    names = [data.domain_name(d) for d in data.expand(cfg.domains)]
    rows = [_domain_ids(d, cfg, loaded, spec, dtype, seed, report) for d in data.expand(cfg.domains)]
    ids = torch.cat(rows)
    domain = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)])
    hidden: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a, k: hidden.append(_hidden_of(a, k).clone()), with_kwargs=True)
             for b in blocks]
    try:
        logits = loaded.model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    p = logp.exp()
    return Sample(names, ids, domain, p, (p * logp).sum(-1), hidden)


def _hidden_of(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _AllWindows(_Replay):
    """Stands in for block 0: every scored window's hidden state at block i."""

    def forward(self, hidden_states, *args, **kwargs):
        return self.hidden.to(hidden_states.dtype)


@torch.no_grad()
def tail_kld(model: nn.Module, blocks: nn.ModuleList, i: int, sample: Sample) -> list[float]:
    """Per-domain KLD of the model with its current weights, the text entering block i from the original."""
    real = list(blocks)
    if i > 0:
        blocks[0] = _AllWindows(sample.hidden[i])
        for j in range(1, i):
            blocks[j] = _Pass()
    try:
        return sample.kld(model(input_ids=sample.ids, use_cache=False).logits)
    finally:
        for j in range(i):
            blocks[j] = real[j]


def shared_inputs(names: list[str]) -> dict[str, str]:
    """Linear -> the Linear whose input Hessian it uses: q/k/v (and gate/up, ...) read one tensor."""
    first: dict[tuple[str, tuple[str, ...]], str] = {}
    out = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        key = next(((parent, f) for f in FUSED if leaf in f), (n, ()))
        out[n] = first.setdefault(key, n)
    return out


@dataclass
class Solver:
    """The recipe's weight method for one Linear at one grid, from the Hessian of its input."""

    args: object  # the weight stage's arguments
    solves: bool  # GPTQ-like: solved from the Hessian; otherwise the method's rounding

    def weights(self, ws: list[torch.Tensor], h: torch.Tensor, spec: GridSpec, method, where: str
                ) -> list[torch.Tensor]:
        """Dequantized weights of the Linears `ws` (which read one input) on grid `spec`."""
        args = self.args.model_copy(update={"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym})
        if self.solves:
            try:
                gptq = GPTQ(h, spec, args.damp, args.block_size, args.act_order, observer=args.observer)
            except NotPositiveDefinite as err:
                raise QuantkitError(f"search: {where}: {err}; raise damp") from None
            return [qw.dequantize(w.dtype) for w, (qw, _) in zip(ws, gptq.quantize_many(ws))]
        out = []
        for w in ws:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            lin.weight.data = w.clone()
            method.round(lin, args, spec)
            out.append(lin.weight.data)
        return out


def output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr(δ H δᵀ): the squared error the Linear's output takes over the calibration inputs (H = 2/n Σ xᵀx)."""
    d = (w.float() - q.float())
    return float(((d @ h) * d).sum())


def block_hessians(block: nn.Module, linears: dict[str, nn.Linear], share: dict[str, str], hidden: torch.Tensor,
                   calls: dict[int, tuple], gram_dtype: torch.dtype) -> tuple[dict[str, Hessian], torch.Tensor]:
    """The Hessian of each shared input of the block's Linears over the calibration windows, and the block's
    output (original weights)."""
    hess: dict[str, Hessian] = {}

    def hook(name):
        def pre(m, args):
            x = args[0]
            hess.setdefault(name, Hessian(x.shape[-1], gram_dtype=gram_dtype)).add(x.detach())
        return pre

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items() if share[n] == n]
    out = torch.empty_like(hidden)
    try:
        for s in range(0, len(hidden), MICRO):
            chunk = hidden[s:s + MICRO]
            args, kwargs = calls[len(chunk)]
            y = block(chunk, *args, **kwargs)
            out[s:s + MICRO] = y[0] if isinstance(y, tuple) else y
    finally:
        for h in hooks:
            h.remove()
    return hess, out


def call_args(model: nn.Module, blocks: nn.ModuleList, tokens: torch.Tensor) -> list[dict[int, tuple]]:
    """Each block's call arguments (masks, rotary embeddings) for a micro-batch of windows, and for the last, shorter
    one (a forward that stops before the first block: cheap)."""
    out: list[dict[int, tuple]] = [{} for _ in blocks]
    for n in {min(MICRO, len(tokens)), len(tokens) % MICRO or MICRO}:
        _, calls = capture_block_inputs(model, blocks, tokens[:n])
        for i, call in enumerate(calls):
            out[i][n] = call
    return out


class BlockCache:
    """Each finished block's measurements in a JSON file keyed by what they depend on: a killed search resumes."""

    def __init__(self, folder: Path, key: dict):
        self.folder, self.key = folder, key
        folder.mkdir(parents=True, exist_ok=True)

    def get(self, i: int) -> dict | None:
        path = self.folder / f"block_{i:04d}.json"
        if not path.is_file():
            return None
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return body["data"] if body.get("key") == self.key else None

    def put(self, i: int, body: dict) -> None:
        write_json_atomic(self.folder / f"block_{i:04d}.json", {"key": self.key, "data": body})
