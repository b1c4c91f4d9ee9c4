"""The engine's rows and the prefix cache (prefix_cache.py): which prefix a new row takes, when it copies
it, and what a row leaves behind. Called by engine/batched.py at each plan, before each step's blocks,
and when a row's prompt is read, it finishes or it is cancelled."""
from __future__ import annotations

from collections.abc import Sequence

from specstack.cache import KVCache
from specstack.engine.plan import RowState, StepPlan
from specstack.engine.rows import Row
from specstack.prefix_cache import PrefixCache


def look_up(prefix: PrefixCache, running: Sequence[Row], rows: Sequence[Row]) -> None:
    """Each of `rows` that has read nothing yet (oldest first): its longest cached prefix, and whether it
    waits (`held`) for an older row reading at least a block more of the same prompt, so that a prompt
    sent n times (n samples, retries) is read once and copied n - 1 times. A row whose drafter reads the
    target's activations takes no prefix (the cache keeps keys and values only), nor one that asked for
    its prompt's log-probabilities (a copied prefix has no logits): it reads its prompt, as without a
    cache. running: the engine's rows (those reading a prompt are the ones to wait for)."""
    readers = [r.request.prompt_ids for r in running if not r.fresh and r.state is RowState.PREFILLING]
    for row in sorted((r for r in rows if r.fresh), key=lambda r: r.handle):
        prompt = row.request.prompt_ids
        if row.reads_whole_prompt:
            readers.append(prompt)
            continue
        row.match = prefix.match(prompt, len(prompt) - 1)
        reach = row.match.tokens + prefix.block_size
        row.held = reach < len(prompt) and any(len(p) > reach and p[:reach] == prompt[:reach] for p in readers)
        if not row.held:
            readers.append(prompt)


def attach(prefix: PrefixCache, cache: KVCache, rows: Sequence[Row], plan: StepPlan) -> None:
    """Rows about to read their first tokens (row i of `rows` is cache row i) copy their cached prefix."""
    for i, row in enumerate(rows):
        if not row.fresh or not plan.reads.get(row.handle):
            continue
        row.fresh = False
        if row.reads_whole_prompt:
            continue
        match = row.match
        prefix.use(match)
        if not match.tokens:
            continue
        cache.load_prefix(i, match.pieces())
        row.pending = row.pending[match.tokens:]
        row.stats.cached_tokens = match.tokens
        if len(row.pending) == 1 and row.state is RowState.PREFILLING:  # all but its root was cached
            row.move(RowState.DECODING)


def publish(prefix: PrefixCache, cache: KVCache, i: int, row: Row) -> None:
    """Cache row i's committed tokens into the prefix cache (the blocks not there yet are copied)."""
    kv = cache.committed_kv(i)
    if kv is not None:
        prefix.store(row.ctx.tokens[: cache.lengths[i]], *kv)
