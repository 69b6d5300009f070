"""Model code lightdist did not write, in LightningModules written the way their users write them: the network in an
attribute, the step calling it (``self.model(x)``, keywords, a tuple or a Hugging Face output back, the model's own
loss from ``labels``), an optimizer of its own. The equivalence suite trains each under every layout.

``GPT`` is nanoGPT's model (github.com/karpathy/nanoGPT, ``model.py``), kept as written there: attention that cuts its
fused projection with ``split(self.n_embd)`` and reshapes with the input's global sizes, weights initialised in
``__init__``, the LM head tied to the token embedding, ``forward(idx, targets)`` returning ``(logits, loss)``.
``LitGPT`` trains LitGPT's own ``GPT`` (pip's ``litgpt``), whose attention reads its head counts from the config
object every block shares and gets its rotary tables as arguments. ``LectureGPT`` trains the GPT of Karpathy's
lecture "Let's build GPT" (``ng-video-lecture``'s ``gpt.py``): a module per head, blocks in an ``nn.Sequential``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import litgpt
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightdist.models.data import ARITHMETIC_ALPHABET, arithmetic_corpus


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True  # False: nanoGPT's slow path (PyTorch < 2.0): attention by hand, the causal mask a buffer


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention") and config.flash
        if not self.flash:
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer(
                "bias",
                torch.tril(torch.ones(config.block_size, config.block_size)).view(
                    1, 1, config.block_size, config.block_size
                ),
            )

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
            )
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless. TODO investigate
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            # if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None

        return logits, loss


class SlicedPositionsGPT(GPT):
    """nanoGPT's ``GPT`` with the position table of minGPT's first ``model.py``: an ``nn.Parameter`` of (1, block_size,
    n_embd) sliced by the sequence's length (``self.pos_emb[:, :t, :]``), not an embedding positions are looked up in."""

    def __init__(self, config):
        super().__init__(config)
        del self.transformer["wpe"]
        self.pos_emb = nn.Parameter(torch.randn(1, config.block_size, config.n_embd) * 0.02)

    def forward(self, idx, targets):
        x = self.transformer.drop(self.transformer.wte(idx) + self.pos_emb[:, : idx.size(1), :])
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class TablePositionsGPT(SlicedPositionsGPT):
    """The position table as a plain (block_size, n_embd) ``nn.Parameter``, its first ``t`` rows added to the token
    embeddings by broadcasting (``self.pos_emb[:t]``)."""

    def __init__(self, config):
        super().__init__(config)
        self.pos_emb = nn.Parameter(torch.randn(config.block_size, config.n_embd) * 0.02)

    def forward(self, idx, targets):
        x = self.transformer.drop(self.transformer.wte(idx) + self.pos_emb[: idx.size(1)])
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


# PyTorch's tutorial "Language Modeling with nn.Transformer" (pytorch/tutorials, ``transformer_tutorial.py``), kept as
# written there: fixed sinusoids in a buffer of (max_len, 1, d_model), added to sequence-first embeddings.
class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)

        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x: Tensor) -> Tensor:
        """
        Arguments:
            x: Tensor, shape ``[seq_len, batch_size, embedding_dim]``
        """
        x = x + self.pe[: x.size(0)]
        return self.dropout(x)


class SinusoidalPositionsGPT(SlicedPositionsGPT):
    """nanoGPT's ``GPT`` with the tutorial's ``PositionalEncoding`` in place of its learned positions, given the token
    embeddings sequence-first as the tutorial's model gives them."""

    def __init__(self, config):
        super().__init__(config)
        del self.pos_emb
        self.pos_encoder = PositionalEncoding(config.n_embd, config.dropout, config.block_size)

    def forward(self, idx, targets):
        x = self.pos_encoder(self.transformer.wte(idx).transpose(0, 1)).transpose(0, 1)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class NanoGPT(LightningModule):
    """nanoGPT's ``GPT`` (or ``network``, another like it) as ``self.model``; the step unpacks its ``(logits, loss)``.
    The learning rate warms up as nanoGPT's ``train.py`` warms it up."""

    def __init__(self, learning_rate: float, warmup_steps: int, network: type[GPT] = GPT, **config: Any) -> None:
        super().__init__()
        self.learning_rate, self.warmup_steps = learning_rate, warmup_steps
        self.model = network(GPTConfig(**config))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # nanoGPT's targets.view(-1) needs them whole
        logits, loss = self.model(x, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.learning_rate, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / (self.warmup_steps + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


# The GPT of Karpathy's lecture "Let's build GPT" (github.com/karpathy/ng-video-lecture, ``gpt.py``), kept as written
# there but for its sizes, module globals there, arguments here: heads as modules of their own, each attending by hand
# under a ``tril`` buffer sliced ``[:T, :T]``, their outputs joined by ``torch.cat``; the blocks in an nn.Sequential.


class Head(nn.Module):
    """one head of self-attention"""

    def __init__(self, n_embd, head_size, block_size, dropout):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        # input of size (batch, time-step, channels)
        # output of size (batch, time-step, head size)
        B, T, C = x.shape
        k = self.key(x)  # (B,T,hs)
        q = self.query(x)  # (B,T,hs)
        # compute attention scores ("affinities")
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))  # (B, T, T)
        wei = F.softmax(wei, dim=-1)  # (B, T, T)
        wei = self.dropout(wei)
        # perform the weighted aggregation of the values
        v = self.value(x)  # (B,T,hs)
        out = wei @ v  # (B, T, T) @ (B, T, hs) -> (B, T, hs)
        return out


class MultiHeadAttention(nn.Module):
    """multiple heads of self-attention in parallel"""

    def __init__(self, n_embd, num_heads, head_size, block_size, dropout):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, head_size, block_size, dropout) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        out = self.dropout(self.proj(out))
        return out


class FeedFoward(nn.Module):
    """a simple linear layer followed by a non-linearity"""

    def __init__(self, n_embd, dropout):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.ReLU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x):
        return self.net(x)


class LectureBlock(nn.Module):
    """Transformer block: communication followed by computation"""

    def __init__(self, n_embd, n_head, block_size, dropout):
        # n_embd: embedding dimension, n_head: the number of heads we'd like
        super().__init__()
        head_size = n_embd // n_head
        self.sa = MultiHeadAttention(n_embd, n_head, head_size, block_size, dropout)
        self.ffwd = FeedFoward(n_embd, dropout)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        x = x + self.ffwd(self.ln2(x))
        return x


class GPTLanguageModel(nn.Module):
    def __init__(self, vocab_size=64, n_embd=64, n_head=4, n_layer=4, block_size=64, dropout=0.0):
        super().__init__()
        # each token directly reads off the logits for the next token from a lookup table
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[LectureBlock(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)  # final layer norm
        self.lm_head = nn.Linear(n_embd, vocab_size)

        # better init, not covered in the original GPT video, but important, will cover in followup video
        self.apply(self._init_weights)

    _init_weights = GPT._init_weights  # the lecture's own is nanoGPT's, word for word

    def forward(self, idx, targets=None):
        B, T = idx.shape

        # idx and targets are both (B,T) tensor of integers
        tok_emb = self.token_embedding_table(idx)  # (B,T,C)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))  # (T,C)
        x = tok_emb + pos_emb  # (B,T,C)
        x = self.blocks(x)  # (B,T,C)
        x = self.ln_f(x)  # (B,T,C)
        logits = self.lm_head(x)  # (B,T,vocab_size)

        if targets is None:
            loss = None
        else:
            B, T, C = logits.shape
            logits = logits.view(B * T, C)
            targets = targets.view(B * T)
            loss = F.cross_entropy(logits, targets)

        return logits, loss


class LectureGPT(LightningModule):
    """The lecture's ``GPTLanguageModel`` as ``self.model``, trained on the ``(x, y)`` pairs its ``get_batch`` makes;
    the step unpacks its ``(logits, loss)``. With its blocks in an nn.Sequential, pipeline stages are cut by torch's
    tracer, from the step's call of ``self.model``."""

    def __init__(self, learning_rate: float, warmup_steps: int) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.model = GPTLanguageModel()

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        xb, yb = batch
        logits, loss = self.model(xb, yb)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate)


HF_TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4)
# GPT-2 (Conv1D projections, learned positions, tied embeddings) under its own config names, without dropout.
HF_TINY_GPT2 = dict(
    model_type="gpt2",
    vocab_size=64,
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
# Mixture-of-Experts families: 8 experts, 2 per token, each family's own names for the sizes.
HF_TINY_MOE = dict(
    HF_TINY, num_hidden_layers=2, num_key_value_heads=2, num_experts_per_tok=2, router_aux_loss_coef=0.02
)
HF_MOE_FAMILIES = {
    "mixtral": dict(num_local_experts=8, intermediate_size=64),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, head_dim=16),
    "olmoe": dict(num_experts=8, intermediate_size=64),
    # A shared expert beside the routed ones, gated by its own sigmoid.
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=64, shared_expert_intermediate_size=128),
    # Fine-grained routed experts and a shared one, the first layer dense, latent attention, group-limited routing.
    "deepseek_v3": dict(
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=32,
        intermediate_size=128,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}


class HuggingFaceLabels(LightningModule):
    """A Hugging Face causal LM as ``self.model``, computing its own loss from ``labels`` (``.loss``), as Hugging
    Face's examples train it."""

    def __init__(self, learning_rate: float, warmup_steps: int, **config: object) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class HuggingFaceLogits(HuggingFaceLabels):
    """The same model, its ``.logits`` taken and the loss computed in the step."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self.model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss


class HuggingFaceShiftedLogits(HuggingFaceLabels):
    """The same model fed the whole window, the logits and labels shifted in the step, as Hugging Face's own loss was
    written before transformers 4.46 and many steps still are."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self.model(input_ids=batch).logits
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = batch[..., 1:].contiguous()
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss


class HuggingFaceBaseAndHead(HuggingFaceLabels):
    """The base model called for hidden states, the LM head applied in the step, as users computing the loss in
    chunks write it."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        hidden = self.model.model(input_ids=batch[:, :-1]).last_hidden_state
        logits = self.model.lm_head(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class LitGPT(LightningModule):
    """LitGPT's ``GPT`` from a tiny Llama-style ``Config`` (grouped-query attention with a fused ``qkv``, a SwiGLU
    MLP, RMSNorm), called as ``self.model(x)`` and the loss computed in the step, as LitGPT's pretraining does.
    ``config`` overrides the ``Config``'s fields (``mlp_class_name="LLaMAMoE"``: LitGPT's Mixtral-style MoE)."""

    def __init__(self, learning_rate: float, warmup_steps: int, **config: Any) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        tiny_llama = dict(
            block_size=64,
            vocab_size=64,
            padded_vocab_size=64,
            n_layer=4,
            n_head=4,
            n_query_groups=2,
            n_embd=64,
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP",
            intermediate_size=176,
        )
        config = litgpt.Config(**(tiny_llama | config))
        self.model = litgpt.GPT(config)
        self.model.apply(self.model._init_weights)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class HuggingFaceFineTuning(LightningModule):
    """A Hugging Face causal LM fine-tuned as its examples train it: the collator's batch (``input_ids``,
    ``attention_mask``, ``labels`` at -100 on padding) passed whole to the model, its loss and perplexity logged,
    a validation step, the learning rate warmed up by a scheduler Lightning steps every step."""

    def __init__(self, learning_rate: float, warmup_steps: int, **config: object) -> None:
        super().__init__()
        self.learning_rate, self.warmup_steps = learning_rate, warmup_steps
        self.model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))

    def training_step(self, batch: transformers.BatchEncoding, batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_perplexity", torch.exp(loss), sync_dist=True)
        return loss

    def validation_step(self, batch: transformers.BatchEncoding, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.learning_rate)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / self.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class HuggingFaceFineTuningOwnLoss(HuggingFaceFineTuning):
    """The same fine-tuning with the loss computed in the step from ``.logits``, over the labelled tokens, and the
    count of those tokens given to lightdist, which cannot see into the step's loss (``loss_tokens``)."""

    def training_step(self, batch: transformers.BatchEncoding, batch_idx: int) -> Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def loss_tokens(self, batch: transformers.BatchEncoding) -> Tensor:
        return (batch["labels"][:, 1:] != -100).sum()


class NanoGPTOnPairs(NanoGPT):
    """nanoGPT trained on ``(x, y)`` pairs, as a ``TensorDataset`` of inputs and targets yields them."""

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, loss = self.model(x, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class NanoGPTIgnoringLastTargets(NanoGPT):
    """nanoGPT whose step leaves each window's last target out of the loss itself, by nanoGPT's ``ignore_index=-1``."""

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].clone()
        y[:, -1] = -1
        logits, loss = self.model(x, y)
        return loss


PAD = 63  # a token id the arithmetic corpus never uses


def documents(count: int, *, padded: bool, seed: int = 0, longest: int = 24) -> list[dict[str, list[int]]]:
    """Tokenized documents as a dataset of them holds them: lines of sums (``417+38=455``), one to three to a
    document, so their lengths differ (``padded``), cut to ``longest`` tokens; or all cut to 16 tokens, so a batch
    needs no padding."""
    generator = torch.Generator().manual_seed(seed)
    corpus = torch.from_numpy(arithmetic_corpus(count * 40, seed=seed).astype("int64"))
    lines = corpus.tensor_split((corpus == ARITHMETIC_ALPHABET.index("\n")).nonzero().flatten() + 1)
    found, start = [], 0
    for _ in range(count):
        taken = int(torch.randint(1, 4, (), generator=generator)) if padded else 3
        tokens = torch.cat(lines[start : start + taken])
        start += taken
        found.append({"input_ids": (tokens[:longest] if padded else tokens[:16]).tolist()})
    return found


def language_modelling_collator() -> transformers.DataCollatorForLanguageModeling:
    """Hugging Face's collator for causal LM fine-tuning, over a word-level tokenizer of the model's 64 ids made on
    the spot: pads each batch to its longest document, masks the padding, labels it -100."""
    vocab = {f"t{token}": token for token in range(64)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")), pad_token=f"t{PAD}"
    )
    return transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=2)


def pairs(count: int, seq_len: int, *, seed: int = 0) -> TensorDataset:
    """Windows of the corpus as ``(inputs, targets)``: the targets are the inputs shifted by one token."""
    windows = torch.from_numpy(arithmetic_corpus(count * seq_len + 1, seed=seed).astype("int64"))
    windows = windows.unfold(0, seq_len + 1, seq_len)[:count]
    return TensorDataset(windows[:, :-1], windows[:, 1:])
