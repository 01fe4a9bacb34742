"""Small decoder-only language models and greedy generation with a KV cache, as the Hugging Face
models do it: the prompt is read at once (prefill), then one token at a time, each step reading
back whether to stop. Used by the tests and the inference benchmark.

`GPT2Style` has learned positions, LayerNorm, GELU and a head tied to the token embedding;
`LlamaStyle` has rotary positions, RMSNorm, SwiGLU and grouped key/value heads.

The cache is "dynamic" (keys and values grow by one each step, `torch.cat`) or "static" (buffers
of the full context written in place at the step's position; attention masks the rest).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Cache:
    """Keys and values of every layer for one generation."""

    def __init__(self, kind, layers, batch, kv_heads, head_dim, context, like):
        self.kind = kind
        self.length = 0  # tokens held
        if kind == "static":
            shape = (batch, kv_heads, context, head_dim)
            self.k = [like.new_zeros(shape) for _ in range(layers)]
            self.v = [like.new_zeros(shape) for _ in range(layers)]
        else:
            self.k = [None] * layers
            self.v = [None] * layers

    def update(self, layer, k, v):
        """Adds this step's keys and values; returns all keys and values to attend to."""
        if self.kind == "static":
            t = k.shape[2]
            self.k[layer][:, :, self.length:self.length + t] = k
            self.v[layer][:, :, self.length:self.length + t] = v
        elif self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def mask(self, t, device):
        """[t, keys] True where query i (at position length+i) may attend to key j."""
        keys = self.k[0].shape[2] if self.kind == "static" else self.length + t
        query = torch.arange(t, device=device).unsqueeze(1) + self.length
        return torch.arange(keys, device=device).unsqueeze(0) <= query


def attend(q, k, v, mask):
    """Causal attention of q [b, h, t, d] over k, v [b, kv, keys, d] (kv divides h)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return att @ v


class GPT2Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x, layer, cache, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        k, v = cache.update(layer, k, v)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2Style(nn.Module):
    def __init__(self, vocab=96, dim=64, heads=4, layers=2, context=128):
        super().__init__()
        self.vocab, self.context, self.heads, self.head_dim = vocab, context, heads, dim // heads
        self.kv_heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(GPT2Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        # Small embeddings, so that the tied head does not just repeat the last token.
        nn.init.normal_(self.tok.weight, std=0.1)

    def forward(self, ids, cache):
        t = ids.shape[1]
        positions = torch.arange(cache.length, cache.length + t, device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        mask = cache.mask(t, ids.device)
        for i, block in enumerate(self.blocks):
            x = block(x, i, cache, mask)
        cache.length += t
        return self.head(self.ln(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.norm2 = RMSNorm(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, layer, cache, mask, cos, sin):
        b, t, c = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = cache.update(layer, k, v)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(b, t, c)
        x = x + self.o(y)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaStyle(nn.Module):
    def __init__(self, vocab=96, dim=64, heads=4, kv_heads=2, layers=2, hidden=160, context=128):
        super().__init__()
        self.vocab, self.context, self.heads, self.head_dim = vocab, context, heads, dim // heads
        self.kv_heads = kv_heads
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            LlamaBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids, cache):
        t = ids.shape[1]
        positions = torch.arange(cache.length, cache.length + t, device=ids.device).float()
        freqs = positions.unsqueeze(1) * self.inv_freq.unsqueeze(0)
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.tok(ids)
        mask = cache.mask(t, ids.device)
        for i, block in enumerate(self.blocks):
            x = block(x, i, cache, mask, cos, sin)
        cache.length += t
        return self.head(self.norm(x))


@torch.no_grad()
def generate(model, prompt, new_tokens, cache="dynamic", eos=None):
    """Greedy decoding: `prompt` [batch, t] grows by up to `new_tokens` tokens. After each token
    the loop reads back whether every sequence has produced `eos` (one wait a token, as in
    Hugging Face's generate); with `eos=None` it checks and goes on."""
    b = prompt.shape[0]
    kv = Cache(cache, len(model.blocks), b, model.kv_heads, model.head_dim, model.context,
               model.tok.weight)
    ids = prompt
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    step = prompt
    for _ in range(new_tokens):
        logits = model(step, kv)
        step = logits[:, -1].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, step], dim=1)
        done = done | (step.squeeze(1) == (eos if eos is not None else -1))
        if done.all().item():
            break
    return ids
