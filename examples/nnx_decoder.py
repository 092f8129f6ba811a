"""A decoder written from scratch in Flax NNX, served by paged_jax.LLM.

Run: python examples/nnx_decoder.py  (prints the greedy tokens twice: paged and uncached)
"""

import dataclasses

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


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.hd, self.c = c.dim // c.heads, c
        self.norm1, self.norm2 = nnx.RMSNorm(c.dim, rngs=rngs), nnx.RMSNorm(c.dim, rngs=rngs)
        self.q = nnx.Linear(c.dim, c.heads * self.hd, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(c.dim, 2 * c.kv_heads * self.hd, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(c.heads * self.hd, c.dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.dim, 4 * c.dim, rngs=rngs)
        self.down = nnx.Linear(4 * c.dim, c.dim, rngs=rngs)

    def __call__(self, x, attend):  # x: [T, dim]; attend(q, k, v) -> [T, heads, hd]
        h, T = self.norm1(x), x.shape[0]
        q = self.q(h).reshape(T, self.c.heads, self.hd)
        k, v = jnp.split(self.kv(h).reshape(T, 2 * self.c.kv_heads, self.hd), 2, axis=1)
        x = x + self.o(attend(q, k, v).reshape(T, -1))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Decoder(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.config = c
        self.embed = nnx.Embed(c.vocab_size, c.dim, rngs=rngs)
        self.pos = nnx.Embed(c.max_position_embeddings, c.dim, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
        self.head = nnx.Linear(c.dim, c.vocab_size, rngs=rngs)

    @nnx.jit
    def uncached(self, tokens):  # i32[T] -> f32[T, V]: one sequence, plain causal attention
        def attend(q, k, v):
            k, v = (jnp.repeat(a, q.shape[1] // a.shape[1], axis=1) for a in (k, v))
            s = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(q.shape[-1])
            causal = jnp.tril(jnp.ones((len(tokens), len(tokens)), bool))
            return jnp.einsum("hts,shd->thd", jax.nn.softmax(jnp.where(causal, s, -jnp.inf)), v)

        x = self.embed(tokens) + self.pos(jnp.arange(len(tokens)))
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)

    # --- the PagedDecoder protocol: make_cache and __call__ -----------------------------
    def make_cache(self, num_pages, page_size, dtype=None):
        c = self.config
        return pj.PagedKVCache.create(
            c.layers, num_pages, page_size, c.kv_heads, c.dim // c.heads, dtype or jnp.float32
        )

    def __call__(self, tokens, positions, cache, metadata):  # i32[T], i32[T] -> f32[R, V]
        x = self.embed(tokens) + self.pos(positions)
        for i, block in enumerate(self.blocks):  # a Python loop over layers, not tokens

            def attend(q, k, v, i=i):
                nonlocal cache
                o, cache = pj.paged_self_attention(q, k, v, cache, i, metadata)
                return o

            x = block(x, attend)
        return self.head(x[metadata.logits_indices]), cache


def main():
    model = Decoder(Config(), nnx.Rngs(0))
    llm = pj.LLM(model, num_pages=64, page_size=8, compilation_cache=False)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 40))]
    params = pj.SamplingParams(max_tokens=12, ignore_eos=True)  # greedy
    paged = [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)]
    for prompt in prompts:  # the same decoding, recomputing everything each token
        ids = list(prompt)
        for _ in range(12):  # padded to 64 tokens (one compile); causal, so padding is unseen
            logits = model.uncached(jnp.zeros(64, jnp.int32).at[: len(ids)].set(jnp.array(ids)))
            ids.append(int(jnp.argmax(logits[len(ids) - 1])))
        print(paged.pop(0), ids[len(prompt) :])


if __name__ == "__main__":
    main()
