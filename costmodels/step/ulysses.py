"""What Ulysses sequence parallelism adds to a transformer block's tensor lifetimes, as
`trainplan.costmodels.step.memory.simulate_region(extra=...)` events on the block's captured (single-process)
graph.

The block is captured with plain SDPA. `trainplan.executor.parallel.ulysses.ulysses_attention_forward` (SP
degree P > 1) runs the same ops plus, around attention, the copies and buffers below; sizes at
micro-batch b and per-rank sequence s (the captured storages' bytes), heads h, kv heads h_kv
(replicated `rep = lcm(h_kv, P) / h_kv` times first when P does not divide h_kv), h/P heads (`hp`)
per rank after the exchange. Sources: torch 2.13, `torch/csrc/autograd` (what autograd saves),
`aten/src/ATen/native/TensorShape.cpp` (`reshape` copies when `computeStride` finds no view),
`_scaled_dot_product_flash_attention_for_cpu` (its output takes its query's memory layout: checked
with torch 2.13, strides of a transposed query's output), transformers 5.x `LlamaAttention.forward`
(q, k and v are `view(b, s, h, d).transpose(1, 2)`, RoPE keeps that layout, so a single-process
attention output is (b, s, h, d) in memory and its `transpose(1, 2).reshape(b, s, -1)` for `o_proj`
is a view), and per-op storage timelines of the block run with a simulated all-to-all
(`tests/integration/test_ulysses_memory.py` checks the result against MemTracker).

Forward, before attention, for q, k and v (k and v first repeated when rep > 1: a contiguous copy
that lives to the end of its exchange): the `_AllToAll` send buffer (a contiguous copy, made when
the (P, b, hp, s, d) view is not contiguous: always for the transposed q/k/v, only when b > 1 for a
repeated k/v; freed on return), its receive buffer, and the (b, hp, P*s, d) copy `reshape` makes of
it unless b*hp == 1 (then the buffer itself). Attention saves these head shards instead of q, k and
v, which are now freed when the attention module returns (its locals), not at attention's backward.
After attention (its output now (b, hp, P*s, d)-contiguous, like the head shards): a send buffer
when b*hp > 1, a receive buffer, and `o_proj`'s input, a copy that `o_proj` saves to its backward:
the tensor a single-process block does not have (there `o_proj` reads a view of attention's output).

Backward: `o_proj`'s input gradient is sent back (send buffer always, receive buffer, a
(b, hp, P*s, d) copy when b*hp > 1) and freed then, not at attention's backward; attention's
gradients for v, k, q (in that order) are each sent (send buffer when b*hp > 1, receive
buffer, a copy when b > 1 and hp > 1, summed back over the repeats when rep > 1) and freed
then; v's gradient arrives (b, h, s, d)-contiguous, so `v_proj`'s backward makes one more copy.

Checkpointed blocks: in the forward autograd saves nothing and the SAC policy never names these
copies, so the head shards and attention's output are freed when the attention function returns
(single process: attention's output lives to `o_proj`), `o_proj`'s input after `o_proj`; the
recompute at the start of the backward makes them all again (in `simulate_region`'s recompute
time) and autograd keeps what it keeps without checkpointing.

Assumes s > 1 and a block like the captured HF Llama/Qwen2 (one attention op, `o_proj` a matmul
on its output); under bf16 autocast the exchange buffers are sized at attention's input width.
Anything else found in the graph: no events (the single-process replay).
"""

from __future__ import annotations

import math

from trainplan.costmodels.checkpoint_sets import ATTENTION, MATMUL_OPS, canonical_op
from trainplan.costmodels.graph import Region, StorageRecord, poly_at

Event = tuple[float, float, float, str]


def kv_replication(n_kv_heads: int, sp_degree: int) -> int:
    """Times `trainplan.executor.parallel.ulysses.ulysses_attention_forward` repeats each kv head before the
    exchange: 1 when P divides h_kv, else lcm(h_kv, P) / h_kv."""
    return 1 if n_kv_heads % sp_degree == 0 else math.lcm(n_kv_heads, sp_degree) // n_kv_heads


class _Attention:
    """The captured nodes and storages around the block's attention."""

    def __init__(self, region: Region):
        g = region.graph
        self.region, self.g = region, g
        self.creators: dict[str, list[StorageRecord]] = {}
        for r in region.storages:
            self.creators.setdefault(r.creator, []).append(r)
        fwd = [n for n in g if g.nodes[n]["phase"] == "fwd" and canonical_op(g.nodes[n]["op"]) == ATTENTION]
        bwd = [n for n in g if g.nodes[n]["phase"] == "bwd" and "scaled_dot_product" in g.nodes[n]["op"]]
        self.ok = len(fwd) == 1 and len(bwd) == 1
        if not self.ok:
            return
        self.a, self.ab = fwd[0], bwd[0]
        preds = list(g.predecessors(self.a))
        srcs = [r for r in (self._source(p) for p in preds[:3]) if r is not None]
        outs = self.creators.get(self.a, [])
        grads = self.creators.get(self.ab, [])
        g_src = self._source(next(iter(g.predecessors(self.ab)), None))
        readers = self._mm_readers(self._getitems(self.a)[:1])
        dv_mm = self._mm_readers(self._getitems(self.ab)[2:3])
        fwd_mm = [self.order(n) for n in readers if g.nodes[n]["phase"] == "fwd"]
        bwd_mm = [self.order(n) for n in readers if g.nodes[n]["phase"] == "bwd"]
        # q, k, v each found in a storage, attention's output and its three input gradients
        if not (len(srcs) == 3 and len(outs) >= 1 and len(grads) == 3 and g_src is not None
                and fwd_mm and bwd_mm and dv_mm):
            self.ok = False
            return
        self.q, self.k, self.v = srcs
        self.out, (self.dq, self.dk, self.dv) = outs[0], grads
        self.grad_in = g_src
        self.t_a, self.t_ab = self.order(self.a), self.order(self.ab)
        self.t_oproj = min(fwd_mm)
        self.t_oproj_bwd = max(max(bwd_mm), g_src.created)  # o_proj's backward node is done
        self.t_v_bwd = min(self.order(n) for n in dv_mm)

    def order(self, n: str) -> int:
        return self.g.nodes[n]["order"]

    def _source(self, n: str | None) -> StorageRecord | None:
        """The storage node `n`'s output lives in (walking back through views)."""
        while n is not None and n not in self.creators:
            n = next(iter(self.g.predecessors(n)), None)
        return self.creators[n][0] if n is not None else None

    def _getitems(self, n: str) -> list[str]:
        return sorted((m for m in self.g.successors(n) if m not in self.creators), key=self.order)

    def _mm_readers(self, starts: list[str]) -> list[str]:
        """Matmul nodes reading the storage of `starts` through views."""
        seen, todo, found = set(starts), list(starts), []
        while todo:
            for m in self.g.successors(todo.pop()):
                if m in seen:
                    continue
                seen.add(m)
                if self.g.nodes[m]["op"] in MATMUL_OPS:
                    found.append(m)
                elif m not in self.creators:
                    todo.append(m)
        return found


def recompute_time(region: Region, k: float) -> float:
    """When the recompute at the start of a checkpointed region's backward replays forward
    index `k` (fractional indices allowed): `simulate_region`'s own schedule
    (`bnd + 0.5 + 0.4 * (k + 1) / (bnd + 2)`)."""
    bnd = region.boundary
    return bnd + 0.5 + 0.4 * (k + 1) / (bnd + 2)


class _Timeline:
    """Storages made and freed one after another inside (t0, t1) (mapped by `when`): each
    `alloc`/`free` takes the next of 64 evenly spaced moments, so their order is kept."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[float, float, str]] = {}
        self.events: list[Event] = []

    def span(self, t0: float, t1: float, when=lambda t: t) -> _Timeline:
        self.t0, self.dt, self.when, self.i = t0, (t1 - t0) / 64, when, 0
        return self

    def now(self) -> float:
        self.i += 1
        return self.when(self.t0 + self.dt * self.i)

    def alloc(self, key: str, nbytes: float, cat: str) -> None:
        self.live[key] = (self.now(), nbytes, cat)

    def free(self, key: str, at: float | None = None) -> None:
        t0, nbytes, cat = self.live.pop(key)
        self.events.append((t0, self.now() if at is None else at, nbytes, cat))

    def rename(self, old: str, new: str) -> None:
        self.live[new] = self.live.pop(old)

    def add(self, t0: float, t1: float, nbytes: float, cat: str) -> None:
        if t1 > t0 and nbytes:
            self.events.append((t0, t1, nbytes, cat))


def ulysses_block_events(region: Region, b: int, s: int, *, sp_degree: int, n_heads: int,
                         n_kv_heads: int, checkpoint: bool = False,
                         saved_ops=frozenset()) -> list[Event]:
    """`simulate_region(region, b, s, checkpoint=..., saved_ops=..., extra=...)` events (made
    at, freed at, bytes, `act`|`temp`) for Ulysses SP of degree `sp_degree` (module docstring),
    b = micro-batch, s = per-rank sequence, times on the region's execution indices. Negative
    bytes shorten a captured storage's life. [] for sp_degree 1, or a block without one
    attention op whose output a matmul reads."""
    if sp_degree <= 1:
        return []
    at = _Attention(region)
    if not at.ok:
        return []
    p, rep = sp_degree, kv_replication(n_kv_heads, sp_degree)

    def size(r: StorageRecord) -> float:
        return poly_at(r.bytes, b, s)

    src = {"q": at.q, "k": at.k, "v": at.v}
    grad = {"q": at.dq, "k": at.dk, "v": at.dv}
    sent = {"q": size(at.q), "k": size(at.k) * rep, "v": size(at.v) * rep}
    hp = {"q": n_heads // p, "k": n_kv_heads * rep // p, "v": n_kv_heads * rep // p}
    o_b, g_b = size(at.out), size(at.grad_in)
    t_a, t_ab, t_o, t_ob = at.t_a, at.t_ab, at.t_oproj, at.t_oproj_bwd
    end_attn = t_o + 0.5  # the attention module returns: its locals q, k, v are freed
    saved = frozenset(saved_ops)
    tl = _Timeline()

    def forward(when, keep: bool) -> float:
        """One forward of the exchanges around attention; `keep`: autograd saves the head
        shards (to attention's backward) and o_proj's input (to o_proj's backward). Returns
        when the attention function has returned."""
        tl.span(t_a - 1, t_a, when)
        if rep > 1:  # repeat_interleave before any exchange: contiguous (b, h_kv*rep, s, d)
            for x in "kv":
                tl.alloc("rep" + x, sent[x], "act")
        for x in "qkv":
            if x == "q" or rep == 1 or b > 1:  # the (P, b, hp, s, d) view is not contiguous
                tl.alloc("send", sent[x], "act")
            tl.alloc("recv", sent[x], "act")
            if "send" in tl.live:
                tl.free("send")
            if b * hp[x] > 1:  # reshape to (b, hp, P*s, d) copies
                tl.alloc("head" + x, sent[x], "act")
                tl.free("recv")
            else:
                tl.rename("recv", "head" + x)
            if "rep" + x in tl.live:
                tl.free("rep" + x)
        tl.span(t_a, t_a + 1, when)
        if b * hp["q"] > 1:  # attention's output viewed (P, b, hp, s, d) is not contiguous
            tl.alloc("send", o_b, "act")
        tl.alloc("recv", o_b, "act")
        if "send" in tl.live:
            tl.free("send")
        inside = b > 1 and hp["q"] > 1  # `_head_to_seq`'s reshape copies; else HF's reshape does
        if inside:
            tl.alloc("oproj_in", o_b, "act")
            tl.free("recv")
        for x in "qkv":  # the attention function returns
            tl.free("head" + x, at=t_ab if keep else None)
        t_ret = tl.now()
        if not inside:
            tl.alloc("oproj_in", o_b, "act")
            tl.free("recv")
        tl.free("oproj_in", at=t_ob if keep else t_o)
        return t_ret

    def shorten_qkv(t_end: float) -> None:
        for x in "qkv":
            if src[x].last_use == t_ab:  # attention's backward was its last reader
                tl.add(t_end, t_ab, -size(src[x]), "act")

    if not checkpoint:
        forward(lambda t: t, keep=True)
        shorten_qkv(end_attn)
    else:
        t_ret = forward(lambda t: t, keep=False)
        if at.a not in saved and at.out.last_fwd_use > t_ret:  # attention's output: freed on return
            tl.add(t_ret, at.out.last_fwd_use, -o_b, "act")
        if region.recompute_horizon() > t_o:  # the recompute runs past o_proj
            forward(lambda t: recompute_time(region, t), keep=True)
            shorten_qkv(recompute_time(region, end_attn))
    # backward: o_proj's input gradient back to head shards, then attention's gradients
    tl.span(t_ob, t_ob + 1)
    tl.alloc("send", g_b, "temp")
    tl.alloc("recv", g_b, "temp")
    tl.free("send")
    if at.grad_in.last_use == t_ab:
        tl.add(tl.now(), t_ab, -g_b, "temp")
    if b * hp["q"] > 1:
        tl.alloc("grad_out", g_b, "temp")
        tl.free("recv")
        tl.free("grad_out", at=t_ab)
    else:
        tl.free("recv", at=t_ab)
    tl.span(t_ab, t_ab + 1)
    for x in "vkq":
        extra = sent[x] - size(grad[x])  # the repeated kv heads' gradients
        if b * hp[x] > 1:
            tl.alloc("send", sent[x], "temp")
        tl.alloc("recv", sent[x], "temp")
        if "send" in tl.live:
            tl.free("send")
        t = tl.now()  # attention's gradient is freed
        tl.add(t_ab, t, extra, "temp")
        tl.add(t, grad[x].last_use, -size(grad[x]), "temp")
        if b > 1 and hp[x] > 1:  # (P, b, hp, s, d) -> (b, h, s, d) copies
            tl.alloc("grad" + x, sent[x], "temp")
            tl.free("recv")
        else:
            tl.rename("recv", "grad" + x)
    if rep > 1:  # summed back over the repeats
        for x in "vk":
            tl.alloc("sum", size(grad[x]), "temp")
            tl.free("grad" + x)
            tl.rename("sum", "grad" + x)
    for x in "qk":
        tl.free("grad" + x, at=grad[x].last_use)
    t_copy = at.t_v_bwd - 0.5  # v_proj's backward views v's gradient as (b*s, h_kv*d): a copy
    tl.add(t_copy, at.dv.last_use, size(at.dv), "temp")
    tl.free("gradv", at=t_copy + 0.1)
    return tl.events
