"""EAGLE-style draft head: predicts the target's next hidden state from its current one.

The head owns one fc and one Llama-style decoder layer; the token embedding and
the LM head are the target's own tensors, passed in and never copied or saved::

    hidden_t  [n, H] (target, final-norm) ─┐
                                           ├─ concat [n, 2H] ─ fc ─► x [n, H]
    embed(token_{t+1}) [n, H] ─────────────┘
    x = x + attn(rms_norm(x))        causal over the n rows given, RoPE at `positions`
    x = x + mlp(rms_norm(x))         silu(gate) * up -> down
    next_hidden = x   [n, H]         regressed onto the target's hidden_{t+1}
    logits = next_hidden @ lm_head.T [n, V]   (softcapped when the target is)

Row r pairs the target's hidden state at position t with the token at t + 1 and
predicts the hidden state (and so the token) at t + 2. Drafting k tokens feeds
each prediction back in as the next row's hidden state. No KV cache is kept
between calls: every call attends over exactly the rows it is given.

Serving packs the projections once (`pack_for_inference`): k/v and gate/up
fused, each a `LinearWeight` (oneDNN or the GEMV kernel on the CPU, where
nn.Linear's MKL path is several times slower at a few rows). Training mode drops
the packs, so they never go stale.

Drafting needs the layer's output for one row per window only, the last: the
rows before it contribute keys and values and nothing else. So serving splits
the layer (`draft_rows`: fc, norm and k/v for every row; `attend_last`: q,
attention, o and the MLP for the one query row), and each draft adds one row's
keys and values instead of re-running the window: per draft position 0.9M
multiply-adds a window row (fc and k/v) instead of the whole layer's 4.2M
(SmolLM2), the MLP being 63% of it.

Weights live in one safetensors file: the head's parameters plus its config as
JSON metadata (`save` / `EagleHead.load`); the target's tensors are not in it.

Draft vocabulary (optional, as in EAGLE-3): `draft_token_ids` [V_d] names the
tokens the head may propose, the most frequent in its training text. Drafting
then scores `next_hidden @ lm_head[draft_token_ids].T` instead of the whole
vocabulary, which on a small target is most of a draft step's cost.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shared.errors import ConfigError
from shared.models.common import RotaryEmbedding, apply_rope, rms_norm, rotate
from shared.models.decoder import DecoderSpec
from shared.ops.linear import LinearWeight

__all__ = ["EagleHead", "EagleHeadConfig"]

_CONFIG_KEY = "baton_eagle_config"
_INIT_STD = 0.02


@dataclass(frozen=True)
class _PackedProjections:
    fc: LinearWeight
    q: LinearWeight
    kv: LinearWeight
    o: LinearWeight
    gate_up: LinearWeight
    down: LinearWeight


def _apply(lin: LinearWeight, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
    return lin(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], lin.out_features)


@dataclass(frozen=True)
class EagleHeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 8192
    embed_scale: float | None = None  # Gemma scales embeddings by sqrt(hidden)
    final_logit_softcap: float | None = None

    @classmethod
    def from_decoder_spec(cls, spec: DecoderSpec) -> EagleHeadConfig:
        """A head shaped like one layer of the target (full-attention RoPE base)."""
        return cls(
            hidden_size=spec.hidden_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size,
            rms_eps=spec.rms_eps,
            rope_theta=max(spec.layer_rope_theta),
            max_positions=spec.max_positions,
            embed_scale=spec.embed_scale,
            final_logit_softcap=spec.final_logit_softcap,
        )


class EagleHead(nn.Module):
    """fc over [hidden, embedding] plus one decoder layer; see the module docstring."""

    def __init__(
        self,
        config: EagleHeadConfig,
        embed: torch.Tensor,  # [vocab, hidden] the target's, shared
        lm_head: torch.Tensor,  # [vocab, hidden] the target's, shared
        generator: torch.Generator | None = None,
        draft_token_ids: torch.Tensor | None = None,  # [draft_vocab] int64: ids the head may propose
    ) -> None:
        super().__init__()
        c = config
        expected = (c.vocab_size, c.hidden_size)
        for name, t in (("embed", embed), ("lm_head", lm_head)):
            if tuple(t.shape) != expected:
                raise ConfigError(f"EAGLE head expects {name} of shape {expected}, got {tuple(t.shape)}")
        self.config = c
        # plain attributes, not parameters or buffers: never trained, moved or saved with the head
        self.embed = embed
        self.lm_head = lm_head
        h, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, q_size, bias=False)
        self.k_proj = nn.Linear(h, kv_size, bias=False)
        self.v_proj = nn.Linear(h, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, h, bias=False)
        self.post_attention_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.to(device=embed.device, dtype=embed.dtype)
        self.draft_token_ids: torch.Tensor | None
        if draft_token_ids is not None:
            self.register_buffer("draft_token_ids", draft_token_ids.to(device=embed.device, dtype=torch.int64))
        else:
            self.draft_token_ids = None
        self.reset_parameters(generator)
        self._rope: RotaryEmbedding | None = None
        self._packed: _PackedProjections | None = None

    @torch.no_grad()
    def pack_for_inference(self) -> None:
        """Serve the projections from packed copies of the current weights (see the module docstring)."""
        def lin(*modules: nn.Linear) -> LinearWeight:
            return LinearWeight(torch.cat([m.weight.detach() for m in modules]))

        self._packed = _PackedProjections(fc=lin(self.fc), q=lin(self.q_proj), kv=lin(self.k_proj, self.v_proj),
                                          o=lin(self.o_proj), gate_up=lin(self.gate_proj, self.up_proj),
                                          down=lin(self.down_proj))

    def train(self, mode: bool = True) -> EagleHead:
        if mode:
            self._packed = None  # the weights are about to change
        return super().train(mode)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random init: N(0, 0.02) projections, unit norms (on the CPU, so a seed gives the same weights anywhere)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                w = torch.empty(module.weight.shape).normal_(0.0, _INIT_STD, generator=generator)
                module.weight.copy_(w)
        self.input_norm.fill_(1.0)
        self.post_attention_norm.fill_(1.0)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if self._rope is None or self._rope.cos.device != positions.device:
            self._rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_positions, positions.device)
        return self._rope.cos_sin(positions, dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden] target hidden states at positions t
        token_ids: torch.Tensor,  # [n] tokens at positions t + 1
        positions: torch.Tensor | None = None,  # [n] positions t + 1 (RoPE); default 0 .. n - 1
    ) -> tuple[torch.Tensor, torch.Tensor]:  # next_hidden [n, hidden], logits [n, vocab] float32
        x = self.forward_hidden(hidden, token_ids, positions)
        logits = F.linear(x, self.lm_head).float()
        c = self.config
        if c.final_logit_softcap is not None:
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return x, logits

    def forward_hidden(
        self,
        hidden: torch.Tensor,  # [n, hidden] target hidden states at positions t
        token_ids: torch.Tensor,  # [n] tokens at positions t + 1
        positions: torch.Tensor | None = None,  # [n] positions t + 1 (RoPE); default 0 .. n - 1
        attn_mask: torch.Tensor | None = None,  # [n, n] bool, True where a row may attend; default causal
    ) -> torch.Tensor:  # next_hidden [n, hidden]: the predicted target hidden states at t + 1
        n = hidden.shape[0]
        if positions is None:
            positions = torch.arange(n, device=hidden.device)
        mask = None if attn_mask is None else attn_mask[None]
        return self.forward_hidden_batch(hidden[None], token_ids[None], positions[None], mask)[0]

    def forward_hidden_batch(
        self,
        hidden: torch.Tensor,  # [b, n, hidden] target hidden states at positions t
        token_ids: torch.Tensor,  # [b, n] tokens at positions t + 1
        positions: torch.Tensor,  # [b, n] positions t + 1 (RoPE)
        attn_mask: torch.Tensor | None = None,  # [b, n, n] bool, True where a row may attend; default causal
    ) -> torch.Tensor:  # [b, n, hidden]
        """`forward_hidden` over b windows at once (padded windows say so in `attn_mask`)."""
        c = self.config
        b, n = token_ids.shape
        p = self._packed
        features = torch.cat([hidden, self._embed_tokens(token_ids, hidden.dtype)], dim=-1)
        x = _apply(p.fc, features) if p is not None else self.fc(features)  # [b, n, hidden]

        h = rms_norm(x, self.input_norm, c.rms_eps)
        if p is not None:
            q, (k, v) = _apply(p.q, h), _apply(p.kv, h).chunk(2, dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q = q.reshape(b, n, c.num_heads, c.head_dim)
        k = k.reshape(b, n, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, n, c.num_kv_heads, c.head_dim)
        cos, sin = self._cos_sin(positions.reshape(-1), x.dtype)  # [b * n, 1, head_dim]
        q, k = apply_rope(q, k, (cos.view(b, n, 1, -1), sin.view(b, n, 1, -1)))
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if attn_mask is None else attn_mask[:, None],
            is_causal=attn_mask is None, scale=c.head_dim**-0.5, enable_gqa=True,
        )  # fmt: skip
        attn = attn.transpose(1, 2).reshape(b, n, -1)
        x = x + (_apply(p.o, attn) if p is not None else self.o_proj(attn))

        h = rms_norm(x, self.post_attention_norm, c.rms_eps)
        if p is not None:
            gate, up = _apply(p.gate_up, h).chunk(2, dim=-1)
            return x + _apply(p.down, F.silu(gate) * up)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    @torch.no_grad()
    def draft_rows(
        self,
        hidden: torch.Tensor,  # [b, n, hidden] target (or drafted) hidden states at positions t
        token_ids: torch.Tensor,  # [b, n] tokens at positions t + 1
        positions: torch.Tensor,  # [b, n] positions t + 1 (RoPE)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x [b, n, hidden], k and v [b, n, kv_heads, head_dim]
        """Each row's residual stream after fc and its attention key and value (RoPE applied): all that a later
        row's query needs from it (serving only: needs `pack_for_inference`)."""
        c, p = self.config, self._require_packed()
        b, n = token_ids.shape
        x = _apply(p.fc, torch.cat([hidden, self._embed_tokens(token_ids, hidden.dtype)], dim=-1))
        k, v = _apply(p.kv, rms_norm(x, self.input_norm, c.rms_eps)).chunk(2, dim=-1)
        k = rotate(k.reshape(b * n, c.num_kv_heads, c.head_dim), self._cos_sin(positions.reshape(-1), x.dtype))
        return x, k.view(b, n, c.num_kv_heads, c.head_dim), v.reshape(b, n, c.num_kv_heads, c.head_dim)

    @torch.no_grad()
    def attend_last(
        self,
        x: torch.Tensor,  # [b, hidden] the query row's residual stream (from draft_rows)
        positions: torch.Tensor,  # [b] its positions
        k: torch.Tensor,  # [b, L, kv_heads, head_dim] keys of the rows it may see, itself included
        v: torch.Tensor,  # [b, L, kv_heads, head_dim]
        key_mask: torch.Tensor,  # [b, L] bool, True where the query may attend
    ) -> torch.Tensor:  # [b, hidden]: the layer's output for the query row, the predicted next hidden state
        """The rest of the layer for one query row per window: equals the last row of `forward_hidden_batch`
        over the same rows (to fp32 rounding)."""
        c, p = self.config, self._require_packed()
        q = _apply(p.q, rms_norm(x, self.input_norm, c.rms_eps)).view(-1, c.num_heads, c.head_dim)
        q = rotate(q, self._cos_sin(positions, x.dtype))
        attn = F.scaled_dot_product_attention(
            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask[:, None, None],
            scale=c.head_dim**-0.5, enable_gqa=True,
        )  # fmt: skip  # [b, heads, 1, head_dim]
        x = x + _apply(p.o, attn.reshape(x.shape[0], -1))
        gate, up = _apply(p.gate_up, rms_norm(x, self.post_attention_norm, c.rms_eps)).chunk(2, dim=-1)
        return x + _apply(p.down, F.silu(gate) * up)

    def _require_packed(self) -> _PackedProjections:
        if self._packed is None:
            raise RuntimeError("EAGLE head drafting needs pack_for_inference() first (and eval mode)")
        return self._packed

    def _embed_tokens(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        emb = F.embedding(token_ids, self.embed).to(dtype)
        scale = self.config.embed_scale
        return emb if scale is None else emb * scale

    def save(self, path: str | Path) -> None:
        """The head's own weights and config to one safetensors file (the shared tensors stay out)."""
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(path), metadata={_CONFIG_KEY: json.dumps(asdict(self.config))})

    @classmethod
    def load(
        cls,
        path: str | Path,
        embed: torch.Tensor,  # [vocab, hidden] the target's
        lm_head: torch.Tensor,  # [vocab, hidden] the target's
    ) -> EagleHead:
        """A head saved by `save`, on the device and in the dtype of `embed`."""
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if _CONFIG_KEY not in metadata:
                raise ConfigError(f"{path} is not an EAGLE head saved by baton (no {_CONFIG_KEY} metadata)")
            config = EagleHeadConfig(**json.loads(metadata[_CONFIG_KEY]))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        head = cls(config, embed, lm_head, draft_token_ids=tensors.get("draft_token_ids"))
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ConfigError(f"EAGLE head file {path}: missing {missing}, unexpected {unexpected}")
        return head
