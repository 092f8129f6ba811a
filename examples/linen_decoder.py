"""A decoder written from scratch in flax.linen, served by paged_jax.LLM.

The engine runs NNX modules, so the Linen model is wrapped with ``nnx.bridge.ToNNX``;
the paged cache is an argument and a result of the Linen ``__call__``, like any pytree.
Run: python examples/linen_decoder.py  (prints the greedy tokens twice: paged and uncached)
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import paged_jax as pj


@dataclasses.dataclass(frozen=True)
class Config:  # what the engine reads: vocab_size, max_position_embeddings
    vocab_size: int = 128
    max_position_embeddings: int = 256
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2


def causal_attention(q, k, v):  # one sequence, no cache: [T, H, D] x [T, K, D] -> [T, H, D]
    k, v = (jnp.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
    s = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[0], q.shape[0]), bool))
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(jnp.where(causal, s, -jnp.inf)), v)


class LinenDecoder(nn.Module):
    c: Config

    @nn.compact
    def __call__(self, tokens, positions, cache=None, metadata=None):
        c, hd, T = self.c, self.c.dim // self.c.heads, tokens.shape[0]
        x = nn.Embed(c.vocab_size, c.dim)(tokens) + nn.Embed(c.max_position_embeddings, c.dim)(
            positions
        )
        for i in range(c.layers):  # a Python loop over layers, not tokens
            h = nn.RMSNorm()(x)
            q = nn.Dense(c.heads * hd, use_bias=False)(h).reshape(T, c.heads, hd)
            kv = nn.Dense(2 * c.kv_heads * hd, use_bias=False)(h)
            k, v = jnp.split(kv.reshape(T, 2 * c.kv_heads, hd), 2, axis=1)
            if cache is None:
                o = causal_attention(q, k, v)
            else:  # the paged cache replaces the model's own KV cache
                o, cache = pj.paged_self_attention(q, k, v, cache, i, metadata)
            x = x + nn.Dense(c.dim, use_bias=False)(o.reshape(T, -1))
            x = x + nn.Dense(c.dim)(jax.nn.gelu(nn.Dense(4 * c.dim)(nn.RMSNorm()(x))))
        if cache is None:
            return nn.Dense(c.vocab_size)(x)
        return nn.Dense(c.vocab_size)(x[metadata.logits_indices]), cache


class PagedLinen(nnx.Module):  # the PagedDecoder protocol around the Linen model
    def __init__(self, c: Config, seed: int = 0):
        self.config = c
        self.net = nnx.bridge.ToNNX(LinenDecoder(c), rngs=nnx.Rngs(seed))
        nnx.bridge.lazy_init(self.net, jnp.zeros(4, jnp.int32), jnp.arange(4))

    def make_cache(self, num_pages, page_size, dtype=None):
        c = self.config
        return pj.PagedKVCache.create(
            c.layers, num_pages, page_size, c.kv_heads, c.dim // c.heads, dtype or jnp.float32
        )

    def __call__(self, tokens, positions, cache, metadata):
        return self.net(tokens, positions, cache, metadata)


def main():
    model = PagedLinen(Config())
    llm = pj.LLM(model, num_pages=64, page_size=8, compilation_cache=False)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 40))]
    params = pj.SamplingParams(max_tokens=12, ignore_eos=True)  # greedy
    paged = [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)]
    uncached = nnx.jit(lambda m, ids: m.net(ids, jnp.arange(ids.shape[0])))
    for prompt in prompts:  # the same decoding, recomputing everything each token
        ids = list(prompt)
        for _ in range(12):  # padded to 64 tokens (one compile); causal, so padding is unseen
            logits = uncached(model, jnp.zeros(64, jnp.int32).at[: len(ids)].set(jnp.array(ids)))
            ids.append(int(jnp.argmax(logits[len(ids) - 1])))
        print(paged.pop(0), ids[len(prompt) :])


if __name__ == "__main__":
    main()
